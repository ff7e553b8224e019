"""Reasoning models (`--reasoning-parser`, vLLM's names): the thinking a model writes before its
answer goes out as `reasoning` (and `reasoning_content`, its older name), apart from `content`.

The `<think>...</think>` family:
- `deepseek_r1`: DeepSeek-R1's chat template opens the block itself, so the answer starts inside
  it (a `<think>` it writes anyway is dropped); the reasoning ends at `</think>`, and an answer
  without one is all reasoning (cut short while thinking).
- `qwen3`: Qwen3 writes the block itself, only when thinking is on (`chat_template_kwargs:
  {"enable_thinking": false}` turns it off); an answer that does not open with `<think>` is all
  content.

When structured outputs hold the answer (response_format, tool_choice required...), the engine
constrains it from its first token: only a `<think>` block the constraint itself writes is
reasoning, whatever the parser.
"""

from __future__ import annotations


class ThinkParser:
    START, END = "<think>", "</think>"

    def __init__(self, opened_by_template: bool) -> None:
        self.opened_by_template = opened_by_template  # the answer starts inside the block

    def constrained(self) -> "ThinkParser":
        """The parser for an answer held by structured outputs: no block unless it is written."""
        return ThinkParser(opened_by_template=False)

    def split(self, text: str, complete: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of an answer; of one still being written when not `complete`,
        only what is sure so far (a tail that may begin a tag is held back from both)."""
        stripped = text.lstrip()
        if stripped.startswith(self.START):
            body = stripped[len(self.START):]
        elif not complete and self.START.startswith(stripped):
            return None, ""  # may still become "<think>"
        elif self.opened_by_template:
            body = text
        else:
            return None, text
        reasoning, end, content = body.partition(self.END)
        if not end and not complete:
            reasoning = reasoning[:held_tail(reasoning, self.END)]
        return reasoning, content

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


def held_tail(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class ReasoningStream:
    """One streamed choice: new text -> (reasoning piece, content piece), each sent once sure."""

    def __init__(self, parser: ThinkParser) -> None:
        self.parser, self.text = parser, ""
        self.reasoning_sent = self.content_sent = 0

    def feed(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._pieces(*self.parser.split(self.text, complete=False))

    def finish(self) -> tuple[str, str]:
        return self._pieces(*self.parser.split(self.text))

    def _pieces(self, reasoning: str | None, content: str) -> tuple[str, str]:
        reasoning = reasoning or ""
        pieces = reasoning[self.reasoning_sent:], content[self.content_sent:]
        self.reasoning_sent, self.content_sent = max(self.reasoning_sent, len(reasoning)), \
            max(self.content_sent, len(content))
        return pieces


PARSERS = {"deepseek_r1": lambda: ThinkParser(opened_by_template=True),
           "qwen3": lambda: ThinkParser(opened_by_template=False)}
