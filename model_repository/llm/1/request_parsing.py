"""The llm model's edge: a Triton request's tensors and parameters -> the prompt, the engine's
SamplingParams, the response flags and the cache salt. Anything wrong raises EngineError naming the
input or parameter (the model answers it with INVALID_ARG and the error's wire form), so no bad
request reaches the engine.
"""

from __future__ import annotations

import base64
import binascii

import triton_python_backend_utils as pb_utils

from backend import RequestOutputKind, SamplingParams
from backend.engine.beam_search import pop_beam_options
from backend.errors import STREAM_ECHO_REFUSED, EngineError, check
from backend.multimodal import MAX_IMAGES_PER_PROMPT, decode_image
from backend.sampling_params import parse_json

FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason",
               "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
               "return_num_output_tokens", "return_num_cached_tokens", "return_prompt_logprobs")


def parse_request(request, defaults: dict | None = None) -> tuple[str | list[int] | dict, SamplingParams, dict, str | None,
                                                              dict]:
    """Read the request's tensors and parameters; raise EngineError naming what is wrong.
    Returns the prompt, the sampling parameters (`defaults`, the model's generation_config, for
    those the request omits), the flags (with the request's scheduling `priority`, vLLM's: lower
    first), the cache salt (tenant isolation) and the LoRA adapter asked for ({"lora_name": ...,
    "lora_path": ...}, each optional; empty for the base)."""
    # The HTTP generate endpoint carries its "parameters" object here; gRPC clients usually send
    # the sampling_parameters tensor instead. Flags may come either way; tensors win.
    extra = parse_json(request.parameters() or "{}", "parameters")
    extra = extra if isinstance(extra, dict) else {}
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
    if stream and flags["exclude_input_in_output"] is False:  # the vLLM backend's words, which its tests compare
        raise EngineError.worded(STREAM_ECHO_REFUSED)
    # Non-streaming responses echo the prompt unless told not to (the vLLM backend's default).
    flags["prepend_input"] = not stream and not flags["exclude_input_in_output"]
    flags["stream"] = stream

    text = pb_utils.get_input_tensor_by_name(request, "text_input")
    input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    check(text is not None or input_ids is not None, "text_input", "required (or input_ids for a token-id prompt)")
    check(text is None or input_ids is None, "input_ids", "give text_input or input_ids, not both")
    if text is not None:
        prompt = utf8(text.as_numpy().reshape(-1)[0], "text_input")
    else:
        prompt = [int(t) for t in input_ids.as_numpy().reshape(-1)]
    images = pb_utils.get_input_tensor_by_name(request, "image")
    if images is not None and images.as_numpy().size:  # the vLLM backend's: base64 images, one per element
        check(text is not None, "image", "goes with text_input (the model's processor places each image)")
        prompt = {"prompt": prompt, "multi_modal_data": {"image": decode_images(images.as_numpy().reshape(-1))}}

    tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
    if tensor is not None:
        raw = utf8(tensor.as_numpy().reshape(-1)[0], "sampling_parameters")
        values = parse_json(raw, "sampling_parameters", parse_constant=reject_constant) if raw.strip() else {}
    else:
        values = {k: v for k, v in extra.items() if not k.startswith("triton_")}
    check(isinstance(values, dict), "sampling_parameters", "must be a JSON object")
    values = {k: v for k, v in values.items() if v is not None}
    cache_salt = values.pop("cache_salt", None)
    check(cache_salt is None or isinstance(cache_salt, str), "cache_salt", "must be a string", cache_salt)
    lora = {key: values.pop(key) for key in ("lora_name", "lora_path") if key in values}
    for key, value in lora.items():
        check(isinstance(value, str) and bool(value), key, "must be a non-empty string", value)
    priority = values.pop("priority", 0)
    if isinstance(priority, str) and priority.strip().lstrip("-").isdigit():
        priority = int(priority)
    check(isinstance(priority, int) and not isinstance(priority, bool), "priority", "must be an integer", priority)
    flags["priority"] = priority
    flags["beam"] = pop_beam_options(values)  # None, or use_beam_search's options (model.py runs it)
    check(not (flags["beam"] and stream), "use_beam_search", "beam search is not streamed; set stream false")
    check(not (flags["beam"] and isinstance(prompt, dict)), "use_beam_search", "beam search takes text prompts only")
    values = {**(defaults or {}), **values}
    try:
        params = SamplingParams.from_dict(values)
    except (TypeError, AttributeError, OverflowError) as error:  # a shape no check foresaw: still the client's
        raise EngineError("sampling_parameters", f"invalid value ({error})") from None
    params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return prompt, params, flags, cache_salt, lora


def decode_images(values) -> list:
    """The `image` tensor's elements: base64 text of encoded images, decoded and bounded."""
    check(len(values) <= MAX_IMAGES_PER_PROMPT, "image", f"at most {MAX_IMAGES_PER_PROMPT} images per request")
    images = []
    for index, value in enumerate(values):
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise EngineError("image", f"image {index} is not base64") from None
        images.append(decode_image(data, "image", index))
    return images


def utf8(value, name: str) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as error:
        raise EngineError(name, f"not valid UTF-8 ({error.reason} at byte {error.start})") from None


def reject_constant(name: str):
    raise EngineError("sampling_parameters", f"{name} is not a number JSON allows")
