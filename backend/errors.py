"""Errors a client caused or can act on: a stable code, the parameter concerned, and one message
format (`param: what is wrong (got value)`). They cross the Triton boundary as text with a trailing
tag (`... [code=invalid_parameter param=top_p]`, plus any numeric details: `max_model_len=2048`)
that the frontend reads back, so nothing downstream matches on wording. The few messages worded as
Triton's vLLM backend words them (its tests compare the whole text) cross untagged, and WORDED gives
their code and parameter. Imports nothing from the rest of `backend/`.
"""

from __future__ import annotations

import re
from typing import Any

INVALID_PARAMETER = "invalid_parameter"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
KV_CACHE_TOO_SMALL = "kv_cache_too_small"
ENGINE_OVERLOADED = "engine_overloaded"
MODEL_UNAVAILABLE = "model_unavailable"
NOT_FOUND = "not_found"

# Triton's vLLM backend's own messages, sent verbatim because its L0 tests compare them whole:
# message -> (code, param), which parse_wire returns for them as for a tag.
STREAM_ECHO_REFUSED = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
WORDED = {STREAM_ECHO_REFUSED: (INVALID_PARAMETER, "exclude_input_in_output")}

_MISSING = object()
_TAG = re.compile(r"\s*\[code=(?P<code>[a-z_]+)(?: param=(?P<param>[^\]\s=]+))?"
                  r"(?P<details>(?: [a-z_]+=-?\d+)*)\]\s*$")


class EngineError(ValueError):
    """A ValueError with a code and the parameter it concerns (None when it concerns none)."""

    def __init__(self, param: str | None, message: str, code: str = INVALID_PARAMETER,
                 value: Any = _MISSING, **details: Any) -> None:
        text = f"{param}: {message}" if param else message
        if value is not _MISSING:
            text += f" (got {value!r})"
        super().__init__(text)
        self.param, self.code, self.details = param, code, details

    @classmethod
    def worded(cls, message: str) -> EngineError:
        """One of WORDED's messages, whose wire form is the message alone."""
        code, param = WORDED[message]
        error = cls(None, message, code)
        error.param = param
        return error

    def wire(self) -> str:
        """The message with its tag, for a Triton error; integer details ride along. WORDED's
        messages go as they are."""
        if WORDED.get(str(self)) == (self.code, self.param):
            return str(self)
        param = f" param={self.param}" if self.param else ""
        details = "".join(f" {k}={v}" for k, v in self.details.items()
                          if isinstance(v, int) and not isinstance(v, bool))
        return f"{self} [code={self.code}{param}{details}]"


def check(ok: bool, param: str | None, message: str, value: Any = _MISSING,
          code: str = INVALID_PARAMETER) -> None:
    """Raise EngineError(param, message) unless ok."""
    if not ok:
        raise EngineError(param, message, code, value)


def parse_wire(text: str) -> tuple[str | None, str | None, str]:
    """(code, param, message) from a tagged message; (None, None, text) when it carries no tag."""
    match = _TAG.search(text)
    if match is None:
        code, param = WORDED.get(text.strip(), (None, None))
        return code, param, text.strip()
    return match.group("code"), match.group("param"), text[:match.start()].strip()


def wire_details(text: str) -> dict[str, int]:
    """The integer details of a tagged message (empty when it carries none)."""
    match = _TAG.search(text)
    pairs = match.group("details").split() if match else []
    return {key: int(value) for key, value in (pair.split("=") for pair in pairs)}
