"""OpenAI's error envelope, and the mapping from every failure we meet (validation, Triton, gRPC)
to a status code and that envelope."""

from __future__ import annotations

import re

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


# The engine's wording (backend/engine.py), rewritten into OpenAI's below.
CONTEXT_ERROR = re.compile(r"maximum context length is (\d+) tokens; the request asks for (\d+) "
                           r"\((\d+) in the prompt, (\d+) max_tokens\)")
# Messages that mean "the model cannot serve right now", not "your request is wrong".
UNAVAILABLE_HINTS = ("unknown model", "no available versions", "is not ready", "unavailable",
                     "being unloaded", "failed to connect", "connection refused", "socket closed",
                     "is not healthy")  # the last: Triton's Python backend lost the model's process
# The engine's waiting queue is full (backend/async_engine.py), or Triton's own queue is.
OVERLOAD_HINTS = ("overloaded", "exceeds maximum queue size")
RETRY_AFTER_S = 1  # every 503 tells the client when to try again
# Validation messages start with the parameter's name ("top_p must be in (0, 1]", "prompt: ...").
LEADING_PARAM = re.compile(r"^([a-z_]+)(?::| must| is| cannot)")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = ("invalid_request_error" if self.status < 500 else
                "service_unavailable" if self.status == 503 else "server_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def invalid(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, param)


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None,
                         prompt_param: str) -> OpenAIError:
    what = "messages" if prompt_param == "messages" else "prompt"
    if max_tokens is None:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, your "
                   f"request has {prompt_tokens} input tokens. Please reduce the length of the {what}.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, "
                   f"{max_tokens} in the completion). Please reduce the length of the {what} or completion.")
    return OpenAIError(400, message, prompt_param, "context_length_exceeded")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def from_triton_message(message: str, prompt_param: str = "prompt") -> OpenAIError:
    """Classify an error Triton returned for one request (a stream carries only its message)."""
    text = message.strip()
    match = CONTEXT_ERROR.search(text)
    if match:
        limit, _, prompt_tokens, max_tokens = map(int, match.groups())
        return context_length_error(limit, prompt_tokens, max_tokens, prompt_param)
    if "KV-cache blocks" in text:
        return OpenAIError(400, text, "max_tokens")
    lowered = text.lower()
    if any(hint in lowered for hint in OVERLOAD_HINTS):
        return OpenAIError(503, f"The server is overloaded; retry later ({text})", None, "engine_overloaded")
    if any(hint in lowered for hint in UNAVAILABLE_HINTS):
        return OpenAIError(503, f"The model is unavailable: {text}", None, "model_unavailable")
    match = LEADING_PARAM.match(text)
    if match:
        param = "prompt" if match.group(1) == "prompt" else match.group(1)
        return OpenAIError(400, text, prompt_param if param == "prompt" else param)
    return OpenAIError(500, f"Triton failed the request: {text}")


def from_grpc_error(error: grpc.RpcError) -> OpenAIError:
    """A transport-level failure: Triton unreachable, overloaded or gone."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return OpenAIError(503, f"Triton is unreachable or overloaded: {details}", None, "service_unavailable")
    return from_triton_message(details or str(code))


# Pydantic marks which branch of a union it tried ("str", "list[int]"); those are not parameters.
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def param_path(location: tuple) -> str | None:
    parts = [p for p in location[1:] if isinstance(p, int) or (p.isidentifier() and p not in TYPE_TAGS)]
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or None


def validation_error(error: RequestValidationError) -> OpenAIError:
    errors = error.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid(None, f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    # A union reports one error per member it tried ("not a string", "not a list", ...); the one
    # that is no type mismatch says what is wrong ("prompt[0]: should be >= 0").
    field = first.get("loc", ())[:2]
    first = next((e for e in errors if e.get("loc", ())[:2] == field and not e.get("type", "").endswith("_type")),
                 first)
    param = param_path(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid value")
    return invalid(param, f"{param}: {message}" if param else f"Invalid request body: {message}")
