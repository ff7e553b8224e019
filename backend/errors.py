"""Errors a client caused or can act on: a stable code, the parameter concerned, and one message
format (`param: what is wrong (got value)`). They cross the Triton boundary as text with a trailing
tag (`... [code=invalid_parameter param=top_p]`, plus any numeric details: `max_model_len=2048`)
that the frontend reads back, so nothing downstream matches on wording. Imports nothing from the
rest of `backend/`.
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

    def wire(self) -> str:
        """The message with its tag, for a Triton error; integer details ride along."""
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
        return None, None, text.strip()
    return match.group("code"), match.group("param"), text[:match.start()].strip()


def wire_details(text: str) -> dict[str, int]:
    """The integer details of a tagged message (empty when it carries none)."""
    match = _TAG.search(text)
    pairs = match.group("details").split() if match else []
    return {key: int(value) for key, value in (pair.split("=") for pair in pairs)}
