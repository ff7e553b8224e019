"""The frontend's only door to Triton: one gRPC stream per generation request to the `llm` model
(the vLLM backend's tensor contract), one unary call per batch of texts to `embeddings`.

A generation is an async iterator of `Chunk`s; closing it early (the HTTP client left) cancels the
gRPC call, which Triton turns into a cancelled request and the engine into freed KV blocks. When
Triton goes away, calls fail at once with `ReplicaUnavailable` (a 503) and the channel keeps
reconnecting every two seconds at most, so service resumes by itself when Triton is back. A call
given a deadline fails with `RequestTimeout` (a 504) past it; health calls always have one.
`probe` asks the model's own process whether it is alive, which Triton's readiness does not tell.
One TritonClient talks to one Triton; openai_frontend/replicas.py spreads requests over several.
"""

from __future__ import annotations

import asyncio
import json
import struct
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from openai_frontend.errors import OpenAIError, from_grpc_error, from_triton_message, invalid
from openai_frontend.media import ImagePrompt

LLM_MODEL = "llm"
EMBEDDINGS_MODEL = "embeddings"
EMBEDDINGS_MAX_BATCH = 64  # the embeddings model's max_batch_size
EMBEDDINGS_BATCHES_IN_FLIGHT = 2  # per request: enough to keep the model busy, not to monopolise it
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                "return_num_cached_tokens")
# Sampling parameters that vLLM's SamplingParams lacks (its backend refuses the whole request).
VLLM_BACKEND_LACKS = ("cache_salt", "priority", "lora_path")
DRAIN_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 5.0  # a readiness call or probe not answered by then: Triton is frozen or swamped
CHANNEL_ARGS = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
                # gRPC's default reconnect backoff grows to 120 s; Triton restarts take seconds.
                ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", 2000)]
# Raw tensor contents: a BYTES element's length prefix (little-endian), and the memoryview codes of
# the numeric types the llm model sends (in the host's byte order, as tritonclient reads them too).
_LENGTH = struct.Struct("<I")
_NUMBERS: dict[str, Any] = {"UINT32": "I", "INT32": "i", "UINT64": "Q", "INT64": "q", "FP32": "f", "FP64": "d"}


class ReplicaUnavailable(OpenAIError):
    """This Triton cannot be reached (or went away mid-request): another replica may serve."""

    def __init__(self, url: str, details: str) -> None:
        super().__init__(503, f"Triton at {url} is unreachable: {details}", None, "service_unavailable")


class RequestTimeout(OpenAIError):
    """The request ran past the frontend's --request-timeout; Triton cancels it."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(504, f"The request did not finish within the server's request timeout "
                              f"({timeout_s:.3g} s).", None, "request_timeout")


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None: an echoed prompt's first token (nothing predicts it)
    rank: int | None


@dataclass
class SampleDelta:
    """What one sample (of n) gained in one response."""
    index: int
    text: str
    num_tokens: int
    finish_reason: str | None
    # One entry per new token: the sampled token first, then the top alternatives.
    logprobs: list[list[TokenLogprob]] | None
    cumulative_logprob: float | None = None  # of everything the sample generated so far (n > 1)


@dataclass
class Chunk:
    prompt_tokens: int
    samples: list[SampleDelta]
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With prompt_logprobs, in the first chunk: per prompt token (None for the first), the prompt's
    # token first, then the top alternatives.
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None


def _tensor(name: str, value: np.ndarray, datatype: str) -> InferInput:
    tensor = InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _bool(name: str, value: bool) -> InferInput:
    return _tensor(name, np.array([value], dtype=bool), "BOOL")


def _parse_logprobs(raw: bytes) -> list[list[TokenLogprob]] | None:
    positions = json.loads(raw)
    if positions is None:
        return None
    return [None if position is None else  # (a prompt's first token)
            [TokenLogprob(int(token_id), entry.get("decoded_token") or "", entry["logprob"], entry.get("rank"))
             for token_id, entry in position.items()] for position in positions]


def _strings(raw: bytes) -> list[bytes]:
    """A BYTES tensor's elements: each a 4-byte little-endian length, then that many bytes."""
    values, offset = [], 0
    while offset < len(raw):
        length = _LENGTH.unpack_from(raw, offset)[0]
        values.append(raw[offset + 4:offset + 4 + length])
        offset += 4 + length
    return values


def _outputs(response) -> dict[str, list]:
    """A streamed response's output tensors by name, flat: bytes for BYTES, Python numbers else.
    Read straight from the raw contents (Triton sends every output there), in one pass: cheaper,
    per response, than tritonclient's as_numpy, which searches the outputs for each name and builds
    numpy arrays the frontend would only unpack again."""
    tensors = {}
    for output, raw in zip(response.outputs, response.raw_output_contents):
        code = _NUMBERS.get(output.datatype)
        tensors[output.name] = _strings(raw) if code is None else memoryview(raw).cast(code).tolist()
    return tensors


def _chunk(response, want_logprobs: bool, want_prompt_logprobs: bool = False) -> Chunk:
    outputs = _outputs(response)
    finish_reasons = outputs.get("finish_reason")
    counts = outputs.get("num_output_tokens")
    logprobs = outputs.get("logprobs") if want_logprobs else None
    cumulative = outputs.get("cumulative_logprob")
    samples = []
    for i, text in enumerate(outputs["text_output"]):
        reason = finish_reasons[i].decode() if finish_reasons is not None else "None"
        samples.append(SampleDelta(
            index=i, text=text.decode("utf-8"), num_tokens=counts[i] if counts is not None else 0,
            finish_reason=None if reason == "None" else reason,
            logprobs=_parse_logprobs(logprobs[i]) if logprobs is not None else None,
            cumulative_logprob=cumulative[i] if cumulative is not None else None))
    prompt_tokens = outputs.get("num_input_tokens")
    cached = outputs.get("num_cached_tokens")
    prompt_logprobs = outputs.get("prompt_logprobs") if want_prompt_logprobs else None
    return Chunk(prompt_tokens[0] if prompt_tokens is not None else 0, samples,
                 cached[0] if cached is not None else 0,
                 _parse_logprobs(prompt_logprobs[0]) if prompt_logprobs is not None else None)


async def _drain(responses) -> None:
    """Read a finished stream to its end. Triton closes a stream once it has answered every request
    on it; cancelling it a moment before that (or dropping it, which cancels) leaks the stream's
    state in Triton 2.51, and a model with such a stream never unloads."""
    async def rest() -> None:
        async for _ in responses:
            pass

    try:
        await asyncio.wait_for(rest(), DRAIN_TIMEOUT_S)
    except (asyncio.TimeoutError, grpc.RpcError):
        responses.cancel()


class TritonClient:
    def __init__(self, url: str, decode: Callable[[list[int]], str] | None = None) -> None:
        """`decode`: send each prompt as text, decoded from its token ids, with only the inputs of
        Triton's own vLLM backend (`--prompt-as-text`), which takes no token ids."""
        self.url = url
        self.decode = decode
        self.client = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)

    async def close(self) -> None:
        await self.client.close()

    async def model_ready(self, model: str) -> bool:
        """False when the model is not loaded; raises ReplicaUnavailable when Triton is unreachable
        or does not answer within HEALTH_TIMEOUT_S (a frozen process)."""
        try:
            return await self.client.is_model_ready(model, client_timeout=HEALTH_TIMEOUT_S)
        except InferenceServerException as error:
            if "unavailable" in str(error.status() or "").lower() or "failed to connect" in str(error).lower():
                raise ReplicaUnavailable(self.url, error.message()) from None
            if "deadline" in str(error.status() or "").lower():
                raise ReplicaUnavailable(self.url, f"no answer within {HEALTH_TIMEOUT_S:g} s") from None
            return False

    async def probe(self, model: str) -> str | None:
        """None when the model's own process answers, else why not. Triton keeps a Python-backend
        model READY after its stub process died (2.51), so readiness alone cannot tell; the probe is
        a request without a prompt, which a live model refuses at once without touching its engine,
        and which Triton answers for a dead one with "Stub process 'llm_0_0' is not healthy."
        Raises ReplicaUnavailable when Triton cannot be reached."""
        if model == EMBEDDINGS_MODEL:
            return await self._probe_embeddings()

        async def requests():
            yield {"model_name": model, "inputs": [], "request_id": "health-probe"}

        responses = self.client.stream_infer(requests(), stream_timeout=HEALTH_TIMEOUT_S)
        try:
            async for _, error in responses:
                await _drain(responses)
                refused = error is not None and from_triton_message(error.message()).code == "model_unavailable"
                return error.message() if refused else None
            return "Triton closed the probe's stream without an answer"
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise ReplicaUnavailable(self.url, error.details()) from None
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"the `{model}` model did not answer a probe within {HEALTH_TIMEOUT_S:g} s"
            return f"the probe failed: {error.details()}"

    async def _probe_embeddings(self) -> str | None:
        """The embeddings model's probe: one empty token-id list (all padding), which its live
        process refuses at once, before encoding anything; Triton answers for a dead one as above."""
        probe = _tensor("input_ids", np.full((1, 1), -1, dtype=np.int32), "INT32")
        try:
            await self.client.infer(EMBEDDINGS_MODEL, [probe], request_id="health-probe",
                                    client_timeout=HEALTH_TIMEOUT_S)
            return None
        except InferenceServerException as error:
            status = str(error.status() or "")
            if "UNAVAILABLE" in status and "not healthy" not in (error.message() or ""):
                raise ReplicaUnavailable(self.url, error.message()) from None
            if "DEADLINE_EXCEEDED" in status:
                return f"the `{EMBEDDINGS_MODEL}` model did not answer a probe within {HEALTH_TIMEOUT_S:g} s"
            refused = from_triton_message(error.message()).code == "model_unavailable"
            return error.message() if refused else None

    async def generate(self, prompt_token_ids: list[int], sampling_parameters: dict, *, stream: bool,
                       prompt_param: str = "prompt", timeout: float | None = None,
                       images: ImagePrompt | None = None) -> AsyncGenerator[Chunk, None]:
        """Run one request on the llm model; yield a Chunk per response (one when not streaming).
        With `images`, the prompt goes as its text (the model's processor places each image's
        tokens) and the images as the `image` input.

        Raises OpenAIError for a failed request, RequestTimeout past `timeout` seconds (a gRPC
        deadline, so Triton cancels the request too). Leaving the iteration early cancels it.
        """
        want_logprobs = sampling_parameters.get("logprobs") is not None
        want_prompt_logprobs = sampling_parameters.get("prompt_logprobs") is not None
        inputs = [_tensor("sampling_parameters", np.array([json.dumps(sampling_parameters).encode()],
                                                           dtype=np.object_), "BYTES"),
                  _bool("stream", stream), _bool("exclude_input_in_output", True),
                  _bool("return_logprobs", want_logprobs)]
        if images is not None:
            inputs += [_tensor("text_input", np.array([images.text.encode()], dtype=np.object_), "BYTES"),
                       _tensor("image", np.array(images.images, dtype=np.object_), "BYTES")]
        if self.decode is None:
            if images is None:
                inputs.append(_tensor("input_ids", np.array(prompt_token_ids, dtype=np.int32), "INT32"))
            inputs += [_bool("return_prompt_logprobs", want_prompt_logprobs)]
            inputs += [_bool(flag, True) for flag in RETURN_FLAGS]
        else:  # Triton's vLLM backend: a text prompt, and none of the inputs it lacks
            for name in VLLM_BACKEND_LACKS:
                if name in sampling_parameters:
                    raise invalid(name, f"{name}: not supported by Triton's vLLM backend (--prompt-as-text)")
            if images is None:
                text = self.decode(prompt_token_ids).encode()
                inputs += [_tensor("text_input", np.array([text], dtype=np.object_), "BYTES")]
            inputs += [_bool(flag, True) for flag in RETURN_FLAGS if flag != "return_num_cached_tokens"]
        if sampling_parameters.get("n", 1) > 1:  # for best_of: the n best samples by cumulative logprob
            inputs.append(_bool("return_cumulative_logprob", True))
        request = {"model_name": LLM_MODEL, "inputs": inputs, "request_id": uuid.uuid4().hex,
                   # Mark the last response of the request so we know when to stop reading.
                   "parameters": {"enable_empty_final_response": True}}

        async def requests():
            yield request

        responses = self.client.stream_infer(requests(), stream_timeout=timeout)
        completed = False
        try:
            async for result, error in responses:
                if error is not None:  # Triton's last answer to the request
                    completed = True
                    await _drain(responses)
                    raise from_triton_message(error.message(), prompt_param)
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                if response.outputs:  # the empty final response carries nothing
                    yield _chunk(response, want_logprobs, want_prompt_logprobs)
                if final:
                    completed = True
                    await _drain(responses)
                    return
            completed = True
            raise ReplicaUnavailable(self.url, "it closed the stream before the request finished")
        except grpc.RpcError as error:
            completed = True
            if error.code() == grpc.StatusCode.UNAVAILABLE:  # the connection, not the model
                raise ReplicaUnavailable(self.url, error.details()) from None
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
                raise RequestTimeout(timeout) from None
            raise from_grpc_error(error) from None
        finally:
            if not completed:  # the caller went away (client disconnect, cancellation)
                responses.cancel()

    async def embed(self, inputs: list[str] | list[list[int]],
                    timeout: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Embeddings (float32 [len(inputs), dim]) and token counts, for texts or token-id lists, in
        batches the model accepts, EMBEDDINGS_BATCHES_IN_FLIGHT at a time: a large request shares the
        model with others, and cancelling it stops its work after the batches in flight.
        RequestTimeout past `timeout` seconds (per call)."""
        batches = [inputs[i:i + EMBEDDINGS_MAX_BATCH] for i in range(0, len(inputs), EMBEDDINGS_MAX_BATCH)]
        slots = asyncio.Semaphore(EMBEDDINGS_BATCHES_IN_FLIGHT)

        async def run(batch):
            async with slots:
                return await self._embed_batch(batch, timeout)

        tasks = [asyncio.ensure_future(run(batch)) for batch in batches]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return (np.concatenate([vectors for vectors, _ in results]),
                np.concatenate([counts for _, counts in results]))

    async def _embed_batch(self, batch: list[str] | list[list[int]],
                           timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(batch[0], str):
            tensor = _tensor("text", np.array([[t.encode("utf-8")] for t in batch], dtype=np.object_), "BYTES")
        else:  # token ids, padded with -1 to one length
            ids = np.full((len(batch), max(map(len, batch))), -1, dtype=np.int32)
            for row, token_ids in zip(ids, batch):
                row[:len(token_ids)] = token_ids
            tensor = _tensor("input_ids", ids, "INT32")
        outputs = [InferRequestedOutput("embedding"), InferRequestedOutput("num_tokens")]
        try:
            result = await self.client.infer(EMBEDDINGS_MODEL, [tensor], outputs=outputs, client_timeout=timeout)
        except InferenceServerException as error:
            status = str(error.status() or "")
            if "UNAVAILABLE" in status:
                raise ReplicaUnavailable(self.url, error.message()) from None
            if "DEADLINE_EXCEEDED" in status and timeout is not None:
                raise RequestTimeout(timeout) from None
            if "DEADLINE_EXCEEDED" in status or "RESOURCE_EXHAUSTED" in status:
                raise OpenAIError(503, f"Triton is unreachable or overloaded: {error.message()}",
                                  None, "service_unavailable") from None
            raise from_triton_message(error.message(), "input") from None
        return result.as_numpy("embedding"), result.as_numpy("num_tokens").reshape(-1)
