"""Scheduler: decides, once per step, which requests run and how many tokens each computes.

Iteration-level continuous batching in vLLM v1's form: every step spends one token budget
(`max_num_batched_tokens`), running requests first (a decode costs one token, an unfinished prompt
its next chunk), then waiting requests in arrival order while sequence slots, budget and free blocks
allow. When blocks run out, the most recently admitted running request is preempted by recompute:
its blocks are freed and it goes back to the front of the queue. The scheduler never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backend.kv_cache import KVCacheManager
from backend.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    newly_admitted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                index += 1
                continue
            num_new = min(num_new, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nobody after it is left

        # Admit waiting requests only in a step that preempted no one: otherwise the victim
        # would be re-admitted at once and preempt again.
        while (self.waiting and not out.preempted and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            cached_blocks = self.kv_cache.find_cached_prefix(request)
            num_new = request.num_tokens - len(cached_blocks) * self.kv_cache.block_size
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv_cache.allocate_slots(request, num_new, cached_blocks):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = len(cached_blocks) * self.kv_cache.block_size
                out.newly_admitted.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:  # not yet queued (held n > 1 siblings) is fine too
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request)
