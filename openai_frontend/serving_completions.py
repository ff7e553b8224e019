"""POST /v1/completions: one Triton request per prompt, `n` samples each."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from openai_frontend.errors import invalid
from openai_frontend.generation import (Choices, check_stream_options, chunk_frames, log_completion, log_request,
                                        logprob_value, replay, sampling_parameters, sse_stream, start,
                                        structured_outputs, unless_disconnected)
from openai_frontend.schemas import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from openai_frontend.triton import TokenLogprob



MAX_PROMPTS_PER_REQUEST = 256
MAX_SAMPLES_PER_REQUEST = 256  # prompts x n (or best_of): a quarter of the engine's default waiting queue


def split_prompts(prompt) -> list[str | list[int]]:
    """The prompt field's four shapes -> a list of prompts, each text or token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def check_request_size(num_prompts: int, n: int, best_of: int | None, stream: bool) -> None:
    """Bounds on one request's share of the engine: prompts, and samples (n or best_of, times
    prompts). The prompts of a request are its unit: if the replica's queue cannot take them all,
    the first refusal fails the whole request (503) and cancels the prompts already admitted."""
    if num_prompts > MAX_PROMPTS_PER_REQUEST:
        raise invalid("prompt", f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {num_prompts}")
    if best_of is not None and best_of < n:
        raise invalid("best_of", f"best_of: must be at least n ({n}), got {best_of}")
    if best_of is not None and best_of != n and stream:
        raise invalid("best_of", "best_of: a streamed request cannot pick its best samples; drop best_of or stream")
    samples = num_prompts * (best_of or n)
    if samples > MAX_SAMPLES_PER_REQUEST:
        raise invalid("n", f"n: prompts times n (or best_of) must be at most {MAX_SAMPLES_PER_REQUEST} per request, "
                           f"got {samples}")


def beam_search_options(body: CompletionRequest) -> dict:
    """vLLM's `use_beam_search` -> the llm model's beam options (none without it): `best_of` (or
    `n`) beams, the n best returned in order."""
    if not body.use_beam_search:
        return {}
    if body.stream:
        raise invalid("use_beam_search", "use_beam_search: beam search is not streamed; set stream to false")
    if body.logprobs is not None:
        raise invalid("logprobs", "logprobs: not returned with beam search; drop logprobs or use_beam_search")
    return {"use_beam_search": True, "beam_width": body.best_of or body.n, "length_penalty": body.length_penalty,
            "early_stopping": body.early_stopping}


def completion_logprobs(entries: list[list[TokenLogprob]], offset: int, top: int) -> CompletionLogprobs:
    """OpenAI's legacy shape: the sampled (or echoed prompt) tokens, their logprobs, the top-N per
    position (none for `logprobs: 0`, which asks for the sampled tokens' logprobs alone); an echoed
    prompt's first token has no logprob (None, as in vLLM)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for position in entries:
        sampled = position[0]
        tokens.append(sampled.token)
        unscored = sampled.logprob is None
        token_logprobs.append(None if unscored else logprob_value(sampled.logprob))
        top_logprobs.append(None if unscored else {entry.token: logprob_value(entry.logprob) for entry in position}
                            if top else {})
        text_offset.append(offset)
        offset += len(sampled.token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=text_offset)


def echoed_logprobs(prompt_ids: list[int], prompt_logprobs: list | None, decode) -> list[list[TokenLogprob]]:
    """The prompt's positions as completion logprob entries: the first token unscored, then each
    prompt token (first) with the top-N at its position, from the engine's prompt logprobs."""
    first = [TokenLogprob(prompt_ids[0], decode([prompt_ids[0]]), None, None)]
    return [first] + list((prompt_logprobs or [None])[1:])


async def serve_completion(frontend, body: CompletionRequest, raw_request: Request):
    adapter = frontend.check_llm_model(body.model)  # {} or the LoRA adapter's sampling parameters
    include_usage = check_stream_options(body)
    if body.max_tokens == 0 and not body.echo:
        raise invalid("max_tokens", "max_tokens: must be at least 1 (0 only with echo: the prompt alone)")
    # echo with max_tokens 0 (lm-evaluation-harness' loglikelihood): the engine makes one token,
    # which nobody sees; the prompt and its logprobs are the answer (as in vLLM).
    echo_only = body.echo and body.max_tokens == 0
    beam = beam_search_options(body)
    items = split_prompts(body.prompt)
    samples = body.best_of if body.best_of is not None else body.n
    check_request_size(len(items), body.n, body.best_of, body.stream)
    prompts = [frontend.prompts.encode(p) if isinstance(p, str) else frontend.prompts.check_token_ids(p, "prompt")
               for p in items]
    if not prompts or not all(prompts):
        raise invalid("prompt", "prompt: must not be empty")
    prompts = [frontend.prompts.truncate(ids, body.truncate_prompt_tokens) for ids in prompts]
    structured = structured_outputs(body)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    parameters = [sampling_parameters(body, logprobs=body.logprobs, vocab_size=frontend.prompts.vocab_size,
                                      max_tokens=frontend.prompts.max_tokens_for(
                                          len(ids), 1 if echo_only else body.max_tokens, "prompt"),
                                      structured=structured, n=samples) | adapter
                  | ({"prompt_logprobs": echo_logprobs} if echo_logprobs is not None else {})
                  for ids in prompts]
    if beam:
        samples, parameters = body.n, [{**values, "n": body.n} | beam for values in parameters]
    echoes = [p if isinstance(p, str) else frontend.prompts.decode(p) for p in items] if body.echo else None
    prompt_logprobs: list = [None] * len(prompts)  # per prompt, from its first response (echo with logprobs)
    response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choices = Choices(len(prompts), samples, frontend.settings.enable_prompt_tokens_details)
    log_request(frontend, response_id, prompts, parameters)

    def echo_entries(prompt_index: int) -> list[list[TokenLogprob]]:
        return echoed_logprobs(prompts[prompt_index], prompt_logprobs[prompt_index], frontend.prompts.decode)

    def fold(prompt_index: int, chunk) -> list:
        if chunk.prompt_logprobs is not None:
            prompt_logprobs[prompt_index] = chunk.prompt_logprobs
        if echo_only:  # the one token made is not part of the answer
            for sample in chunk.samples:
                sample.text, sample.num_tokens, sample.logprobs = "", 0, None
        return choices.update(prompt_index, chunk)

    if body.stream:
        first, rest = await unless_disconnected(raw_request, start(frontend.triton, prompts, parameters, stream=True,
                                                                   prompt_param="prompt",
                                                                   structured_param=structured[1]))

        async def events():
            offsets = [0] * len(choices.choices)
            echoed: set[int] = set()
            async for prompt_index, chunk in replay(first, rest):
                news = fold(prompt_index, chunk)
                if echoes and prompt_index not in echoed:  # the prompt first, with its logprobs
                    echoed.add(prompt_index)
                    for index in range(prompt_index * body.n, (prompt_index + 1) * body.n):
                        logprobs = None
                        if body.logprobs is not None:
                            logprobs = completion_logprobs(echo_entries(prompt_index), 0, body.logprobs).model_dump()
                        offsets[index] = len(echoes[prompt_index])
                        yield chunk_event(index, echoes[prompt_index], logprobs, None)
                for index, delta in news:
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = completion_logprobs(delta.logprobs or [], offsets[index], body.logprobs).model_dump()
                        offsets[index] += len(delta.text)
                    yield chunk_event(index, delta.text, logprobs, delta.finish_reason)
            if include_usage:
                yield {"id": response_id, "object": "text_completion", "created": created, "model": body.model,
                       "choices": [], "usage": choices.usage().model_dump()}
            log_completion(frontend, response_id, choices)

        frame = chunk_frames(response_id, "text_completion", created, body.model)

        def chunk_event(index, text, logprobs, finish_reason) -> str:
            return frame({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    async def collect():
        first, rest = await start(frontend.triton, prompts, parameters, stream=False, prompt_param="prompt",
                                  structured_param=structured[1])
        async for prompt_index, chunk in replay(first, rest):
            fold(prompt_index, chunk)

    await unless_disconnected(raw_request, collect())
    if not beam:  # beams come back n best, in order
        choices.keep_best(body.n)
    log_completion(frontend, response_id, choices)

    def logprobs_of(index: int, choice) -> CompletionLogprobs | None:
        if body.logprobs is None:
            return None
        return completion_logprobs((echo_entries(index // body.n) if echoes else []) + choice.logprobs, 0, body.logprobs)

    return CompletionResponse(
        id=response_id, created=created, model=body.model, usage=choices.usage(),
        choices=[CompletionChoice(
            index=index, text=(echoes[index // body.n] if echoes else "") + choice.text,
            finish_reason=choice.finish_reason, logprobs=logprobs_of(index, choice))
            for index, choice in enumerate(choices.choices)])
