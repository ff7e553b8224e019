"""LLMEngine: the loop. `add_request` validates and queues, `step` schedules, runs the model, samples
and returns outputs, `abort_request` frees a request at once. Nothing else lives here.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path

from backend.config import EngineConfig
from backend.errors import check
from backend.kv_cache import KVCacheManager
from backend.lora import LoRARequest
from backend.metrics import EngineMetrics
from backend.model_runner import ModelRunner, load_hf_config, max_step_tokens
from backend.output_processor import ChildState, ParentRequest, append_token, make_output
from backend.detokenizer import IncrementalDetokenizer
from backend.outputs import RequestOutput
from backend.request import Request
from backend.sampling import Sampler
from backend.sampling_params import SamplingParams
from backend.scheduler import Scheduler
from backend.spec_decode import SpeculativeDecoder, accepted_tokens
from backend.structured_output import GrammarCompiler, RequestGrammar

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def eos_token_ids(model_path: str, hf_config: dict) -> set[int]:
    ids = hf_config.get("eos_token_id")
    generation = Path(model_path) / "generation_config.json"
    if generation.is_file():
        ids = json.loads(generation.read_text()).get("eos_token_id", ids)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, list) else {ids}


def lora_names(requests: list[Request]) -> str:
    """The adapters of these requests, comma-separated (vllm:lora_requests_info's label form)."""
    return ",".join(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Step on the thread that builds the engine: see `_warn_thread`.
        self.built_on = threading.current_thread()
        self._warned_thread = False
        self.model_path = config.resolved_model()
        hf_config = load_hf_config(self.model_path)
        self.model_name = config.served_model_name or Path(self.model_path).name
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or self.model_path)
        model_limit = hf_config.get("max_position_embeddings", 2048)
        window = hf_config.get("sliding_window")
        if window and hf_config.get("use_sliding_window", True):
            # Attention here is full, so stay where full and sliding-window attention agree.
            model_limit = min(model_limit, window)
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({model_limit})")
        self.max_model_len = config.max_model_len or model_limit
        max_batched = max_step_tokens(config, self.max_model_len)
        if not config.enable_chunked_prefill and max_batched < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens: {max_batched} is smaller than max_model_len "
                             f"({self.max_model_len}) while chunked prefill is off")
        self.runner = ModelRunner(config, self.model_path, hf_config, self.max_model_len)
        self.vocab_size = self.runner.args.vocab_size
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size,
                                       config.enable_prefix_caching, self.runner.num_swap_blocks)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, max_batched,
                                   config.enable_chunked_prefill, config.preemption_mode,
                                   config.scheduling_policy, config.max_loras if config.enable_lora else None)
        self.sampler = Sampler(config.seed)
        self.metrics = EngineMetrics(config.enable_lora)
        self.spec = None if config.speculative_config is None else SpeculativeDecoder(
            config, self.runner, self.kv_cache, self.metrics, self.max_model_len)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.parents: dict[str, ParentRequest] = {}
        self.held_siblings: dict[str, list[ChildState]] = {}  # n > 1: samples not yet queued
        self.children: dict[str, tuple[ParentRequest, ChildState]] = {}
        self._update_gauges()  # vllm:lora_requests_info's labels from the start

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {self.vocab_size})")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None, cache_salt: str | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; raises ValueError with a clear message if it can never run."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.enqueue(self.process_request(request_id, prompt, params, arrival_time=arrival_time,
                                          cache_salt=cache_salt, priority=priority, lora_request=lora_request))

    def process_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        *, arrival_time: float | None = None, cache_salt: str | None = None,
                        priority: int = 0, lora_request: LoRARequest | None = None) -> ParentRequest:
        """Tokenize and validate without touching engine state (safe from any thread)."""
        if lora_request is not None:
            check(isinstance(lora_request, LoRARequest), "lora_request", "must be a LoRARequest", lora_request)
            check(self.runner.lora is not None, "lora_request", "LoRA adapters need enable_lora")
            self.runner.lora.check(lora_request)
        params = copy.copy(params or SamplingParams())
        params.validate_for_model(self.vocab_size)
        prompt_text, prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        num_prompt = len(prompt_ids)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - num_prompt
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens; the "
                             f"request asks for {num_prompt + params.max_tokens} ({num_prompt} in the "
                             f"prompt, {params.max_tokens} max_tokens). Shorten the prompt or max_tokens.")
        needed = self.kv_cache.blocks_needed(num_prompt + params.max_tokens)
        if needed > self.kv_cache.num_blocks:
            raise ValueError(f"the request needs {needed} KV-cache blocks but only "
                             f"{self.kv_cache.num_blocks} exist; raise kv_cache_memory_bytes")
        params.all_stop_token_ids = self.eos_token_ids | set(params.stop_token_ids or ())
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        # A request may stream more sparsely than the server does, not more densely (as in vLLM).
        stream_interval = max(params.stream_interval or 1, self.config.stream_interval)
        parent = ParentRequest(request_id, prompt_text, prompt_ids, params.output_kind, stream_interval)
        arrival_time = arrival_time or time.time()
        for index in range(params.n):
            child_params = params
            child_id = request_id
            if params.n > 1:
                child_params = copy.copy(params)
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + index
                child_id = f"{index}_{request_id}"
            request = Request(child_id, prompt_text, prompt_ids, child_params, index=index,
                              parent_id=request_id, cache_salt=cache_salt, priority=priority,
                              arrival_time=arrival_time, lora_request=lora_request)
            if grammar is not None:
                request.grammar = RequestGrammar(grammar)
            detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params)
            parent.children.append(ChildState(request, detokenizer))
        return parent

    def enqueue(self, parent: ParentRequest) -> None:
        if parent.request_id in self.parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.children[child.request.request_id] = (parent, child)
            self.scheduler.stamp_arrival(child.request)
        first, *rest = parent.children
        self.scheduler.add(first.request)
        if rest and self.config.enable_prefix_caching:
            # Siblings wait until the first sample has computed the prompt, then find its
            # blocks in the prefix cache instead of computing the same prompt n times.
            self.held_siblings[parent.request_id] = rest
        else:
            for child in rest:
                self.scheduler.add(child.request)
        self._update_gauges()

    def _release_siblings(self) -> None:
        for parent_id, rest in list(self.held_siblings.items()):
            first = self.parents[parent_id].children[0].request
            if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens:
                for child in rest:
                    self.scheduler.add(child.request)
                del self.held_siblings[parent_id]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason abort)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        self.held_siblings.pop(request_id, None)
        for child in parent.children:
            request = child.request
            if not request.is_finished:
                request.finish_reason = "abort"
                self._finish(request)
            self.children.pop(request.request_id, None)
        self._update_gauges()
        return make_output(parent, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # -- the loop --------------------------------------------------------------------------------
    def _warn_thread(self) -> None:
        """libgomp keeps one OpenMP thread team per thread that opens a parallel region. A model
        loaded on one thread and run on another makes two teams, more threads than CPUs, and then
        libgomp cuts its barrier spin from 300,000 to 100 iterations: every parallel region puts its
        threads to sleep and wakes them through the kernel (decode steps measured 20% slower)."""
        self._warned_thread = True
        if self.runner.device.type == "cpu":
            logger.warning("the engine was built on thread %r and steps on %r: build it on the thread "
                           "that runs it (two OpenMP thread teams slow every CPU step down)",
                           self.built_on.name, threading.current_thread().name)

    def step(self) -> list[RequestOutput]:
        if threading.current_thread() is not self.built_on and not self._warned_thread:
            self._warn_thread()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        if plan.preempted:
            self.metrics.registry.inc(self.metrics.num_preemptions, len(plan.preempted))
        for request in plan.newly_admitted:
            request.metrics.first_scheduled_time = time.time()
            queried = request.num_prompt_tokens
            self.metrics.registry.inc(self.metrics.prefix_cache_queries, queried)
            self.metrics.registry.inc(self.metrics.prefix_cache_hits, request.num_cached_tokens)
        if plan.swap_out or plan.swap_in:
            self.runner.swap_blocks(plan.swap_out, plan.swap_in)
        if not plan.scheduled:
            self._update_gauges()
            return []
        logits, sampled_requests = self.runner.execute(plan.scheduled)
        for request, num_new in plan.scheduled:
            request.num_computed_tokens += num_new - len(request.spec_token_ids)  # drafts: once accepted
            self.kv_cache.cache_full_blocks(request)
        if self.held_siblings:
            self._release_siblings()
        rows = sampled_requests if self.spec is None else self.spec.verification_rows(sampled_requests)
        result = self.sampler(logits, rows) if rows else None

        updated: dict[str, set[int]] = {}
        row = 0
        for request in sampled_requests:
            parent, child = self.children[request.request_id]
            if request.num_output_tokens == 0:
                self.metrics.registry.inc(self.metrics.prompt_tokens, request.num_prompt_tokens)
                self._observe(self.metrics.time_to_first_token, time.time() - request.metrics.arrival_time)
            elif request.metrics.last_token_time is not None:
                self._observe(self.metrics.inter_token_latency, time.time() - request.metrics.last_token_time)
            drafts = request.spec_token_ids
            tokens = accepted_tokens(drafts, result.token_ids[row:row + 1 + len(drafts)])
            for i, token in enumerate(tokens):
                append_token(child, token, result.logprobs[row + i], self.eos_token_ids, self.max_model_len)
                if request.grammar is not None:
                    request.grammar.advance(request, token)
                self.metrics.registry.inc(self.metrics.generation_tokens)
                if request.finish_reason is not None:
                    break  # accepted tokens after a stop are dropped
            row += 1 + len(drafts)
            if drafts:
                self.spec.verified(request, len(tokens) - 1)
            updated.setdefault(parent.request_id, set()).add(request.index)
            if request.finish_reason is not None:
                self._finish(request)
                request.metrics.finished_time = time.time()

        outputs = []
        for parent_id, indexes in updated.items():
            parent = self.parents[parent_id]
            output = make_output(parent, indexes)
            if output is not None:
                outputs.append(output)
            if parent.finished:
                self._retire(parent)
        self._update_gauges()
        return outputs

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        if self.spec is not None:
            self.spec.finish(request)

    def _retire(self, parent: ParentRequest) -> None:
        del self.parents[parent.request_id]
        for child in parent.children:
            del self.children[child.request.request_id]
        self.metrics.registry.inc(self.metrics.request_success)
        first = parent.children[0].request.metrics
        self._observe(self.metrics.e2e_request_latency, time.time() - first.arrival_time)

    def _observe(self, metric, value: float) -> None:
        self.metrics.registry.observe(metric, value)

    def _update_gauges(self) -> None:
        registry, m = self.metrics.registry, self.metrics
        registry.set(m.num_requests_running, len(self.scheduler.running))
        registry.set(m.num_requests_waiting, len(self.scheduler.waiting))
        registry.set(m.kv_cache_usage_perc, self.kv_cache.usage)
        if m.lora_requests_info is not None:
            labels = {"running_lora_adapters": lora_names(self.scheduler.running),
                      "waiting_lora_adapters": lora_names(self.scheduler.waiting),
                      "max_lora": str(self.config.max_loras)}
            if labels != m.lora_requests_info.labels:
                registry.set_info(m.lora_requests_info, labels, time.time())

    def get_metrics(self):
        return self.metrics.registry.snapshot()

    def shutdown(self) -> None:
        """Stop the tensor/pipeline-parallel worker ranks, if any (idempotent)."""
        self.runner.shutdown()
