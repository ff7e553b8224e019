"""POST /v1/chat/completions: messages (and tools) -> the model's chat template -> one Triton request,
n samples -> assistant messages: reasoning (openai_frontend/reasoning_parsers.py) apart, tool calls
read out of the rest (openai_frontend/tool_calls.py). /v1/responses runs on the same road."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from openai_frontend.errors import OpenAIError, invalid
from openai_frontend.generation import (Choices, check_stream_options, chunk_frames, log_completion, log_request,
                                        logprob_value, replay, sampling_parameters, sse_stream, start,
                                        structured_outputs, unless_disconnected)
from openai_frontend.media import ImagePart, ImagePrompt, name_image_error
from openai_frontend.reasoning_parsers import PARSERS as REASONING_PARSERS
from openai_frontend.reasoning_parsers import ReasoningStream, ThinkParser
from openai_frontend.schemas import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatLogprobs, ChatMessage, TokenLogprob, ToolCallOut, TopLogprob)
from openai_frontend.tool_calls import ToolCallStream, ToolPlan
from openai_frontend.tool_parsers import PARSERS, Call
from openai_frontend.triton import TokenLogprob as SampledLogprob

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
# Arguments of apply_chat_template the frontend sets itself: chat_template_kwargs may not override them.
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer_kwargs",
                                "return_tensors", "padding", "truncation", "max_length"})


def template_messages(messages: list[ChatMessage], where: list[str] | None = None
                      ) -> tuple[list[dict], list[ImagePart]]:
    """Messages as the chat template reads them, and the images they name in order: content as
    template_content gives it, a call's arguments as an object (templates write them with `tojson`).
    `where`: each message's name in errors (`messages[i]` by default; the Responses API's input items)."""
    rendered: list[dict] = []
    images: list[ImagePart] = []
    for i, message in enumerate(messages):
        name = where[i] if where else f"messages[{i}]"
        content = template_content(message, name, images)
        entry: dict = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        for j, call in enumerate(message.tool_calls or ()):
            param = f"{name}.tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise invalid(param, f"{param}: must be a JSON object, as text")
            entry.setdefault("tool_calls", []).append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
        if message.role == "tool" and message.tool_call_id is None:  # OpenAI refuses it too
            raise invalid(f"{name}.tool_call_id", f"{name}.tool_call_id: required in a tool message (which call it "
                                                  "answers)")
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if (message.reasoning or message.reasoning_content) and message.role == "assistant":
            entry["reasoning_content"] = message.reasoning or message.reasoning_content  # as Qwen3's template reads it
        rendered.append(entry)
    return rendered, images


def template_content(message: ChatMessage, name: str, images: list[ImagePart]) -> str | list[dict]:
    """A message's content as one string; where it holds images, a list of text parts and
    {"type": "image"} parts (as transformers' chat templates read them), the images appended to `images`."""
    if not isinstance(message.content, list):
        return message.content or ""
    parts: list[dict] = []
    for j, part in enumerate(message.content):
        param = f"{name}.content[{j}]"
        if part.type == "image_url":
            if part.image_url is None:
                raise invalid(param, f"{param}: an image_url part needs image_url.url")
            if message.role != "user":
                raise invalid(param, f"{param}: images go in user messages only")
            images.append(ImagePart(param, part.image_url.url))
            parts.append({"type": "image"})
        elif part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        else:
            raise invalid(param, f"{param}: text and image_url parts are supported, got {part.type!r}")
    if any(part["type"] == "image" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def tool_plan(frontend, body: ChatCompletionRequest) -> ToolPlan:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    choice: Any = body.tool_choice
    if choice not in (None, "none") and not tools:
        raise invalid("tool_choice", "tool_choice: needs tools")
    if choice is not None and not isinstance(choice, str):
        if choice.function.name not in {tool["function"]["name"] for tool in tools}:
            raise invalid("tool_choice", f"tool_choice: no tool named {choice.function.name!r} in tools")
        choice = choice.model_dump()
    plan = ToolPlan(tools, choice, PARSERS[frontend.settings.tool_call_parser](), body.parallel_tool_calls)
    if plan.mode == "auto" and not frontend.settings.enable_auto_tool_choice:
        raise invalid("tool_choice", AUTO_NEEDS_FLAGS)  # vLLM's words: tools alone mean "auto" there too
    return plan


def template_kwargs(body: ChatCompletionRequest) -> dict:
    kwargs = body.chat_template_kwargs or {}
    clashing = sorted(TEMPLATE_ARGUMENTS & set(kwargs))
    if clashing:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs: {', '.join(clashing)} cannot be set here")
    return kwargs


@dataclass
class ChatJob:
    """One chat request, ready for Triton: its prompt, sampling parameters and how its answers are read."""
    body: ChatCompletionRequest
    prompt_ids: list[int]
    parameters: dict
    plan: ToolPlan
    reasoning: ThinkParser | None
    structured_param: str | None
    top_logprobs: int | None
    include_usage: bool
    prompt_text: str = ""  # what the chat template wrote: sent as text when there are images
    images: list[ImagePart] = field(default_factory=list)

    def read(self, text: str) -> tuple[str | None, str, list[Call]]:
        """A whole answer -> (reasoning, content, calls)."""
        reasoning, text = self.reasoning.split(text) if self.reasoning else (None, text)
        content, calls = self.plan.read(text)
        return reasoning or None, content, calls

    def answer_stream(self) -> "AnswerStream":
        return AnswerStream(self.reasoning.stream() if self.reasoning else None, self.plan.stream())


def prepare_chat(frontend, body: ChatCompletionRequest, where: list[str] | None = None) -> ChatJob:
    """Validate a chat request and turn it into a prompt and Triton's sampling parameters (the
    images it names are checked, not read yet). `where`: the messages' names in errors."""
    adapter = frontend.check_llm_model(body.model)  # {} or the LoRA adapter's sampling parameters
    include_usage = check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs: needs logprobs set to true")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    plan = tool_plan(frontend, body)
    structured = structured_outputs(body)
    forced = plan.structured_outputs()
    if forced is not None:
        if structured[0] is not None:
            raise invalid("tool_choice", f"tool_choice: {plan.mode} calls a tool; it cannot be combined "
                                         f"with {structured[1]}")
        structured = (forced, "tools")
    reasoning = None
    if frontend.settings.reasoning_parser is not None:
        reasoning = REASONING_PARSERS[frontend.settings.reasoning_parser]()
        if structured[0] is not None:  # held from the first token: no block the template opened
            reasoning = reasoning.constrained()
    if plan.mode == "auto" and plan.parser.keeps_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})  # its markers are special tokens
    messages, images = template_messages(body.messages, where)
    if images:
        check_images(frontend, body, images)
    prompt_text, prompt_ids = frontend.prompts.render_chat(messages, body.add_generation_prompt,
                                                           body.continue_final_message, plan.prompt_tools,
                                                           plan.parser, template_kwargs(body))
    prompt_ids = frontend.prompts.truncate(prompt_ids, body.truncate_prompt_tokens)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = frontend.prompts.max_tokens_for(len(prompt_ids), requested, "messages")
    parameters = sampling_parameters(body, max_tokens=max_tokens, logprobs=top_logprobs,
                                     vocab_size=frontend.prompts.vocab_size, structured=structured) | adapter
    if images and requested is None:  # the engine fills the context: only it knows how many tokens each image takes
        parameters["max_tokens"] = None
    return ChatJob(body, prompt_ids, parameters, plan, reasoning, structured[1], top_logprobs, include_usage,
                   prompt_text, images)


def check_images(frontend, body: ChatCompletionRequest, images: list[ImagePart]) -> None:
    """What can be refused before any image is read: a model without images, too many of them,
    a source the operator did not open. The prompt's token count is a lower bound with images."""
    if frontend.prompts.image_token is None:
        raise invalid(images[0].param, f"{images[0].param}: the model `{frontend.settings.served_model_name}` "
                                       "does not accept images")
    if body.truncate_prompt_tokens is not None:
        raise invalid("truncate_prompt_tokens", "truncate_prompt_tokens: not with images (it would cut them)")
    frontend.media.check(images)


async def start_job(frontend, job: ChatJob, stream: bool):
    """Read the job's images (if any), then send it to Triton and wait for its first response;
    Triton's refusal of an image names the content part."""
    images = None
    if job.images:
        images = ImagePrompt(job.prompt_text, await frontend.media.load(job.images))
    try:
        return await start(frontend.triton, [job.prompt_ids], [job.parameters], stream=stream,
                           prompt_param="messages", structured_param=job.structured_param,
                           images=None if images is None else [images])
    except OpenAIError as error:
        raise name_image_error(error, job.images) from None


def reasoning_delta(text: str) -> list[dict]:
    # vLLM's field is `reasoning` now; `reasoning_content` (DeepSeek's, vLLM's before) for older clients.
    return [{"reasoning": text, "reasoning_content": text}] if text else []


class AnswerStream:
    """One streamed choice: its reasoning first, then content and tool calls, as chat deltas."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream) -> None:
        self.reasoning, self.tools = reasoning, tools

    @property
    def calls(self) -> list[Call]:
        return self.tools.calls

    def feed(self, text: str) -> list[dict]:
        if self.reasoning is None:
            return self.tools.feed(text)
        thought, content = self.reasoning.feed(text)
        return reasoning_delta(thought) + (self.tools.feed(content) if content else [])

    def finish(self) -> list[dict]:
        deltas = []
        if self.reasoning is not None:
            thought, content = self.reasoning.finish()
            deltas = reasoning_delta(thought) + (self.tools.feed(content) if content else [])
        return deltas + self.tools.finish()


async def stream_answers(frontend, job: ChatJob, raw_request: Request, choices: Choices
                         ) -> AsyncIterator[tuple[int, list[dict], dict | None, str | None]]:
    """Start a streamed request (its HTTP status decided by Triton's first response), then yield
    (choice index, deltas, logprobs, finish reason) as the answers grow."""
    first, rest = await unless_disconnected(raw_request, start_job(frontend, job, stream=True))
    streams = [job.answer_stream() for _ in range(job.body.n)]

    async def answers():
        async for prompt_index, response in replay(first, rest):
            for index, delta in choices.update(prompt_index, response):
                logprobs = None
                if job.top_logprobs is not None:
                    logprobs = chat_logprobs(delta.logprobs or [], job.top_logprobs).model_dump()
                stream, finish_reason = streams[index], delta.finish_reason
                deltas = stream.feed(delta.text)
                if finish_reason is not None:
                    deltas += stream.finish()
                    finish_reason = job.plan.finish_reason(stream.calls, finish_reason)
                if deltas or finish_reason is not None or logprobs is not None:
                    yield index, deltas, logprobs, finish_reason
    return answers()


async def run_whole(frontend, job: ChatJob, raw_request: Request, choices: Choices) -> None:
    async def collect():
        first, rest = await start_job(frontend, job, stream=False)
        async for prompt_index, response in replay(first, rest):
            choices.update(prompt_index, response)

    await unless_disconnected(raw_request, collect())


def chat_logprobs(entries: list[list[SampledLogprob]], top_logprobs: int) -> ChatLogprobs:
    def item(entry: SampledLogprob) -> dict:
        return {"token": entry.token, "logprob": logprob_value(entry.logprob),
                "bytes": list(entry.token.encode("utf-8"))}

    content = []
    for position in entries:
        # The engine sends the sampled token first, then the top-N by rank (it may be among them).
        top = sorted((e for e in position if e.rank is not None and e.rank <= top_logprobs), key=lambda e: e.rank)
        unique = {e.token_id: e for e in top}.values()
        content.append(TokenLogprob(**item(position[0]), top_logprobs=[TopLogprob(**item(e)) for e in unique]))
    return ChatLogprobs(content=content)


async def serve_chat_completion(frontend, body: ChatCompletionRequest, raw_request: Request):
    job = prepare_chat(frontend, body)
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    choices = Choices(1, body.n, frontend.settings.enable_prompt_tokens_details)
    log_request(frontend, response_id, [job.prompt_ids], [job.parameters])

    if body.stream:
        answers = await stream_answers(frontend, job, raw_request, choices)
        frame = chunk_frames(response_id, "chat.completion.chunk", created, body.model)

        async def events():
            for index in range(body.n):
                yield frame({"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
            async for index, deltas, logprobs, finish_reason in answers:
                deltas = deltas or [{}]
                for k, piece in enumerate(deltas):
                    yield frame({"index": index, "delta": piece, "logprobs": logprobs if k == 0 else None,
                                 "finish_reason": finish_reason if k == len(deltas) - 1 else None})
            if job.include_usage:
                yield {"id": response_id, "object": "chat.completion.chunk", "created": created,
                       "model": body.model, "choices": [], "usage": choices.usage().model_dump()}
            log_completion(frontend, response_id, choices)

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    def answer(index: int, choice) -> ChatChoice:
        reasoning, content, calls = job.read(choice.text)
        message = AssistantMessage(content=(content.strip() or None) if calls else content,
                                   reasoning=reasoning, reasoning_content=reasoning,
                                   tool_calls=[ToolCallOut.model_validate(call.message()) for call in calls] or None)
        return ChatChoice(index=index, message=message, finish_reason=job.plan.finish_reason(calls, choice.finish_reason),
                          logprobs=chat_logprobs(choice.logprobs, job.top_logprobs)
                          if job.top_logprobs is not None else None)

    await run_whole(frontend, job, raw_request, choices)
    log_completion(frontend, response_id, choices)
    return ChatCompletionResponse(id=response_id, created=created, model=body.model, usage=choices.usage(),
                                  choices=[answer(index, choice) for index, choice in enumerate(choices.choices)])
