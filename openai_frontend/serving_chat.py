"""POST /v1/chat/completions: messages (and tools) -> the model's chat template -> one Triton request,
n samples -> assistant messages, with tool calls read out of them (openai_frontend/tool_parsers.py)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from openai_frontend.errors import invalid
from openai_frontend.generation import (Choices, check_stream_options, log_completion, log_request, logprob_value,
                                        replay, sampling_parameters, sse_stream, start, structured_outputs,
                                        unless_disconnected)
from openai_frontend.schemas import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatLogprobs, ChatMessage, TokenLogprob, ToolCallOut, TopLogprob)
from openai_frontend.tool_parsers import PARSERS, ToolPlan
from openai_frontend.triton import TokenLogprob as SampledLogprob



def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template reads them: content flattened to one string, a call's arguments
    as an object (templates write them with `tojson`)."""
    rendered = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"messages[{i}].content[{j}]",
                                  f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}")
            content = "\n".join(part.text for part in content)
        entry: dict = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        for j, call in enumerate(message.tool_calls or ()):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise invalid(param, f"{param}: must be a JSON object, as text")
            entry.setdefault("tool_calls", []).append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
        if message.role == "tool" and message.tool_call_id is None:  # OpenAI refuses it too
            raise invalid(f"messages[{i}].tool_call_id",
                          f"messages[{i}].tool_call_id: required in a tool message (which call it answers)")
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def tool_plan(body: ChatCompletionRequest, parser: str) -> ToolPlan:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    choice: Any = body.tool_choice
    if choice not in (None, "none") and not tools:
        raise invalid("tool_choice", "tool_choice: needs tools")
    if choice is not None and not isinstance(choice, str):
        if choice.function.name not in {tool["function"]["name"] for tool in tools}:
            raise invalid("tool_choice", f"tool_choice: no tool named {choice.function.name!r} in tools")
        choice = choice.model_dump()
    return ToolPlan(tools, choice, PARSERS[parser](), body.parallel_tool_calls)


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
    adapter = frontend.check_llm_model(body.model)  # {} or the LoRA adapter's sampling parameters
    include_usage = check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs: needs logprobs set to true")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    plan = tool_plan(body, frontend.settings.tool_call_parser)  # the frontend's --tool-call-parser
    structured = structured_outputs(body)
    forced = plan.structured_outputs()
    if forced is not None:
        if structured[0] is not None:
            raise invalid("tool_choice", f"tool_choice: {plan.mode} calls a tool; it cannot be combined "
                                         f"with {structured[1]}")
        structured = (forced, "tools")
    _, prompt_ids = frontend.prompts.render_chat(template_messages(body.messages), body.add_generation_prompt,
                                              body.continue_final_message, plan.prompt_tools, plan.parser)
    prompt_ids = frontend.prompts.truncate(prompt_ids, body.truncate_prompt_tokens)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = frontend.prompts.max_tokens_for(len(prompt_ids), requested, "messages")
    parameters = sampling_parameters(body, max_tokens=max_tokens, logprobs=top_logprobs,
                                     vocab_size=frontend.prompts.vocab_size, structured=structured) | adapter
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    choices = Choices(1, body.n, frontend.settings.enable_prompt_tokens_details)
    log_request(frontend, response_id, [prompt_ids], [parameters])

    def chunk(choice: dict) -> dict:
        return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": [choice]}

    if body.stream:
        first, rest = await unless_disconnected(raw_request, start(frontend.triton, [prompt_ids], [parameters],
                                                                   stream=True, prompt_param="messages",
                                                                   structured_param=structured[1]))
        streams = [plan.stream() for _ in range(body.n)]

        async def events():
            for index in range(body.n):
                yield chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
            async for prompt_index, response in replay(first, rest):
                for index, delta in choices.update(prompt_index, response):
                    logprobs = None
                    if top_logprobs is not None:
                        logprobs = chat_logprobs(delta.logprobs or [], top_logprobs).model_dump()
                    stream, finish_reason = streams[index], delta.finish_reason
                    deltas = stream.feed(delta.text)
                    if finish_reason is not None:
                        deltas += stream.finish()
                        finish_reason = plan.finish_reason(stream.calls, finish_reason)
                    if not deltas and finish_reason is None and logprobs is None:
                        continue  # text held back: it may be the start of a tool call
                    deltas = deltas or [{}]
                    for k, piece in enumerate(deltas):
                        yield chunk({"index": index, "delta": piece, "logprobs": logprobs if k == 0 else None,
                                     "finish_reason": finish_reason if k == len(deltas) - 1 else None})
            if include_usage:
                yield {"id": response_id, "object": "chat.completion.chunk", "created": created,
                       "model": body.model, "choices": [], "usage": choices.usage().model_dump()}
            log_completion(frontend, response_id, choices)

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    async def collect():
        first, rest = await start(frontend.triton, [prompt_ids], [parameters], stream=False, prompt_param="messages",
                                  structured_param=structured[1])
        async for prompt_index, response in replay(first, rest):
            choices.update(prompt_index, response)

    def answer(index: int, choice) -> ChatChoice:
        content, calls = plan.read(choice.text)
        message = AssistantMessage(content=(content.strip() or None) if calls else content,
                                   tool_calls=[ToolCallOut.model_validate(call.message()) for call in calls] or None)
        return ChatChoice(index=index, message=message, finish_reason=plan.finish_reason(calls, choice.finish_reason),
                          logprobs=chat_logprobs(choice.logprobs, top_logprobs) if top_logprobs is not None else None)

    await unless_disconnected(raw_request, collect())
    log_completion(frontend, response_id, choices)
    return ChatCompletionResponse(id=response_id, created=created, model=body.model, usage=choices.usage(),
                                  choices=[answer(index, choice) for index, choice in enumerate(choices.choices)])
