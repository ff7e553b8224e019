"""POST /v1/completions: one Triton request per prompt, `n` samples each."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from openai_frontend.errors import invalid
from openai_frontend.generation import (Choices, check_stream_options, log_completion, log_request, logprob_value,
                                        replay, sampling_parameters, sse_stream, start, structured_outputs,
                                        unless_disconnected)
from openai_frontend.schemas import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                     ErrorResponse)
from openai_frontend.triton import TokenLogprob

router = APIRouter()


def split_prompts(prompt) -> list[str | list[int]]:
    """The prompt field's four shapes -> a list of prompts, each text or token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def completion_logprobs(entries: list[list[TokenLogprob]], offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape: the sampled tokens, their logprobs, the top-N per position."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for position in entries:
        sampled = position[0]
        tokens.append(sampled.token)
        token_logprobs.append(logprob_value(sampled.logprob))
        top_logprobs.append({entry.token: logprob_value(entry.logprob) for entry in position})
        text_offset.append(offset)
        offset += len(sampled.token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=text_offset)


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_completion(body: CompletionRequest, raw_request: Request):
    frontend = raw_request.app.state.frontend
    adapter = frontend.check_llm_model(body.model)  # {} or the LoRA adapter's sampling parameters
    include_usage = check_stream_options(body)
    if body.echo and body.logprobs is not None:
        raise invalid("echo", "echo: prompt logprobs are not supported; drop echo or logprobs")
    items = split_prompts(body.prompt)
    prompts = [frontend.prompts.encode(p) if isinstance(p, str) else frontend.prompts.check_token_ids(p, "prompt")
               for p in items]
    if not prompts or not all(prompts):
        raise invalid("prompt", "prompt: must not be empty")
    structured = structured_outputs(body)
    parameters = [sampling_parameters(body, logprobs=body.logprobs, vocab_size=frontend.prompts.vocab_size,
                                      max_tokens=frontend.prompts.max_tokens_for(len(ids), body.max_tokens, "prompt"),
                                      structured=structured) | adapter
                  for ids in prompts]
    echoes = [p if isinstance(p, str) else frontend.prompts.decode(p) for p in items] if body.echo else None
    response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choices = Choices(len(prompts), body.n)
    log_request(frontend, response_id, prompts, parameters)

    if body.stream:
        first, rest = await unless_disconnected(raw_request, start(frontend.triton, prompts, parameters, stream=True,
                                                                   prompt_param="prompt",
                                                                   structured_param=structured[1]))

        async def events():
            offsets = [0] * len(choices.choices)
            if echoes:
                for index in range(len(choices.choices)):
                    yield chunk_event(index, echoes[index // body.n], None, None)
            async for prompt_index, chunk in replay(first, rest):
                for index, delta in choices.update(prompt_index, chunk):
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = completion_logprobs(delta.logprobs or [], offsets[index]).model_dump()
                        offsets[index] += len(delta.text)
                    yield chunk_event(index, delta.text, logprobs, delta.finish_reason)
            if include_usage:
                yield {"id": response_id, "object": "text_completion", "created": created, "model": body.model,
                       "choices": [], "usage": choices.usage().model_dump()}
            log_completion(frontend, response_id, choices)

        def chunk_event(index, text, logprobs, finish_reason) -> dict:
            return {"id": response_id, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    async def collect():
        first, rest = await start(frontend.triton, prompts, parameters, stream=False, prompt_param="prompt",
                                  structured_param=structured[1])
        async for prompt_index, chunk in replay(first, rest):
            choices.update(prompt_index, chunk)

    await unless_disconnected(raw_request, collect())
    log_completion(frontend, response_id, choices)
    return CompletionResponse(
        id=response_id, created=created, model=body.model, usage=choices.usage(),
        choices=[CompletionChoice(
            index=index, text=(echoes[index // body.n] if echoes else "") + choice.text,
            finish_reason=choice.finish_reason,
            logprobs=completion_logprobs(choice.logprobs, 0) if body.logprobs is not None else None)
            for index, choice in enumerate(choices.choices)])
