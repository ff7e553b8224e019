"""OpenAI's error envelope, and the mapping from every failure we meet (validation, Triton, gRPC)
to a status code and that envelope."""

from __future__ import annotations

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from backend.errors import (CONTEXT_LENGTH_EXCEEDED, ENGINE_OVERLOADED, INVALID_PARAMETER, KV_CACHE_TOO_SMALL,
                            MODEL_UNAVAILABLE, NOT_FOUND, EngineError, parse_wire, wire_details)


# What each engine error code (backend/errors.py, tagged onto Triton's error message) answers.
STATUS_OF_CODE = {INVALID_PARAMETER: 400, CONTEXT_LENGTH_EXCEEDED: 400, KV_CACHE_TOO_SMALL: 400,
                  ENGINE_OVERLOADED: 503, MODEL_UNAVAILABLE: 503, NOT_FOUND: 404}
# Triton's own messages carry no code: these mean "the model cannot serve right now".
UNAVAILABLE_HINTS = ("unknown model", "no available versions", "is not ready", "unavailable",
                     "being unloaded", "failed to connect", "connection refused", "socket closed",
                     "is not healthy")  # the last: Triton's Python backend lost the model's process
OVERLOAD_HINTS = ("exceeds maximum queue size",)  # Triton's queue for the model is full
RETRY_AFTER_S = 1  # every 503 tells the client when to try again


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
    """Classify an error Triton returned for one request by the engine's code (a stream carries
    only the message, with the code tagged on); Triton's own errors carry none."""
    code, param, text = parse_wire(message)
    if code is None:
        lowered = text.lower()
        if any(hint in lowered for hint in OVERLOAD_HINTS):
            return OpenAIError(503, f"The server is overloaded; retry later ({text})", None, ENGINE_OVERLOADED)
        if any(hint in lowered for hint in UNAVAILABLE_HINTS):
            return OpenAIError(503, f"The model is unavailable: {text}", None, MODEL_UNAVAILABLE)
        return OpenAIError(500, f"Triton failed the request: {text}")
    if param == "prompt":
        param = prompt_param
    if code == CONTEXT_LENGTH_EXCEEDED:
        details = wire_details(message)
        if {"max_model_len", "prompt_tokens", "max_tokens"} <= set(details):
            return context_length_error(details["max_model_len"], details["prompt_tokens"], details["max_tokens"],
                                        prompt_param)
        param = param or prompt_param
    status = STATUS_OF_CODE.get(code, 400)
    if status == 503:
        return OpenAIError(503, f"The server is overloaded; retry later ({text})" if code == ENGINE_OVERLOADED
                           else f"The model is unavailable: {text}", None, code)
    return OpenAIError(status, text, param, None if code == INVALID_PARAMETER else code)


def from_engine_error(error: EngineError, prompt_param: str = "prompt") -> OpenAIError:
    """An EngineError raised in the frontend itself (it runs the engine's own checks)."""
    return from_triton_message(error.wire(), prompt_param)


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
