"""From appended tokens to RequestOutputs: detokenization, stop strings, logprobs, token metrics and
n > 1 (the scheduler has appended the tokens and checked stop tokens and lengths). `OutputProcessor`
holds what each request needs for that (its parent, its detokenizer, what was already sent); the
scheduler holds where each request stands in the queue.

A user request with n samples is a parent of n child Requests that the scheduler runs independently
(their prompts share KV blocks through the prefix cache). This module turns each child's new tokens
into text, ends it on a stop string (dropping the tokens after it), and assembles the parent's
RequestOutput in the kind the caller asked for (cumulative, delta or final only). A stream interval above 1 (vLLM's
`stream_interval`) makes streamed outputs rarer: a sample's first token goes out at once, then its
news every `stream_interval` tokens and at its end, each output carrying all that is new, so that
the serving path handles a fraction of the messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from backend.engine.detokenizer import IncrementalDetokenizer
from backend.errors import EngineError
from backend.engine.metrics import EngineMetrics
from backend.outputs import CompletionOutput, Logprob, RequestOutput
from backend.sampling.prompt_logprobs import PromptScores
from backend.core.request import Request
from backend.core.step import SampledTokens
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
    sent_prompt_logprobs: bool = False  # a DELTA stream carries them once, in its first output

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)


class OutputProcessor:
    """The engine's unfinished user requests by id, and the post-step work on them: detokenize the
    appended tokens (ending requests on stop strings), count tokens and latencies, and build each
    request's RequestOutput."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, tuple[ParentRequest, ChildState]] = {}

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.children[child.request.request_id] = (parent, child)

    def pop(self, request_id: str) -> ParentRequest | None:
        parent = self.parents.pop(request_id, None)
        for child in parent.children if parent is not None else ():
            self.children.pop(child.request.request_id, None)
        return parent

    def append_tokens(self, appended: list[SampledTokens]) -> list[Request]:
        """Text, logprobs and token metrics for the tokens a step appended; returns the requests a
        stop string ended (their tokens after it dropped), for the engine to finish."""
        registry, m = self.metrics.registry, self.metrics
        step_tokens = 0
        stopped = []
        for item in appended:
            request = item.request
            _, child = self.children[request.request_id]
            now = time.time()
            num_before = request.num_output_tokens - len(item.token_ids)
            previous = request.metrics.last_token_time
            kept = emit_tokens(child, item.token_ids, item.logprobs, now)
            if kept is not None:  # a stop string: the tokens after it go
                del request.all_token_ids[request.num_prompt_tokens + num_before + kept:]
                stopped.append(request)
            else:
                kept = len(item.token_ids)
            if request.finish_reason is not None:
                request.metrics.finished_time = time.time()
            registry.inc(m.generation_tokens, kept)
            step_tokens += kept
            if num_before == 0:
                registry.inc(m.prompt_tokens, request.num_prompt_tokens)
                step_tokens += request.num_prompt_tokens
                registry.observe(m.time_to_first_token, now - request.metrics.arrival_time)
            elif previous is not None and kept:
                registry.observe(m.inter_token_latency, now - previous)
                registry.observe(m.time_per_output_token, now - previous)  # vLLM v1's: the same values
        if step_tokens:
            registry.observe(m.iteration_tokens, step_tokens)
        return stopped

    def append_prompt_logprobs(self, scores: list[PromptScores]) -> None:
        """The prompt tokens a step scored, as Logprob dicts: the prompt's token with its rank,
        then the top-N that differ from it (vLLM's shape)."""
        for item in scores:
            _, child = self.children[item.request.request_id]
            prompt_ids, entries = item.request.prompt_token_ids, item.request.prompt_logprobs
            decode = child.detokenizer.decode_token if child.detokenizer is not None else lambda _: None
            for position, (logprob, rank, top) in enumerate(item.entries, start=item.first_token):
                if position < len(entries):
                    continue  # scored before a preemption: the same numbers
                token_id = prompt_ids[position]
                entry = {token_id: Logprob(logprob, rank, decode(token_id))}
                for top_rank, (top_id, top_logprob) in enumerate(top, start=1):
                    if top_id != token_id:
                        entry[top_id] = Logprob(top_logprob, top_rank, decode(top_id))
                entries.append(entry)

    def make_outputs(self, sampled: list[SampledTokens]) -> list[RequestOutput]:
        """One output per user request with news this step; finished requests are forgotten."""
        updated: dict[str, set[int]] = {}
        for item in sampled:
            updated.setdefault(item.request.parent_id, set()).add(item.request.index)
        outputs = []
        for parent_id, indexes in updated.items():
            parent = self.parents[parent_id]
            output = make_output(parent, indexes)
            if output is not None:
                outputs.append(output)
            if parent.finished:
                self._retire(parent)
        return outputs

    def _retire(self, parent: ParentRequest) -> None:
        self.pop(parent.request_id)
        self.record_ended(parent)

    def record_ended(self, parent: ParentRequest) -> None:
        """Count a user request that ended: each of its samples (finished, or aborted), as vLLM v1
        counts them, and its n once."""
        registry, m = self.metrics.registry, self.metrics
        now = time.time()
        for child in parent.children:
            request, times = child.request, child.request.metrics
            scheduled = times.first_scheduled_time or now  # phases never reached last 0 s
            first_token = times.first_token_time or scheduled
            last_token = times.last_token_time or first_token
            registry.inc(m.request_success[request.finish_reason or "abort"])
            registry.observe(m.e2e_request_latency, (times.finished_time or now) - times.arrival_time)
            registry.observe(m.request_queue_time, scheduled - times.arrival_time)
            registry.observe(m.request_prefill_time, first_token - scheduled)
            registry.observe(m.request_decode_time, last_token - first_token)
            registry.observe(m.request_inference_time, last_token - scheduled)
            registry.observe(m.request_prompt_tokens, request.num_prompt_tokens)
            registry.observe(m.request_generation_tokens, request.num_output_tokens)
            registry.observe(m.request_params_max_tokens, request.params.max_tokens)
        registry.observe(m.request_params_n, len(parent.children))

    @staticmethod
    def failed_output(parent: ParentRequest, error: EngineError) -> RequestOutput:
        """The final output of a request refused after it was queued (its error in wire form)."""
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, [], True,
                             error=error.wire())


def emit_tokens(child: ChildState, token_ids: list[int], logprobs: list, now: float) -> int | None:
    """A request's appended tokens into its logprobs and text, up to a stop string: then it ends the
    request and returns how many tokens it keeps (None: no stop string). The last token may have
    stopped the request already (a stop token's text is left out unless asked for)."""
    request, detokenizer, params = child.request, child.detokenizer, child.request.params
    if request.metrics.first_token_time is None:
        request.metrics.first_token_time = now
    request.metrics.last_token_time = now
    num_before = request.num_output_tokens - len(token_ids)
    for kept, (token_id, logprob_info) in enumerate(zip(token_ids, logprobs), start=1):
        if logprob_info is not None:
            chosen_lp, rank, top = logprob_info
            request.cumulative_logprob += chosen_lp
            entry = {token_id: Logprob(chosen_lp, rank, detokenizer.decode_token(token_id) if detokenizer else None)}
            for top_rank, (top_id, top_lp) in enumerate(top, start=1):
                if top_id != token_id:
                    entry[top_id] = Logprob(top_lp, top_rank, detokenizer.decode_token(top_id) if detokenizer else None)
            request.logprobs.append(entry)
        if detokenizer is None:
            continue
        ended_by_stop_token = kept == len(token_ids) and request.finish_reason == "stop"
        # A stop token is not part of the text unless asked for (EOS is special and skipped anyway).
        new_ids = [] if ended_by_stop_token and not params.include_stop_str_in_output else [token_id]
        stop_string = detokenizer.update(new_ids, check_stop=num_before + kept >= params.min_tokens)
        if stop_string is not None:
            request.finish_reason, request.stop_reason = "stop", stop_string
            return kept
    return None


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
    prompt_logprobs = first.prompt_logprobs
    if kind == RequestOutputKind.DELTA and parent.sent_prompt_logprobs:
        prompt_logprobs = None
    parent.sent_prompt_logprobs |= prompt_logprobs is not None
    return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                         num_cached_tokens=first.num_cached_tokens, metrics=first.metrics,
                         prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs))


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
