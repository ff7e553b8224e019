"""Scheduler: decides, once per step, which requests run and how many tokens each computes.

Iteration-level continuous batching in vLLM v1's form: every step spends one token budget
(`max_num_batched_tokens`; a step that computes one long prompt's chunk and nothing else may take
`lone_prefill_tokens`), running requests first (a decode costs one token, an unfinished prompt
its next chunk, a decode with speculative drafts 1 + its drafts, fewer or none when budget or
blocks are short), then waiting requests in queue order while sequence slots, budget and free blocks
allow. When blocks run out a victim is preempted (by priority, then recency): by recompute (its
blocks are freed and it starts over) or by swap (its blocks are copied to CPU swap space and back
on resume). With a second KV tier, a waiting request's prefix hits go on past the KV cache's into
the tier; those blocks are copied back before the step (with swap's copies) instead of computed. A waiting request that does not fit may be passed over a bounded number of times so it
cannot stall smaller requests behind it forever; one whose grammar is still compiling waits
without being counted as passed over. For a model whose image placeholders attend to each other
(Gemma 3: `keep_images_whole`), a prefill chunk never ends inside an image's placeholders, so each
image is computed in one chunk. The scheduler never touches tensors: the plan it returns says
what to compute and which blocks to copy. After the step, `update_from_output` takes the plan and
the model runner's output (core/step.py): it appends the sampled tokens up to the first that stops
the request (stop token, max_tokens, the model's length; stop strings need text and are the output
processor's), counts what was computed, registers full blocks for the prefix cache, queues held
samples and frees finished requests.
"""

from __future__ import annotations

import bisect
import itertools

from backend.core.kv_cache import KVCacheManager
from backend.core.request import Request, RequestStatus
from backend.core.step import ModelRunnerOutput, SampledTokens, SchedulerOutput, StepUpdate

# How many times a waiting request that does not fit may be passed over by later ones.
MAX_HEAD_OF_LINE_SKIPS = 32


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, preemption_mode: str = "recompute",
                 scheduling_policy: str = "fcfs", max_loras: int | None = None,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(), max_model_len: int | None = None,
                 keep_images_whole: bool = False, lone_prefill_tokens: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.keep_images_whole = keep_images_whole  # a chunk never ends inside an image's placeholders
        self.eos_token_ids = eos_token_ids  # what ends a request that does not ignore EOS
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A step that computes one prompt's chunk and nothing else may take this many (config.py's
        # LARGE_STEP_TOKENS): nobody else is in the step to wait on it.
        self.lone_prefill_tokens = max(lone_prefill_tokens or 0, max_num_batched_tokens)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.by_priority = scheduling_policy == "priority"
        self.max_loras = max_loras  # distinct LoRA adapters a step may hold (the runner's slots)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # n > 1 with prefix caching: a request's other samples wait until its first one has computed
        # the prompt, then find its blocks in the prefix cache instead of computing it n times.
        self.held: dict[Request, list[Request]] = {}
        self._arrivals = itertools.count()

    def _queue_key(self, request: Request) -> tuple[int, int]:
        return (request.priority if self.by_priority else 0, request.arrival_order)

    def stamp_arrival(self, request: Request) -> None:
        if request.arrival_order is None:
            request.arrival_order = next(self._arrivals)

    def add(self, request: Request) -> None:
        """Queue a request by (priority, arrival); a preempted one keeps its original place."""
        self.stamp_arrival(request)
        bisect.insort(self.waiting, request, key=self._queue_key)

    def add_samples(self, samples: list[Request]) -> None:
        """Queue a user request's samples (see `held`)."""
        first, *rest = samples
        self.add(first)
        if rest and self.kv_cache.enable_prefix_caching:
            self.held[first] = rest
        else:
            for request in rest:
                self.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    @property
    def num_queued(self) -> int:
        """Samples waiting for a slot, held samples included."""
        return len(self.waiting) + sum(map(len, self.held.values()))

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """The step's plan. `drafts`: speculative tokens proposed for running decodes, by request
        id; each decode verifies as many as the budget and free blocks allow (`spec_token_ids`)."""
        drafts = drafts or {}
        out = SchedulerOutput()
        scheduled: dict[Request, int] = {}
        lone = self._one_long_prompt_alone()
        budget = self.lone_prefill_tokens if lone else self.max_num_batched_tokens
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = request.num_tokens - request.num_computed_tokens
            # A decode also verifies its speculative drafts, as many as the budget has room for.
            verify = drafts.get(request.request_id, [])[:budget - 1] if num_new == 1 else []
            if num_new > budget and not self.enable_chunked_prefill:
                continue
            num_new = min(num_new, budget)
            if self.keep_images_whole:
                num_new = self._end_outside_images(request, request.num_computed_tokens, num_new)
                if not num_new:
                    continue  # the next image's placeholders need more budget than is left
            self.kv_cache.free_behind_window(request)  # a sliding window on every layer: blocks it left
            while not self.kv_cache.allocate_slots(request, num_new + len(verify)):
                if verify:  # no blocks for the drafts: decode without them before preempting anyone
                    verify = []
                    continue
                victim = self._choose_victim()
                budget += scheduled.pop(victim, 0)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                if verify:
                    out.spec_token_ids[request.request_id] = verify
                scheduled[request] = num_new + len(verify)
                budget -= num_new + len(verify)

        # Admit waiting requests only in a step that preempted no one: otherwise the victim
        # would be re-admitted at once and preempt again.
        index = 0
        while (index < len(self.waiting) and not out.preempted and budget > 0
               and len(self.running) < self.max_num_seqs and not (lone and scheduled)):
            request = self.waiting[index]
            if request.grammar is not None and not request.grammar.is_ready():
                index += 1  # still compiling: not its turn yet, and not passed over either
                continue
            swapped = request.status == RequestStatus.SWAPPED
            # (No cache hits for a request still scoring its prompt: cached blocks have no logits.)
            reads_cache = not swapped and not request.needs_prompt_logprobs
            cached_blocks = self.kv_cache.find_cached_prefix(request) if reads_cache else []
            # The prefix goes on in the second KV tier: those blocks are copied back, not computed.
            offloaded = self.kv_cache.find_offloaded_prefix(request, len(cached_blocks)) if reads_cache else []
            num_cached = (len(cached_blocks) + len(offloaded)) * self.kv_cache.block_size
            num_new = request.num_tokens - request.num_computed_tokens - num_cached
            fits_budget = num_new <= budget or self.enable_chunked_prefill
            num_new = min(num_new, budget)
            if self.keep_images_whole:
                num_new = self._end_outside_images(request, request.num_computed_tokens + num_cached, num_new)
                fits_budget = fits_budget and num_new > 0
            if not (fits_budget and self._adapter_fits(request)
                    and self.kv_cache.allocate_slots(request, num_new, cached_blocks, offloaded)):
                if request.num_skips < MAX_HEAD_OF_LINE_SKIPS:
                    request.num_skips += 1
                    index += 1
                    continue
                break
            del self.waiting[index]
            if swapped:
                out.swap_in.extend(self.kv_cache.swap_in(request))
            elif request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                request.num_tier_cached_tokens = len(offloaded) * self.kv_cache.block_size
                out.newly_admitted.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new
        out.scheduled = list(scheduled.items())
        out.offload, out.load = self.kv_cache.take_tier_moves()
        return out

    def _one_long_prompt_alone(self) -> bool:
        """Whether this step computes one prompt's chunk and nothing else, a chunk the usual budget
        would cut: the one running request is still that far from its prompt's end (a decode, drafts
        or not, is never that far), or none runs and the first waiting one's prompt is that long (and
        not waiting on its grammar: then others would be admitted). Such a step may take
        `lone_prefill_tokens`."""
        if self.lone_prefill_tokens <= self.max_num_batched_tokens or len(self.running) > 1:
            return False
        if self.running:
            request = self.running[0]
        elif self.waiting:
            request = self.waiting[0]
            if request.grammar is not None and not request.grammar.is_ready():
                return False
        else:
            return False
        return request.num_tokens - request.num_computed_tokens > self.max_num_batched_tokens

    @staticmethod
    def _end_outside_images(request: Request, start: int, num_new: int) -> int:
        """num_new, shortened so that the chunk from `start` ends before an image whose placeholders it
        would cut (0 when the chunk starts inside that image)."""
        end = start + num_new
        for image in request.images:
            if image.offset < end < image.offset + image.length:
                end = image.offset
        return max(0, end - start)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether running the request keeps the adapters among the running within max_loras."""
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in adapters or len(adapters) < self.max_loras

    def _choose_victim(self) -> Request:
        if not self.by_priority:
            return self.running[-1]  # the most recently admitted
        return max(reversed(self.running), key=lambda r: r.priority)  # lowest priority, then latest

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        out.spec_token_ids.pop(request.request_id, None)
        out.preempted.append(request)
        swap = self.kv_cache.swap_out(request) if self.preemption_mode == "swap" else None
        if swap is not None:
            out.swap_out.extend(swap)
            request.status = RequestStatus.SWAPPED
        else:  # recompute (or the swap space is full)
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        self.add(request)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> StepUpdate:
        """After the model ran: append each request's sampled tokens (up to the first that stops
        it), count what was computed, register full blocks, queue held samples whose prompt is now
        cached, and free the requests that finished."""
        update = StepUpdate()
        for request, num_scheduled in scheduler_output.scheduled:
            tokens = runner_output.sampled_token_ids.get(request.request_id)
            if tokens:
                kept = self._append(request, tokens)
                logprobs = runner_output.logprobs.get(request.request_id) or [None] * len(tokens)
                update.appended.append(SampledTokens(request, tokens[:kept], logprobs[:kept]))
            if scheduler_output.drafts(request):
                # A verified decode: the KV of every appended token but the last is in place (the
                # accepted drafts count now); blocks taken only for rejected drafts go back.
                request.num_computed_tokens = request.num_tokens - 1
                self.kv_cache.trim(request, request.num_tokens)
            else:
                request.num_computed_tokens += num_scheduled
            self.kv_cache.cache_full_blocks(request)
        for first, rest in list(self.held.items()):
            if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens:
                for request in rest:
                    self.add(request)
                del self.held[first]
        update.finished = [r for r, _ in scheduler_output.scheduled
                           if r.finish_reason is not None and not r.is_finished]
        for request in update.finished:
            self.finish(request)
        return update

    def _append(self, request: Request, tokens: list[int]) -> int:
        """Append sampled tokens until one stops the request (the rest are dropped), advancing its
        grammar; returns how many it kept."""
        for kept, token in enumerate(tokens, start=1):
            request.all_token_ids.append(token)
            check_stop_token(request, token, self.eos_token_ids, self.max_model_len)
            if request.grammar is not None:
                request.grammar.advance(request, token)
            if request.finish_reason is not None:
                return kept
        return len(tokens)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks at once (an aborted request's
        held samples go with it: the caller finishes them too)."""
        self.held.pop(request, None)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:  # not yet queued (held n > 1 siblings) is fine too
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request)
        self.kv_cache.free_swap(request)


def check_stop_token(request: Request, token_id: int, eos_token_ids: set[int] | frozenset[int],
                     max_model_len: int | None) -> None:
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
            or (max_model_len is not None and request.num_tokens >= max_model_len):
        request.finish_reason = "length"
