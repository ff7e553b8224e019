"""How one chat request uses its tools (`tool_choice`), and its calls read out of the answer whole
or streamed as they are written (the formats are openai_frontend/tool_parsers.py).

`none`: plain text, the tools are not shown. `auto` (needs --enable-auto-tool-choice, as in vLLM):
free text, from which the parser picks the calls. `required` and a named function: structured
outputs hold the engine to a JSON list of calls or to the named function's arguments, so the
answer always is a call; its text is JSON, whatever the parser.

Streamed, a call goes out as soon as its name is whole (id, type, name), then its arguments in
pieces as they are written: each piece extends the JSON text sent so far, and all of them together
are the `arguments` a non-streamed answer would have.
"""

from __future__ import annotations

from openai_frontend.tool_parsers import (Call, JsonParser, PartialCall, ToolParser, arguments_text, read_calls)

NO_ARGUMENTS = {"type": "object", "properties": {}}


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

    def partial_calls(self, text: str) -> list[PartialCall]:
        if self.mode == "required":
            return JsonParser().partial_calls(text)
        calls = self.parser.partial_calls(text) if self.mode == "auto" else []
        return calls if self.parallel else calls[:1]

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


def sendable_arguments(call: PartialCall) -> str | None:
    """The arguments' JSON text as far as it cannot change: all of it once the call is complete;
    before, without the closing brackets that only end what is written so far."""
    if call.arguments is None:
        return None
    text = arguments_text(call.arguments)
    return text if call.complete else text.rstrip("}]")


class ToolCallStream:
    """One streamed choice: text goes out as content as soon as it cannot belong to a call; a call
    as soon as its name is whole, its arguments as they are written."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0
        self.named_call = Call(plan.name, "") if plan.mode == "named" else None
        self.calls: list[Call] = [self.named_call] if self.named_call else []  # as sent so far

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
        if self.plan.mode == "none":
            return self._content(len(self.text))
        deltas = [] if self.plan.mode == "required" else self._content(self.plan.parser.content_end(self.text))
        return deltas + self._calls(self.plan.partial_calls(self.text))

    def finish(self) -> list[dict]:
        """What is left once the answer is complete: content held back, the calls' last pieces."""
        if self.named_call is not None:
            return []
        content, calls = self.plan.read(self.text)
        if not calls:
            return self._content(len(self.text))
        deltas: list[dict] = [{"content": content[self.sent:]}] if content[self.sent:].strip() else []
        for index, call in enumerate(calls):
            if index < len(self.calls):  # sent in part: the rest of its arguments
                sent = self.calls[index]
                call.id = sent.id
                if call.arguments != sent.arguments:
                    rest = call.arguments[len(sent.arguments):] if call.arguments.startswith(sent.arguments) \
                        else call.arguments
                    deltas.append({"tool_calls": [{"index": index, "function": {"arguments": rest}}]})
            else:
                deltas.append({"tool_calls": [call.delta(index)]})
        self.calls = calls
        return deltas

    def _calls(self, partial: list[PartialCall]) -> list[dict]:
        deltas = []
        for index, call in enumerate(partial):
            if call.name is None:
                break  # calls come in order: nothing after one without a name yet
            if index == len(self.calls):
                self.calls.append(Call(call.name, ""))
                deltas.append(self.calls[index].delta(index))
            sent, arguments = self.calls[index], sendable_arguments(call)
            if arguments is not None and len(arguments) > len(sent.arguments) and arguments.startswith(sent.arguments):
                piece, sent.arguments = arguments[len(sent.arguments):], arguments
                if deltas and deltas[-1]["index"] == index and "id" in deltas[-1]:
                    deltas[-1]["function"]["arguments"] = piece  # the call's first delta carries it
                else:
                    deltas.append({"index": index, "function": {"arguments": piece}})
        return [{"tool_calls": [delta]} for delta in deltas]

    def _content(self, end: int) -> list[dict]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [{"content": piece}]
