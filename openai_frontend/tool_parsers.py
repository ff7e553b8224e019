"""Tool calls in chat: showing the model its tools, and reading its calls back, whole or streamed.

A parser owns one text format of calls (`--tool-call-parser`): `hermes` (the default), blocks of
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` as Hermes, Qwen and many open models
write them, or `json`, an answer that is only such an object (or a list of them). A chat template
that knows tools gets them as `tools=`; for one that does not (SmolLM2's) the parser describes them
in the system message and writes earlier calls and results into the conversation in its format.

`tool_choice` decides how an answer is read. `none`: plain text, the tools are not shown. `auto`:
free text, from which the parser picks the calls. `required` and a named function: structured
outputs hold the engine to a JSON list of calls or to the named function's arguments, so the
answer always is a call; its text is JSON, whatever the parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def delta(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_call(value) -> Call | None:
    """{"name": ..., "arguments": {...}} (or "parameters", as some models write) -> a Call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))


def read_calls(text: str) -> list[Call] | None:
    """A JSON call or list of calls -> Calls; None if the text is anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [read_call(item) for item in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else None


class ToolParser:
    """One text format of tool calls: how to show tools, calls and results to a model, and how to
    read calls out of its answer, whole or as it streams."""

    def describe(self, tools: list[dict]) -> str:
        raise NotImplementedError

    def format_calls(self, calls: list[dict]) -> str:
        raise NotImplementedError

    def format_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """(the text outside the calls, the calls)."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a partial answer is surely content, never part of a call."""
        raise NotImplementedError


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)  # the last may be cut short

    def describe(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("You can call functions. Their signatures are within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "To call one, answer with a JSON object holding the function's name and arguments "
                "within <tool_call></tool_call> XML tags, one block per call:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')

    def format_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"{self.START}\n{json.dumps(call, ensure_ascii=False)}\n{self.END}" for call in calls)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        # A block that is not a call leaves the whole answer text.
        blocks = self.BLOCK.findall(text)
        calls = [read_call(_json(block.strip())) for block in blocks]
        if not blocks or not all(calls):
            return text, []
        return self.BLOCK.sub("", text), calls

    def content_end(self, text: str) -> int:
        # Up to where a call starts, or may start: a tail that could begin the start tag.
        start = text.find(self.START)
        if start >= 0:
            return start
        for size in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-size:]):
                return len(text) - size
        return len(text)


class JsonParser(ToolParser):
    """An answer that is a JSON call, or a list of them; anything else is text."""

    def describe(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (f"You can call these functions:\n{listed}\n\nTo call them, answer only with JSON: "
                '{"name": <function-name>, "arguments": <arguments-object>}, or a list of such objects.')

    def format_calls(self, calls: list[dict]) -> str:
        return json.dumps(calls if len(calls) > 1 else calls[0], ensure_ascii=False)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        calls = read_calls(text.strip()) if text.lstrip()[:1] in ("{", "[") else None
        return ("", calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] in "{[" else len(text)


PARSERS = {"hermes": HermesParser, "json": JsonParser}


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def inline_tools(messages: list[dict], tools: list[dict] | None, parser: ToolParser) -> list[dict]:
    """For a chat template that knows no tools: the tools in the system message, earlier calls in
    the assistant's text and results as user messages, all in the parser's format."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message.pop("tool_calls")]
            message["content"] = "\n".join(filter(None, [message.get("content"), parser.format_calls(calls)]))
        if message["role"] == "tool":
            message = {"role": "user", "content": parser.format_result(message.get("content") or "")}
        out.append(message)
    if tools:
        described = parser.describe(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


class ToolPlan:
    """How one chat request uses its tools: what the prompt shows, what the engine must produce,
    how the answer is read."""

    def __init__(self, tools: list[dict], tool_choice, parser: ToolParser, parallel: bool) -> None:
        self.tools, self.parser, self.parallel = tools, parser, parallel
        self.name = None
        if isinstance(tool_choice, dict):
            self.mode, self.name = "named", tool_choice["function"]["name"]
        else:
            self.mode = tool_choice or ("auto" if tools else "none")

    @property
    def prompt_tools(self) -> list[dict] | None:
        return self.tools if self.tools and self.mode != "none" else None

    def structured_outputs(self) -> dict | None:
        """A JSON schema that holds the answer to the call(s) `required` or a named choice asks for."""
        def parameters(tool: dict) -> dict:
            return tool["function"].get("parameters") or NO_ARGUMENTS

        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            return {"json": parameters(tool)}
        if self.mode == "required":
            one_call = {"anyOf": [{"type": "object", "required": ["name", "arguments"],
                                   "properties": {"name": {"const": tool["function"]["name"]},
                                                  "arguments": parameters(tool)}} for tool in self.tools]}
            return {"json": {"type": "array", "items": one_call, "minItems": 1,
                             **({} if self.parallel else {"maxItems": 1})}}
        return None

    def finish_reason(self, calls: list[Call], reason: str | None) -> str | None:
        # As OpenAI: calls the model chose, or had to make, end with "tool_calls"; a call to the
        # function named in tool_choice ends with the engine's reason ("stop").
        return "tool_calls" if calls and self.mode != "named" else reason

    def read(self, text: str) -> tuple[str, list[Call]]:
        """A whole answer -> (content, calls)."""
        if self.mode == "named":
            return "", [Call(self.name, text)]
        if self.mode == "required":
            calls = read_calls(text)
            return ("", calls) if calls else (text, [])
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        return text, []

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed choice: text goes out as content as soon as it cannot belong to a call; calls go
    out whole once the answer is complete (a named call's arguments as they come)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0
        self.named_call = Call(plan.name, "") if plan.mode == "named" else None
        self.calls: list[Call] = [self.named_call] if self.named_call else []

    def feed(self, text: str) -> list[dict]:
        """Deltas for the new text."""
        self.text += text
        if self.named_call is not None:
            if not text:
                return []
            first, self.sent = self.sent == 0, len(self.text)
            piece: dict = self.named_call.delta(0) if first else {"index": 0, "function": {}}
            piece["function"]["arguments"] = text
            return [{"tool_calls": [piece]}]
        if self.plan.mode == "required":
            return []
        end = self.plan.parser.content_end(self.text) if self.plan.mode == "auto" else len(self.text)
        return self._content(end)

    def finish(self) -> list[dict]:
        """The deltas held back until the answer was complete."""
        if self.named_call is not None:
            return []
        content, self.calls = self.plan.read(self.text)
        if not self.calls:
            return self._content(len(self.text))
        deltas = [{"content": content[self.sent:]}] if content[self.sent:].strip() else []
        return deltas + [{"tool_calls": [call.delta(i) for i, call in enumerate(self.calls)]}]

    def _content(self, end: int) -> list[dict]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [{"content": piece}]
