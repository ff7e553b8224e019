"""The llm model's edge: a Triton request's tensors and parameters -> the prompt, the engine's
SamplingParams, the response flags and the cache salt. Anything wrong raises ValueError with a
message naming the input or parameter (the model answers it with INVALID_ARG), so no bad request
reaches the engine.
"""

from __future__ import annotations

import json
import math

import triton_python_backend_utils as pb_utils

from backend import RequestOutputKind, SamplingParams

FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason",
               "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
               "return_num_output_tokens")
FLOAT_PARAMETERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
MAX_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's bound


def parse_request(request) -> tuple[str | list[int], SamplingParams, dict[str, bool], str | None, dict]:
    """Read the request's tensors and parameters; raise ValueError naming what is wrong.
    Returns the prompt, the sampling parameters, the flags, the cache salt (tenant isolation) and the
    LoRA adapter asked for ({"lora_name": ..., "lora_path": ...}, each optional; empty for the base)."""
    # The HTTP generate endpoint carries its "parameters" object here; gRPC clients usually send
    # the sampling_parameters tensor instead. Flags may come either way; tensors win.
    try:
        extra = json.loads(request.parameters() or "{}")
    except json.JSONDecodeError:
        extra = {}
    flags = {}
    for name in FLAG_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        value = extra.pop(name, None)
        if tensor is not None:
            value = tensor.as_numpy().reshape(-1)[0]
        if isinstance(value, str):
            value = value.strip().lower() in ("true", "1", "yes")
        flags[name] = None if value is None else bool(value)
    stream = bool(flags["stream"])
    if stream and flags["exclude_input_in_output"] is False:
        raise ValueError("exclude_input_in_output: false is not allowed when streaming")
    # Non-streaming responses echo the prompt unless told not to (the vLLM backend's default).
    flags["prepend_input"] = not stream and not flags["exclude_input_in_output"]
    flags["stream"] = stream

    text = pb_utils.get_input_tensor_by_name(request, "text_input")
    input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if text is not None:
        prompt = utf8(text.as_numpy().reshape(-1)[0], "text_input")
    elif input_ids is not None:
        prompt = [int(t) for t in input_ids.as_numpy().reshape(-1)]
    else:
        raise ValueError("text_input: required (or input_ids for a token-id prompt)")

    tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
    if tensor is not None:
        raw = utf8(tensor.as_numpy().reshape(-1)[0], "sampling_parameters")
        try:
            values = json.loads(raw, parse_constant=reject_constant) if raw.strip() else {}
        except json.JSONDecodeError as error:
            raise ValueError(f"sampling_parameters: not valid JSON ({error})") from None
    else:
        values = {k: v for k, v in extra.items() if not k.startswith("triton_")}
    if not isinstance(values, dict):
        raise ValueError("sampling_parameters: must be a JSON object")
    values = {k: v for k, v in values.items() if v is not None}
    cache_salt = values.pop("cache_salt", None)
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt: must be a string, got {cache_salt!r}")
    lora = {key: values.pop(key) for key in ("lora_name", "lora_path") if key in values}
    for key, value in lora.items():
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key}: must be a non-empty string, got {value!r}")
    params = sampling_params(values)
    params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return prompt, params, flags, cache_salt, lora


def utf8(value, name: str) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{name}: not valid UTF-8 ({error.reason} at byte {error.start})") from None


def reject_constant(name: str):
    raise ValueError(f"sampling_parameters: {name} is not a number JSON allows")


def sampling_params(values: dict) -> SamplingParams:
    """SamplingParams from the JSON values; any failure becomes a ValueError naming the field."""
    try:
        params = SamplingParams.from_dict(values)
    except (TypeError, ValueError, AttributeError, OverflowError) as error:
        message = str(error)
        if not message.startswith(("unknown sampling parameter", *values)):
            # An error that names no field (a failed int() deep inside): find the culprit.
            culprit = next((name for name in values if not _accepted(name, values[name])), None)
            message = (f"{culprit}: invalid value {values[culprit]!r} ({message})" if culprit
                       else f"sampling_parameters: {message}")
        raise ValueError(message) from None
    for name in FLOAT_PARAMETERS:
        if not math.isfinite(getattr(params, name)):
            raise ValueError(f"{name} must be a finite number, got {getattr(params, name)!r}")
    if any(not abs(bias) <= MAX_LOGIT_BIAS for bias in (params.logit_bias or {}).values()):
        raise ValueError(f"logit_bias: biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    return params


def _accepted(name: str, value) -> bool:
    try:
        SamplingParams.from_dict({name: value})
        return True
    except Exception:  # any failure marks the culprit
        return False
