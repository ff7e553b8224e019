"""POST /v1/responses: OpenAI's Responses API on the chat road. A request's `instructions` and
`input` items (messages, earlier function calls and their outputs) become chat messages, its
function tools chat tools; the answer comes back as output items (reasoning, a message, function
calls), whole or as Responses stream events. Nothing is stored: `previous_response_id` is a 400."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from openai_frontend.errors import OpenAIError, invalid
from openai_frontend.generation import Choices, log_completion, log_request
from openai_frontend.schemas import ChatCompletionRequest, Request as Strict
from openai_frontend.serving_chat import prepare_chat, run_whole, stream_answers


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None  # function tools only; checked below for a clear 400
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict | None = None  # accepted: the model thinks as its template and parser say


def chat_content(content: Any, param: str) -> str | list[dict]:
    """A message's content as chat content: a string as it is, a list as chat parts (the chat path
    joins text-only parts into one string, serving_chat.template_content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, f"{param}: a string or a list of text and image parts")
    parts: list[dict] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            raise invalid(f"{param}[{k}]", f"{param}[{k}]: an input_image needs image_url (file_id is not "
                                           "supported: there is no Files API here)")
        else:
            raise invalid(f"{param}[{k}]", f"{param}[{k}]: only text (input_text, output_text) and input_image "
                                           "parts are supported")
    return parts


def chat_messages(body: ResponsesRequest) -> tuple[list[dict], list[str]]:
    """`instructions` and `input` -> chat messages (earlier function calls of one turn together),
    and each message's name in errors (the input item it came from)."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    where = ["instructions"] * len(messages)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise invalid("input", "input: must not be empty")
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        name = "input" if isinstance(body.input, str) else f"input[{i}]"
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise invalid(f"input[{i}].role", f"input[{i}].role: user, system, developer or assistant")
            messages.append({"role": item["role"], "content": chat_content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":  # earlier reasoning items are not shown to the model again
            raise invalid(f"input[{i}].type", f"input[{i}].type: {kind!r} is not supported (message, "
                                              "function_call, function_call_output)")
        else:
            continue
        where.append(name)
    return messages, where


def chat_request(body: ResponsesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    if body.previous_response_id is not None:
        raise invalid("previous_response_id", "previous_response_id: responses are not stored here; "
                                              "send the whole conversation in input")
    tools = []
    for k, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            raise invalid(f"tools[{k}].type", f"tools[{k}].type: only function tools are supported, "
                                              f"got {tool.get('type')!r}")
        try:
            function = FunctionTool.model_validate(tool).model_dump(exclude_none=True, exclude={"type"})
        except ValueError as error:
            raise invalid(f"tools[{k}]", f"tools[{k}]: not a valid function tool: {error}") from None
        tools.append({"type": "function", "function": function})
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    text_format = body.text.format if body.text and body.text.format else None
    response_format: dict | None = None
    if text_format is not None and text_format.type != "text":
        response_format = {"type": text_format.type}
        if text_format.type == "json_schema":
            response_format["json_schema"] = {"name": text_format.name or "response", "schema": text_format.schema_,
                                              "strict": text_format.strict}
    messages, where = chat_messages(body)
    fields = {"model": body.model, "messages": messages, "tools": tools or None, "tool_choice": choice,
              "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "response_format": response_format,
              "stream": body.stream, "user": body.user}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None},
                                                    strict=False), where
    except ValueError as error:  # a message or tool the chat schema refuses
        raise invalid("input", f"input: {error}") from None


class ResponseBuilder:
    """The response object and its output items, as they grow."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body, self.id, self.created_at = body, f"resp_{uuid.uuid4().hex}", int(time.time())
        self.output: list[dict] = []

    def response(self, status: str, usage: dict | None = None, finish_reason: str | None = None) -> dict:
        body = self.body
        tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else \
            (body.tool_choice or "auto")
        incomplete = status == "completed" and finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": body.model,
                "status": "incomplete" if incomplete else status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "metadata": body.metadata or {}, "output": self.output,
                "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
                "temperature": body.temperature, "top_p": body.top_p, "tool_choice": tool_choice,
                "tools": body.tools or [], "text": {"format": {"type": "text"}} if body.text is None
                else body.text.model_dump(by_alias=True, exclude_none=True),
                "reasoning": body.reasoning, "store": False, "truncation": "disabled", "user": body.user,
                "usage": usage}

    @staticmethod
    def usage(choices: Choices) -> dict:
        usage = choices.usage()
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": sum(choices.cached_tokens)},
                "output_tokens_details": {"reasoning_tokens": 0}}


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": content}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class EventWriter:
    """Chat deltas -> Responses stream events: each kind of delta opens its output item (reasoning,
    message, one per function call), which is done when another one opens or the answer ends."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder, self.sequence = builder, 0
        self.item: dict | None = None  # the open item
        self.call_index: int | None = None  # the open function call's index among the chat deltas

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def open(self, item: dict) -> list[dict]:
        events = self.close()
        self.item = item
        self.builder.output.append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.builder.output) - 1,
                                 item=dict(item)))
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": ""}]
        return events

    @property
    def index(self) -> int:
        return len(self.builder.output) - 1

    def close(self) -> list[dict]:
        item, self.item, self.call_index = self.item, None, None
        if item is None:
            return []
        events, where = [], {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        item["status"] = "completed"
        return events + [self.event("response.output_item.done", output_index=self.index, item=item)]

    def feed(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning"):
            if self.item is None or self.item["type"] != "reasoning":
                events += self.open(reasoning_item("", "in_progress"))
            self.item["content"][0]["text"] += delta["reasoning"]
            events.append(self.event("response.reasoning_text.delta", item_id=self.item["id"],
                                     output_index=self.index, content_index=0, delta=delta["reasoning"]))
        if delta.get("content"):
            if self.item is None or self.item["type"] != "message":
                events += self.open(message_item("", "in_progress"))
            self.item["content"][0]["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=self.item["id"], output_index=self.index,
                                     content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                events += self.open(function_call_item(call["id"], call["function"]["name"], "", "in_progress"))
                self.call_index = call["index"]
            arguments = call["function"].get("arguments")
            if arguments and self.call_index == call["index"]:
                self.item["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.item["id"],
                                         output_index=self.index, delta=arguments))
        return events


def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Responses SSE: each event named after its type; a failure mid-way is an `error` event."""
    async def frames():
        try:
            async for event in events:
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        except OpenAIError as error:
            yield f"event: error\ndata: {json.dumps({'type': 'error', **error.body()['error']})}\n\n"
        except Exception as error:  # never cut a stream without telling the client why
            body = {"type": "error", "message": f"internal error: {error}", "code": None, "param": None}
            yield f"event: error\ndata: {json.dumps(body)}\n\n"
        finally:
            await events.aclose()  # type: ignore[attr-defined]
    return frames()


async def serve_response(frontend, body: ResponsesRequest, raw_request: Request):
    chat, where = chat_request(body)
    job = prepare_chat(frontend, chat, where)
    builder = ResponseBuilder(body)
    choices = Choices(1, 1, frontend.settings.enable_prompt_tokens_details)
    log_request(frontend, builder.id, [job.prompt_ids], [job.parameters])

    if body.stream:
        answers = await stream_answers(frontend, job, raw_request, choices)
        writer = EventWriter(builder)

        async def events():
            yield writer.event("response.created", response=builder.response("in_progress"))
            yield writer.event("response.in_progress", response=builder.response("in_progress"))
            async for _, deltas, _, _ in answers:
                for delta in deltas:
                    for event in writer.feed(delta):
                        yield event
            for event in writer.close():
                yield event
            log_completion(frontend, builder.id, choices)
            yield writer.event("response.completed", response=builder.response(
                "completed", builder.usage(choices), choices.choices[0].finish_reason))

        return StreamingResponse(sse_events(events()), media_type="text/event-stream")

    await run_whole(frontend, job, raw_request, choices)
    log_completion(frontend, builder.id, choices)
    choice = choices.choices[0]
    reasoning, content, calls = job.read(choice.text)
    if reasoning:
        builder.output.append(reasoning_item(reasoning))
    if content.strip() or not calls:
        builder.output.append(message_item(content.strip() if calls else content))
    builder.output += [function_call_item(call.id, call.name, call.arguments) for call in calls]
    return builder.response("completed", builder.usage(choices), choice.finish_reason)
