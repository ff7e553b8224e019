"""From sampled tokens to RequestOutputs: stop checks, detokenization, logprobs and n > 1.

A user request with n samples is a parent of n child Requests that the scheduler runs independently
(their prompts share KV blocks through the prefix cache). This module appends each child's new
token, decides whether it finished and why, and assembles the parent's RequestOutput in the kind the
caller asked for (cumulative, delta or final only). A stream interval above 1 (vLLM's
`stream_interval`) makes streamed outputs rarer: a sample's first token goes out at once, then its
news every `stream_interval` tokens and at its end, each output carrying all that is new, so that
the serving path handles a fraction of the messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from backend.detokenizer import IncrementalDetokenizer
from backend.outputs import CompletionOutput, Logprob, RequestOutput
from backend.request import Request
from backend.sampling_params import RequestOutputKind


@dataclass
class ChildState:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    sent_tokens: int = 0  # what outputs have already carried (DELTA ones carry only what follows)
    sent_text: int = 0

    def due(self, stream_interval: int) -> bool:
        """Whether this sample's news goes out now: its first token, every `stream_interval`
        tokens after that, and its end."""
        request = self.request
        return (stream_interval == 1 or request.is_finished or self.sent_tokens == 0
                or request.num_output_tokens - self.sent_tokens >= stream_interval)


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    stream_interval: int = 1
    children: list[ChildState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)


def check_stop_token(request: Request, token_id: int, eos_token_ids: set[int],
                     max_model_len: int) -> None:
    """Set finish_reason / stop_reason from the token just appended (stop strings come later)."""
    params = request.params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            request.finish_reason = "stop"
            return
        if params.stop_token_ids and token_id in params.stop_token_ids:
            request.finish_reason, request.stop_reason = "stop", token_id
            return
    if (params.max_tokens is not None and num_output >= params.max_tokens) \
            or request.num_tokens >= max_model_len:
        request.finish_reason = "length"


def append_token(child: ChildState, token_id: int, logprob_info, eos_token_ids: set[int],
                 max_model_len: int) -> None:
    request = child.request
    request.all_token_ids.append(token_id)
    now = time.time()
    if request.metrics.first_token_time is None:
        request.metrics.first_token_time = now
    request.metrics.last_token_time = now
    if logprob_info is not None:
        chosen_lp, rank, top = logprob_info
        request.cumulative_logprob += chosen_lp
        detok = child.detokenizer
        entry = {token_id: Logprob(chosen_lp, rank, detok.decode_token(token_id) if detok else None)}
        for top_rank, (top_id, top_lp) in enumerate(top, start=1):
            if top_id != token_id:
                entry[top_id] = Logprob(top_lp, top_rank, detok.decode_token(top_id) if detok else None)
        request.logprobs.append(entry)
    check_stop_token(request, token_id, eos_token_ids, max_model_len)
    if child.detokenizer is not None:
        params = request.params
        ended_by_stop_token = request.finish_reason == "stop"
        # A stop token is not part of the text unless asked for (EOS is special and skipped anyway).
        new_ids = [] if ended_by_stop_token and not params.include_stop_str_in_output else [token_id]
        stop_string = child.detokenizer.update(new_ids, check_stop=request.num_output_tokens >= params.min_tokens)
        if stop_string is not None:
            request.finish_reason, request.stop_reason = "stop", stop_string


def make_output(parent: ParentRequest, updated: set[int] | None) -> RequestOutput | None:
    """The parent's output for this step, or None when its kind has nothing to say yet.
    `updated` holds the indexes of children that changed (None: all)."""
    finished = parent.finished
    kind = parent.output_kind
    if kind == RequestOutputKind.FINAL_ONLY and not finished:
        return None
    news = [child for child in parent.children if updated is None or child.request.index in updated]
    due = [child for child in news if child.due(parent.stream_interval)]
    if not due and not finished:
        return None
    if kind == RequestOutputKind.DELTA:
        children = due if not finished else news
    else:
        children = parent.children
    outputs = [_completion(child, delta=kind == RequestOutputKind.DELTA) for child in children]
    first = parent.children[0].request
    return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                         num_cached_tokens=first.num_cached_tokens, metrics=first.metrics)


def _completion(child: ChildState, delta: bool) -> CompletionOutput:
    request = child.request
    finished = request.is_finished
    text = child.detokenizer.emittable_text(finished) if child.detokenizer else ""
    token_ids = request.output_token_ids
    logprobs = request.logprobs
    text_start, token_start = child.sent_text, child.sent_tokens
    child.sent_text, child.sent_tokens = len(text), len(token_ids)
    if delta:
        text, token_ids = text[text_start:], token_ids[token_start:]
        logprobs = logprobs[token_start:] if logprobs is not None else None
    else:
        logprobs = list(logprobs) if logprobs is not None else None
    cumulative = request.cumulative_logprob if request.logprobs is not None else None
    return CompletionOutput(request.index, text, token_ids, cumulative, logprobs,
                            request.finish_reason, request.stop_reason)
