"""Tool-call text formats (`--tool-call-parser`, vLLM's names): how tools, calls and results are
shown to a model whose chat template knows no tools, and how calls are read back out of its
answer, whole or while it is still being written.

- `hermes` (the default): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as
  Hermes, Qwen and many open models write them; text around them is content.
- `json`: an answer that is only such an object, or a list of them.
- `llama3_json`: Llama 3.1/3.2's `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls, or (newer tokenizers) `name[ARGS]{...}`
  after each `[TOOL_CALLS]`.
- `pythonic`: a Python list of calls, `[get_weather(city="Paris"), get_time()]` (Llama 3.2/4).

`partial_calls` reads calls from an answer cut short anywhere: names once they are whole, arguments
as far as they are written (incomplete strings and numbers left out), so that they can be streamed.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

# Incomplete strings, numbers and true/false/null are left out: what is read never changes later.
WHOLE_SCALARS = Allow.ALL & ~(Allow.STR | Allow.NUM | Allow.SPECIAL)


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


@dataclass
class PartialCall:
    """A call as far as it is written: its name once whole, its arguments so far."""
    name: str | None
    arguments: dict | None
    complete: bool


def arguments_text(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


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
    return Call(value["name"], arguments_text(arguments))


def read_partial_call(value, complete: bool) -> PartialCall:
    if not isinstance(value, dict):
        return PartialCall(None, None, complete)
    name = value.get("name") if isinstance(value.get("name"), str) else None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):  # arguments as JSON text: usable once whole
        try:
            arguments = json.loads(arguments) if complete else None
        except json.JSONDecodeError:
            arguments = None
    if complete and arguments is None and name is not None and "arguments" not in value \
            and "parameters" not in value:
        arguments = {}
    return PartialCall(name, arguments if isinstance(arguments, dict) else None, complete)


def read_calls(text: str) -> list[Call] | None:
    """A JSON call or list of calls -> Calls; None if the text is anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [read_call(item) for item in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else None


def json_values(text: str, separators: str = "") -> list[tuple[object, bool]]:
    """The JSON values written one after another in `text` (between them whitespace or
    `separators`), the last perhaps cut short: (value, complete)."""
    decoder, position = json.JSONDecoder(), 0
    values: list[tuple[object, bool]] = []
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            try:
                values.append((partial_loads(text[position:], WHOLE_SCALARS), False))
            except Exception:  # not JSON at all
                pass
            return values
        values.append((value, True))


def partial_json_calls(text: str, separators: str = "") -> list[PartialCall]:
    """Calls written as JSON objects or lists of them, as far as they are written."""
    calls = []
    for value, complete in json_values(text, separators):
        items = value if isinstance(value, list) else [value]
        calls += [read_partial_call(item, complete or k < len(items) - 1) for k, item in enumerate(items)]
    return calls


def whole_json_calls(text: str, separators: str = "") -> list[Call] | None:
    """Calls written as JSON objects or lists of them; None unless every value is a whole call."""
    values = json_values(text, separators)
    if not values or not all(complete for _, complete in values):
        return None
    calls = [read_call(item) for value, _ in values for item in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else None


def held_tail(text: str, marker: str) -> int:
    """Where a tail of `text` that could be the start of `marker` begins (len(text) if none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolParser:
    """One text format of tool calls: how to show tools, calls and results to a model, and how to
    read calls out of its answer, whole or as it streams."""

    keeps_special_tokens = False  # its markers are special tokens of its models: do not skip them

    def describe(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return f"You can call these functions:\n{listed}\n\n{self.instructions()}"

    def instructions(self) -> str:
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

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls in a partial answer, as far as they are written."""
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
        return start if start >= 0 else held_tail(text, self.START)

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls = []
        for block in self.BLOCK.findall(text):
            values = json_values(block)  # the first value; a closing tag cut short may follow it
            calls.append(read_partial_call(*values[0]) if values else PartialCall(None, None, False))
        return calls


class JsonParser(ToolParser):
    """An answer that is a JSON call, or a list of them; anything else is text."""

    def instructions(self) -> str:
        return ('To call them, answer only with JSON: {"name": <function-name>, "arguments": '
                "<arguments-object>}, or a list of such objects.")

    def format_calls(self, calls: list[dict]) -> str:
        return json.dumps(calls if len(calls) > 1 else calls[0], ensure_ascii=False)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        calls = read_calls(text.strip()) if text.lstrip()[:1] in ("{", "[") else None
        return ("", calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] in "{[" else len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        return partial_json_calls(text) if text.lstrip()[:1] in ("{", "[") else []


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON calls: `<|python_tag|>` (optional), then `{"name": ..., "parameters": ...}`
    objects separated by `;`. As vLLM reads them, an answer that starts otherwise is text."""

    TAG = "<|python_tag|>"
    keeps_special_tokens = True

    def instructions(self) -> str:
        return ('To call a function, answer only with JSON: {"name": <function-name>, "parameters": '
                "<arguments-object>}; separate several calls with `; `.")

    def format_calls(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)

    def body(self, text: str) -> str | None:
        stripped = text.lstrip()
        stripped = stripped[len(self.TAG):].lstrip() if stripped.startswith(self.TAG) else stripped
        return stripped if stripped[:1] == "{" else None

    def parse(self, text: str) -> tuple[str, list[Call]]:
        body = self.body(text)
        calls = whole_json_calls(body, ";") if body is not None else None
        return ("", calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or self.TAG.startswith(stripped[:len(self.TAG)]):
            return 0
        return len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        body = self.body(text)
        return partial_json_calls(body, ";") if body is not None else []


class MistralParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` followed by a JSON list of calls, or by `name[ARGS]{...}` (v11+
    tokenizers, one `[TOOL_CALLS]` per call). Text before the first marker is content."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True

    def instructions(self) -> str:
        return ('To call functions, answer with [TOOL_CALLS] followed by a JSON list: [{"name": '
                '<function-name>, "arguments": <arguments-object>}].')

    def format_calls(self, calls: list[dict]) -> str:
        return self.MARKER + json.dumps(calls, ensure_ascii=False)

    def sections(self, text: str) -> list[str]:
        return text.split(self.MARKER)[1:]

    def parse(self, text: str) -> tuple[str, list[Call]]:
        sections = self.sections(text)
        calls: list[Call | None] = []
        for section in sections:
            name, marker, arguments = section.partition(self.ARGS)
            if marker:
                calls.append(read_call({"name": name.strip(), "arguments": _json(arguments.strip())}))
            else:
                calls += whole_json_calls(section) or [None]
        if not sections or not all(calls):
            return text, []
        return text[:text.find(self.MARKER)], calls  # type: ignore[return-value]

    def content_end(self, text: str) -> int:
        start = text.find(self.MARKER)
        return start if start >= 0 else held_tail(text, self.MARKER)

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        sections = self.sections(text)
        for k, section in enumerate(sections):
            name, marker, arguments = section.partition(self.ARGS)
            if not marker and section.lstrip()[:1] in ("[", "{"):
                calls += partial_json_calls(section)
            elif marker:
                values = json_values(arguments)
                value, complete = values[0] if values else (None, False)
                calls.append(PartialCall(name.strip(), value if isinstance(value, dict) else None,
                                         complete or k < len(sections) - 1))
        return calls


class PythonicParser(ToolParser):
    """A Python list of calls with literal keyword arguments: `[get_weather(city="Paris")]`. Calls
    stream whole: each once it is closed."""

    def instructions(self) -> str:
        return ("To call functions, answer only with a Python list of calls with keyword arguments, "
                'e.g. [get_weather(city="Paris"), get_time()].')

    def format_calls(self, calls: list[dict]) -> str:
        def call(c: dict) -> str:
            return f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in c['arguments'].items())})"
        return f"[{', '.join(call(c) for c in calls)}]"

    @staticmethod
    def read(source: str) -> list[Call] | None:
        try:
            tree = ast.parse(source.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:
                return None
            if None in arguments:  # **kwargs
                return None
            calls.append(Call(node.func.id, arguments_text(arguments)))
        return calls

    def parse(self, text: str) -> tuple[str, list[Call]]:
        calls = self.read(text) if text.lstrip()[:1] == "[" else None
        return ("", calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] == "[" else len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        if text.lstrip()[:1] != "[":
            return []
        # The calls closed so far: the list cut after one of its last ")" and closed.
        closes = [i + 1 for i, char in enumerate(text) if char == ")"][-8:]
        for candidate in (text, *(text[:end] + "]" for end in reversed(closes))):
            calls = self.read(candidate)
            if calls:
                return [PartialCall(c.name, json.loads(c.arguments), True) for c in calls]
        return []


PARSERS = {"hermes": HermesParser, "json": JsonParser, "llama3_json": Llama3JsonParser,
           "mistral": MistralParser, "pythonic": PythonicParser}


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
