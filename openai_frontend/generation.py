"""What completions and chat share: OpenAI fields -> the engine's sampling parameters, running one
Triton request per prompt, gathering samples into choices, SSE framing, cancelling the work when
the HTTP client goes away, and the request log (prompts and completions only with --log-requests)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from backend.errors import EngineError
from backend.sampling_params import SamplingParams
from openai_frontend.errors import OpenAIError, from_engine_error, invalid
from openai_frontend.media import ImagePrompt
from openai_frontend.prompts import valid_text
from openai_frontend.schemas import PromptTokensDetails, SamplingRequest, Usage
from openai_frontend.triton import Chunk, SampleDelta, TokenLogprob, TritonClient

request_log = logging.getLogger("openai_frontend.requests")

PASSED_THROUGH = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop",
                  "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                  "include_stop_str_in_output", "skip_special_tokens", "stream_interval", "bad_words",
                  "allowed_token_ids")


def structured_outputs(request: SamplingRequest) -> tuple[dict | None, str | None]:
    """OpenAI's `response_format` or vLLM's `structured_outputs` -> the engine's structured_outputs,
    and the parameter to name when the engine refuses it (an invalid schema, regex or grammar)."""
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if request.structured_outputs is not None:
            raise invalid("response_format", "response_format: give it or structured_outputs, not both")
        if response_format.type == "json_object":
            return {"json_object": True}, "response_format"
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise invalid("response_format.json_schema", "response_format.json_schema: needs `schema`, "
                                                         "a JSON schema")
        return {"json": response_format.json_schema.schema_}, "response_format"
    if request.structured_outputs is not None:
        return request.structured_outputs.model_dump(by_alias=True, exclude_none=True), "structured_outputs"
    return None, None


def sampling_parameters(request: SamplingRequest, *, max_tokens: int, logprobs: int | None,
                        vocab_size: int, structured: tuple[dict | None, str | None] = (None, None),
                        n: int | None = None) -> dict:
    """The `sampling_parameters` JSON for Triton, validated by the engine's own rules so that a bad
    value is a 400 naming it here, not an error deep in Triton. `structured`: the structured_outputs
    and the request field they came from; `n`: the samples to draw, when not the request's n."""
    values = {name: getattr(request, name) for name in PASSED_THROUGH if getattr(request, name) is not None}
    values["max_tokens"] = max_tokens
    if n is not None:
        values["n"] = n  # best_of: more samples than the client gets back
    if structured[0] is not None:
        values["structured_outputs"] = structured[0]
    if logprobs is not None:
        values["logprobs"] = logprobs
    for stop in [request.stop] if isinstance(request.stop, str) else request.stop or ():
        valid_text(stop, "stop")
    if request.logit_bias:
        values["logit_bias"] = request.logit_bias
    try:  # the engine's own checks, vocabulary included: one place for each rule
        SamplingParams.from_dict(values).validate_for_model(vocab_size)
    except EngineError as error:
        if error.param == "structured_outputs" and structured[1]:
            error.param = structured[1]
        raise from_engine_error(error) from None
    if request.cache_salt is not None:
        values["cache_salt"] = valid_text(request.cache_salt, "cache_salt")
    if request.priority:
        values["priority"] = request.priority  # the engine refuses it unless its scheduling is by priority
    return values


def check_stream_options(request: SamplingRequest) -> bool:
    """Whether a final usage chunk is wanted; stream_options only make sense with stream."""
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options", "stream_options: only allowed when stream is true")
    return bool(request.stream and request.stream_options and request.stream_options.include_usage)


@dataclass
class Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    cumulative_logprob: float | None = None


class Choices:
    """Per-choice state of one HTTP request: choice index = prompt index * n + sample index."""

    def __init__(self, num_prompts: int, n: int, prompt_tokens_details: bool = False) -> None:
        self.n = n
        self.choices = [Choice() for _ in range(num_prompts * n)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.prompt_tokens_details = prompt_tokens_details  # --enable-prompt-tokens-details
        self.completion_tokens = 0  # set when best_of drops samples

    def update(self, prompt_index: int, chunk: Chunk) -> list[tuple[int, SampleDelta]]:
        """Fold one Triton response in; return the deltas worth sending, by choice index."""
        self.prompt_tokens[prompt_index] = chunk.prompt_tokens
        self.cached_tokens[prompt_index] = max(self.cached_tokens[prompt_index], chunk.cached_tokens)
        news = []
        for sample in chunk.samples:
            index = prompt_index * self.n + sample.index
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # responses keep repeating a finished sample's reason
            choice.text += sample.text
            choice.num_tokens += sample.num_tokens
            choice.logprobs.extend(sample.logprobs or [])
            choice.finish_reason = sample.finish_reason
            if sample.cumulative_logprob is not None:
                choice.cumulative_logprob = sample.cumulative_logprob
            if sample.text or sample.logprobs or sample.finish_reason:
                news.append((index, sample))
        return news

    def keep_best(self, n: int) -> None:
        """best_of: keep each prompt's n samples with the highest cumulative logprob (usage still
        counts every generated token)."""
        best = []
        for start in range(0, len(self.choices), self.n):
            samples = self.choices[start:start + self.n]
            best += sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
        self.completion_tokens = sum(choice.num_tokens for choice in self.choices)
        self.choices, self.n = best, n

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens)
        completion = self.completion_tokens or sum(choice.num_tokens for choice in self.choices)
        details = PromptTokensDetails(cached_tokens=sum(self.cached_tokens)) if self.prompt_tokens_details else None
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


CHUNKS_AHEAD = 4  # per generation, in merge()


async def merge(streams: list[AsyncGenerator[Chunk, None]]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """Interleave several generations as (prompt index, chunk); the first failure ends them all.
    Leaving early cancels every generation still running. A few chunks a generation are read ahead,
    no more: a client that reads slowly slows its generations' reading too (gRPC's flow control)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=CHUNKS_AHEAD * len(streams))
    end = object()

    async def pump(index: int, stream: AsyncGenerator[Chunk, None]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
            await queue.put((index, end))
        except Exception as error:
            await queue.put((index, error))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is end:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def single(stream: AsyncGenerator[Chunk, None]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """One generation as merge() gives it, without its task and queue: read by the caller's task."""
    async with aclosing(stream):
        async for chunk in stream:
            yield 0, chunk


async def start(triton: TritonClient, prompts: list[list[int]], parameters: list[dict], *, stream: bool,
                prompt_param: str, structured_param: str | None = None, images: list[ImagePrompt] | None = None
                ) -> tuple[tuple[int, Chunk], AsyncGenerator[tuple[int, Chunk], None]]:
    """Send every prompt (with its sampling parameters, and its text and images if it has any) and
    wait for the first response, so that a request Triton rejects still gets its HTTP status (not a
    200 stream carrying an error). A structured output the engine cannot compile is named as the
    field it came from."""
    streams = [triton.generate(ids, params, stream=stream, prompt_param=prompt_param, images=image)
               for ids, params, image in zip(prompts, parameters, images or [None] * len(prompts))]
    merged = single(streams[0]) if len(streams) == 1 else merge(streams)
    try:
        first = await merged.__anext__()
    except OpenAIError as error:
        await merged.aclose()
        if error.param == "structured_outputs" and structured_param:
            error.param = structured_param
        raise
    except BaseException:
        await merged.aclose()
        raise
    return first, merged


async def replay(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


# One encoder for every event (json.dumps with options builds one per call); compact, as OpenAI's.
to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(data: dict) -> str:
    return "data: " + to_json(data) + "\n\n"


def chunk_frames(response_id: str, object_name: str, created: int, model: str) -> Callable[[dict], str]:
    """The SSE frame of a streamed chunk with one choice, given the choice: the fields every chunk of
    the response repeats are encoded once."""
    head = to_json({"id": response_id, "object": object_name, "created": created, "model": model})
    prefix = "data: " + head[:-1] + ',"choices":['
    return lambda choice: prefix + to_json(choice) + "]}\n\n"


async def sse_stream(events: AsyncGenerator[dict | str, None]) -> AsyncIterator[str]:
    """Frame events (dicts, or frames already made) as SSE; a failure mid-way becomes an error
    event; `[DONE]` always comes last."""
    try:
        async for event in events:
            yield event if isinstance(event, str) else sse(event)
    except OpenAIError as error:
        yield sse(error.body())
    except Exception as error:  # never cut a stream without telling the client why
        yield sse(OpenAIError(500, f"internal error: {error}").body())
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client left before its answer was ready; its Triton requests are cancelled."""


CLIENT_GONE = 499  # nginx's "client closed request": what the metrics count; nobody receives it


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work` (a whole non-streaming request, or a stream's first response), cancelling it
    (and so its Triton requests) if the client disconnects first: then ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


def log_request(frontend, response_id: str, prompts: list[list[int]], parameters: list[dict]) -> None:
    """Prompts are the clients' data: logged only when the operator asked (--log-requests)."""
    if frontend.settings.log_requests:
        for index, (prompt, values) in enumerate(zip(prompts, parameters)):
            request_log.info("%s prompt %d: %r %s", response_id, index, frontend.prompts.decode(prompt),
                             json.dumps(values))


def log_completion(frontend, response_id: str, choices: Choices) -> None:
    if frontend.settings.log_requests:
        for index, choice in enumerate(choices.choices):
            request_log.info("%s choice %d (%s): %r", response_id, index, choice.finish_reason, choice.text)


def logprob_value(value: float) -> float:
    return max(value, -9999.0)  # -inf is not JSON
