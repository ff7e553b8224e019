"""Speculative decoding: a cheap proposer guesses a decoding request's next k tokens, the target model
scores them all in the same step as everyone else (the request runs as a 1 + k token chunk), and the
verified prefix is kept.

Proposers: `ngram` (prompt lookup: copy what followed the latest earlier occurrence of the request's
last n tokens) and `draft_model` (a smaller model of the same vocabulary, with its own KV cache,
proposing its greedy tokens). A proposal is data: request id -> drafts, handed to the scheduler,
which grants each decode as many as its budget and blocks allow and passes them on in its output.
Verification is sampling (backend/sampling/verification.py): outputs keep exactly the target's
distribution, and drafts only decide how many tokens a step yields.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from backend.config import SpeculativeConfig
from backend.core.kv_cache import KVCacheManager
from backend.core.request import Request
from backend.core.step import ModelRunnerOutput, SchedulerOutput
from backend.sampling_params import SamplingParams


def ngram_proposal(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` with a length in [min_n, max_n]; [] when no such suffix occurred before."""
    tokens = np.asarray(token_ids)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that end before the last token, so at least one token follows each of them.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {request.request_id: ngram_proposal(request.all_token_ids, self.min_n, self.max_n, k)
                for request, k in batch}

    def finish(self, request: Request) -> None:
        pass


DRAFT_PARAMS = SamplingParams(max_tokens=None)  # shadows are never sampled; Request wants params


class DraftModelProposer:
    """A second ModelRunner with its own KV cache and block tables. Each request has a shadow Request
    there holding the same tokens; after verification the shadow keeps the KV of the drafts that were
    accepted, catches up on the rest in one chunk and decodes k greedy tokens."""

    def __init__(self, config: SpeculativeConfig, engine_config, target, max_model_len: int) -> None:
        from backend.worker.model_loader import load_hf_config, model_args
        from backend.worker.model_runner import ModelRunner  # the draft model's runner

        path = os.path.expanduser(config.model)
        hf_config = load_hf_config(path)
        args = model_args(hf_config)
        if args.vocab_size != target.args.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({args.vocab_size}) differs "
                             f"from the target model's ({target.args.vocab_size})")
        # As many blocks as the target has, so that the draft follows whatever the target holds.
        element = target.kv_caches[0].element_size()
        parts, kv_heads, width = args.kv_cache_entry()
        block_bytes = parts * args.num_layers * engine_config.block_size * kv_heads * width * element
        draft_config = dataclasses.replace(
            engine_config, model=path, quantization=None, speculative_config=None, preemption_mode="recompute",
            kv_cache_memory_bytes=target.num_blocks * block_bytes, enable_prefix_caching=False,
            enable_lora=False, lora_modules=None)  # the draft proposes without adapters; the target verifies with them
        self.runner = ModelRunner(draft_config, path, hf_config, max_model_len)
        # No prefix caching: a shadow's blocks hold drafts that may be rolled back.
        self.kv_cache = KVCacheManager(self.runner.num_blocks, engine_config.block_size, False)
        self.max_len = min(max_model_len, args.max_position_embeddings)
        self.shadows: dict[str, tuple[Request, int]] = {}  # request id -> (shadow, tokens verified then)

    def _sync(self, request: Request) -> Request:
        """The request's shadow with its tokens; computed KV kept only where the tokens still agree."""
        shadow, verified = self.shadows.get(request.request_id) or (
            Request(request.request_id, None, request.prompt_token_ids, DRAFT_PARAMS), 0)
        tokens = request.all_token_ids
        # At least the last token is computed again: its logits give the first draft.
        valid = min(shadow.num_computed_tokens, verified, len(tokens) - 1)
        end = min(shadow.num_computed_tokens, len(tokens) - 1)
        while valid < end and shadow.all_token_ids[valid] == tokens[valid]:
            valid += 1
        shadow.num_computed_tokens = valid
        shadow.all_token_ids[valid:] = tokens[valid:]
        self.shadows[request.request_id] = (shadow, len(tokens))
        return shadow

    def propose(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        work: list[tuple[Request, Request, int]] = []
        drafts: dict[str, list[int]] = {}
        for request, k in batch:
            if request.num_tokens + k > self.max_len:
                continue
            shadow, verified = self.shadows.get(request.request_id, (None, 0))
            if shadow is not None and verified == request.num_tokens and shadow.num_tokens >= verified + k:
                # Proposed for and not scheduled since (the step's budget ran out): the same drafts.
                drafts[request.request_id] = shadow.all_token_ids[verified:verified + k]
                continue
            shadow = self._sync(request)
            # Slots for the catch-up chunk and for the drafts fed back (the last draft is not).
            if not self.kv_cache.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1):
                self.finish(request)  # no room: this request goes without drafts for now
                continue
            work.append((request, shadow, k))
        for i in range(max((k for _, _, k in work), default=0)):
            shadows = [shadow for _, shadow, k in work if k > i]
            step = SchedulerOutput([(s, s.num_tokens - s.num_computed_tokens) for s in shadows])
            logits, sampled, _ = self.runner.execute(step)
            for shadow, token in zip(sampled, logits.argmax(dim=-1).tolist()):
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.all_token_ids.append(token)
        drafts.update((request.request_id, shadow.all_token_ids[request.num_tokens:]) for request, shadow, _ in work)
        return drafts

    def finish(self, request: Request) -> None:
        shadow, _ = self.shadows.pop(request.request_id, (None, 0))
        if shadow is not None:
            self.kv_cache.free(shadow)


class SpeculativeDecoder:
    """The engine's side: propose before scheduling, count what verification accepted after."""

    def __init__(self, engine_config, target, kv_cache: KVCacheManager, metrics, max_model_len: int) -> None:
        config: SpeculativeConfig = engine_config.speculative_config  # parsed by EngineConfig
        self.num_speculative_tokens = config.num_speculative_tokens
        self.kv_cache = kv_cache
        self.metrics = metrics
        self.proposer = (NgramProposer(config) if config.method == "ngram"
                         else DraftModelProposer(config, engine_config, target, max_model_len))

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Drafts for every running request that decodes (the rest get none). Requests with a grammar
        are left out: their grammar state would have to follow each draft."""
        batch = []
        for request in running:
            # A step yields at most k + 1 tokens; leave room for them under max_tokens.
            k = min(self.num_speculative_tokens, request.params.max_tokens - request.num_output_tokens - 1)
            if k > 0 and request.grammar is None and request.num_computed_tokens == request.num_tokens - 1:
                batch.append((request, k))
        return self.proposer.propose(batch)

    def count(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """The step's drafts, drafted tokens and accepted ones, in vLLM's counters."""
        registry, m = self.metrics.registry, self.metrics
        for request_id, drafts in scheduler_output.spec_token_ids.items():
            registry.inc(m.spec_decode_num_drafts)
            registry.inc(m.spec_decode_num_draft_tokens, len(drafts))
            registry.inc(m.spec_decode_num_accepted_tokens, len(runner_output.sampled_token_ids[request_id]) - 1)

    def finish(self, request: Request) -> None:
        self.proposer.finish(request)

