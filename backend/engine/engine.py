"""LLMEngine: the loop. `add_request` validates and queues, `abort_request` frees a request at once,
and `step` is the step contract in order (backend/core/step.py): the scheduler plans
(`SchedulerOutput`), the model runner runs and samples (`ModelRunnerOutput`), the scheduler updates
request state from both (`update_from_output`: tokens appended, stop tokens and lengths checked,
finished requests freed), the output processor turns what was appended into client outputs (stop
strings end requests there). Nothing else lives here.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from concurrent import futures
from pathlib import Path

from backend.config import EngineConfig, generation_defaults, resolve_limits
from backend.core.kv_cache import KVCacheManager
from backend.lora import LoRARequest
from backend.engine.metrics import EngineMetrics
from backend.worker.model_loader import load_hf_config, resolve_device
from backend.model_paths import resolve_model_path
from backend.worker.model_runner import ModelRunner
from backend.engine.output_processor import ChildState, OutputProcessor, ParentRequest, make_output
from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.kv_events import KVEventPublisher
from backend.errors import CONTEXT_LENGTH_EXCEEDED, KV_CACHE_TOO_SMALL, EngineError, check
from backend.outputs import RequestOutput
from backend.core.request import Request, RequestStatus
from backend.sampling_params import SamplingParams
from backend.core.scheduler import Scheduler
from backend.core.step import SchedulerOutput
from backend.multimodal import ImageInput, ImageProcessor
from backend.engine.spec_decode import SpeculativeDecoder
from backend.sampling.structured_output import GrammarCompiler, RequestGrammar

logger = logging.getLogger(__name__)

QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)  # no blocks, nothing half-computed
GRAMMAR_POLL_S = 0.05  # an idle step waits this long at most for a grammar to compile


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def eos_token_ids(model_path: str, hf_config: dict) -> set[int]:
    ids = hf_config.get("eos_token_id")
    generation = Path(model_path) / "generation_config.json"
    if generation.is_file():
        ids = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id", ids)
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
        self.model_path = resolve_model_path(config.model, config.revision)
        hf_config = load_hf_config(self.model_path)
        self.model_name = config.served_model_name or Path(self.model_path).name
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or self.model_path)
        self.limits = resolve_limits(config, hf_config, resolve_device(config).type)
        self.max_model_len = self.limits.max_model_len
        max_batched = self.limits.max_num_batched_tokens
        self.runner = ModelRunner(config, self.model_path, hf_config, self.max_model_len)
        self.vocab_size = self.runner.args.vocab_size
        self.kv_events = KVEventPublisher.create(config.kv_events_config, config.block_size, self.runner.num_blocks)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size,
                                       config.enable_prefix_caching, self.runner.num_swap_blocks,
                                       sliding_window=self.limits.sliding_window,
                                       enable_kv_cache_events=self.kv_events is not None,
                                       num_tier_blocks=self.runner.num_tier_blocks)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, max_batched,
                                   config.enable_chunked_prefill, config.preemption_mode,
                                   config.scheduling_policy, config.max_loras if config.enable_lora else None,
                                   self.eos_token_ids, self.max_model_len,
                                   keep_images_whole=getattr(self.runner.args.vision, "bidirectional_images", False),
                                   lone_prefill_tokens=self.limits.lone_prefill_tokens)
        self.metrics = EngineMetrics(config.enable_lora, self.max_model_len)
        self.spec = None if config.speculative_config is None else SpeculativeDecoder(
            config, self.runner, self.kv_cache, self.metrics, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.compiling: dict[str, futures.Future] = {}  # requests queued while their grammar compiles
        self.output_processor = OutputProcessor(self.metrics)
        # Sampling defaults for requests that omit them (generation_config: auto, vLLM's default).
        self.generation_defaults = generation_defaults(config, self.model_path)
        vision = self.runner.args.vision
        self.image_processor = None if vision is None or config.skip_tokenizer_init else ImageProcessor(
            self.model_path, vision.image_token_id, vision.image_input, getattr(vision, "load_processor", None))
        self._update_gauges()  # vllm:lora_requests_info's labels from the start

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError("prompt", "text prompts need a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise EngineError("prompt", f"token ids must be integers in [0, {self.vocab_size})")
        return None, ids

    def process_prompt(self, prompt: dict) -> tuple[str | None, list[int], tuple[ImageInput, ...]]:
        """vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}, with
        "multi_modal_data": {"image": ...} beside a text prompt for a vision-language model."""
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        check(not unknown, "prompt", f"unknown keys {sorted(unknown)} (prompt, prompt_token_ids, multi_modal_data)")
        check(("prompt" in prompt) != ("prompt_token_ids" in prompt), "prompt",
              "give one of 'prompt' and 'prompt_token_ids'")
        if prompt.get("multi_modal_data") is None:
            return (*self.tokenize(prompt.get("prompt", prompt.get("prompt_token_ids"))), ())
        check(self.image_processor is not None, "multi_modal_data",
              f"{self.model_name} takes text only" if self.runner.args.vision is None else "needs a tokenizer")
        check(isinstance(prompt.get("prompt"), str), "multi_modal_data", "goes with a text prompt "
              "(the model's processor places each image's tokens)")
        prompt_ids, images = self.image_processor(prompt["prompt"], prompt["multi_modal_data"])
        return prompt["prompt"], prompt_ids, tuple(images)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences that spell each bad word as vLLM bans them: the word as given (without
        leading spaces), and with one leading space where that is a different first token and
        the same number of tokens (how a word usually appears mid-text)."""
        check(self.tokenizer is not None, "bad_words", "needs a tokenizer (skip_tokenizer_init is set)")
        sequences = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return [ids for ids in sequences if ids]

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    *, arrival_time: float | None = None, cache_salt: str | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; raises ValueError with a clear message if it can never run."""
        check(request_id not in self.output_processor.parents, "request_id", "is already in use", request_id)
        self.enqueue(self.process_request(request_id, prompt, params, arrival_time=arrival_time,
                                          cache_salt=cache_salt, priority=priority, lora_request=lora_request))

    def process_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                        *, arrival_time: float | None = None, cache_salt: str | None = None,
                        priority: int = 0, lora_request: LoRARequest | None = None) -> ParentRequest:
        """Tokenize and validate without touching engine state (safe from any thread)."""
        if lora_request is not None:
            check(isinstance(lora_request, LoRARequest), "lora_request", "must be a LoRARequest", lora_request)
            check(self.runner.lora is not None, "lora_request", "LoRA adapters need enable_lora")
            self.runner.lora.check(lora_request)
        params = copy.copy(params or SamplingParams())
        params.validate_for_model(self.vocab_size)
        check(isinstance(priority, int) and not isinstance(priority, bool), "priority", "must be an integer",
              priority)
        check(priority == 0 or self.config.scheduling_policy == "priority", "priority",
              "needs the engine's scheduling_policy priority (it is fcfs)", priority)
        images: tuple[ImageInput, ...] = ()
        if isinstance(prompt, dict):
            prompt_text, prompt_ids, images = self.process_prompt(prompt)
        else:
            prompt_text, prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise EngineError("prompt", "must not be empty")
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            check(keep <= self.max_model_len, "truncate_prompt_tokens",
                  f"must be at most max_model_len ({self.max_model_len}), or -1")
            check(not images or len(prompt_ids) <= keep, "truncate_prompt_tokens", "would cut a prompt with images")
            if len(prompt_ids) > keep:  # the prompt's last `keep` tokens, as vLLM keeps
                prompt_ids = prompt_ids[-keep:]
                prompt_text = None if prompt_text is None else self.tokenizer.decode(prompt_ids)
        if images and self.scheduler.keep_images_whole and self.config.enable_chunked_prefill:
            longest = max(image.length for image in images)
            check(longest <= self.limits.max_num_batched_tokens, "multi_modal_data",
                  f"an image takes {longest} tokens, which this model computes in one step; "
                  f"max_num_batched_tokens is {self.limits.max_num_batched_tokens}")
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        num_prompt = len(prompt_ids)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - num_prompt
        if num_prompt + params.max_tokens > self.max_model_len:
            raise EngineError(None, f"This model's maximum context length is {self.max_model_len} tokens; "
                              f"the request asks for {num_prompt + params.max_tokens} ({num_prompt} in the "
                              f"prompt, {params.max_tokens} max_tokens). Shorten the prompt or max_tokens.",
                              CONTEXT_LENGTH_EXCEEDED, max_model_len=self.max_model_len,
                              prompt_tokens=num_prompt, max_tokens=params.max_tokens)
        step = self.limits.lone_prefill_tokens if self.config.enable_chunked_prefill else None
        needed = self.kv_cache.most_blocks_held(num_prompt + params.max_tokens, step)
        if needed > self.kv_cache.num_usable_blocks:
            raise EngineError("max_tokens", f"the request needs {needed} KV-cache blocks but only "
                              f"{self.kv_cache.num_usable_blocks} exist; raise kv_cache_memory_bytes",
                              KV_CACHE_TOO_SMALL)
        params.all_stop_token_ids = self.eos_token_ids | set(params.stop_token_ids or ())
        # Checked now, compiled on the grammar pool: the request waits in the queue meanwhile.
        grammar = self.grammars.submit(params.structured_outputs) if params.structured_outputs else None
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
                              arrival_time=arrival_time, lora_request=lora_request, images=images)
            if grammar is not None:
                request.grammar = RequestGrammar(grammar)
            detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params)
            parent.children.append(ChildState(request, detokenizer))
        return parent

    def enqueue(self, parent: ParentRequest) -> None:
        check(parent.request_id not in self.output_processor.parents, "request_id", "is already in use",
              parent.request_id)
        self.output_processor.add(parent)
        for child in parent.children:
            self.scheduler.stamp_arrival(child.request)
        first = parent.children[0].request
        if first.grammar is not None and not first.grammar.is_ready():
            self.compiling[parent.request_id] = first.grammar.compiled
        self.scheduler.add_samples([child.request for child in parent.children])
        self._update_gauges()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason abort)."""
        parent = self._drop(request_id)
        if parent is None:
            return None
        self.output_processor.record_ended(parent)
        return make_output(parent, None)

    def _drop(self, request_id: str) -> ParentRequest | None:
        parent = self.output_processor.pop(request_id)
        if parent is None:
            return None
        self.compiling.pop(request_id, None)
        for child in parent.children:
            request = child.request
            if not request.is_finished:
                request.finish_reason = "abort"
                self._finish(request)
        self._update_gauges()
        return parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # -- what servers ask about their requests (AsyncLLMEngine) -------------------------------
    def request_ids(self) -> list[str]:
        return list(self.output_processor.parents)

    def prompt_token_ids(self, request_id: str) -> list[int] | None:
        parent = self.output_processor.parents.get(request_id)
        return None if parent is None else parent.prompt_token_ids

    def num_queued_samples(self) -> int:
        """Samples waiting for a run slot (held n > 1 samples and those whose grammar compiles too)."""
        return self.scheduler.num_queued

    def num_running_samples(self) -> int:
        return len(self.scheduler.running)

    def started_request_ids(self) -> list[str]:
        """Requests with a sample past the queue: running, or holding KV or swap blocks."""
        return [request_id for request_id, parent in self.output_processor.parents.items()
                if any(c.request.status not in QUEUED or c.request.block_table or c.request.swap_blocks
                       for c in parent.children)]

    def num_used_blocks(self) -> int:
        return self.kv_cache.num_blocks - self.kv_cache.num_free_blocks

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()
        self._publish_kv_events()  # now: no step may follow soon

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.kv_cache.take_events())

    def on_worker_failure(self, callback) -> None:
        """Call `callback(message)` when a tensor/pipeline-parallel rank dies."""
        self.runner.on_failure = callback

    # -- the loop --------------------------------------------------------------------------------
    def _warn_thread(self) -> None:
        """libgomp keeps one OpenMP thread team per thread that opens a parallel region. A model
        loaded on one thread and run on another makes two teams, more threads than CPUs, and then
        libgomp cuts its barrier spin from 300,000 to 100 iterations: every parallel region puts its
        threads to sleep and wakes them through the kernel (decode steps measurably slower:
        docs/benchmarks.md, "Measured reasons behind code choices")."""
        self._warned_thread = True
        if self.runner.device.type == "cpu":
            logger.warning("the engine was built on thread %r and steps on %r: build it on the thread "
                           "that runs it (two OpenMP thread teams slow every CPU step down)",
                           self.built_on.name, threading.current_thread().name)

    def step(self) -> list[RequestOutput]:
        if threading.current_thread() is not self.built_on and not self._warned_thread:
            self._warn_thread()
        outputs = self._fail_uncompiled_grammars()
        drafts = self.spec.propose(self.scheduler.running) if self.spec is not None else None
        scheduler_output = self.scheduler.schedule(drafts)
        self._count_admissions(scheduler_output)
        if scheduler_output.moves_to_host or scheduler_output.moves_to_device:
            self.runner.move_blocks(scheduler_output.moves_to_host, scheduler_output.moves_to_device)
        if scheduler_output.scheduled:
            runner_output = self.runner.execute_model(scheduler_output)
            if self.spec is not None:
                self.spec.count(scheduler_output, runner_output)
            update = self.scheduler.update_from_output(scheduler_output, runner_output)
            self.output_processor.append_prompt_logprobs(runner_output.prompt_scores)
            stopped = self.output_processor.append_tokens(update.appended)
            for request in update.finished:
                self._finished(request)
            for request in stopped:  # by a stop string, which only text shows
                if not request.is_finished:  # (its last token may have ended it already)
                    self._finish(request)
            outputs += self.output_processor.make_outputs(update.appended)
        elif self.compiling:
            futures.wait(self.compiling.values(), GRAMMAR_POLL_S, futures.FIRST_COMPLETED)
        self._publish_kv_events()
        self._update_gauges()
        return outputs

    def _fail_uncompiled_grammars(self) -> list[RequestOutput]:
        """Final outputs for queued requests whose grammar failed to compile or ran out of time."""
        outputs = []
        for request_id, compiled in list(self.compiling.items()):
            error = self.grammars.failure(compiled)
            if error is not None:
                parent = self._drop(request_id)
                outputs.append(self.output_processor.failed_output(parent, error))
            elif compiled.done():
                del self.compiling[request_id]
        return outputs

    def _count_admissions(self, plan: SchedulerOutput) -> None:
        registry, m = self.metrics.registry, self.metrics
        if plan.preempted:
            registry.inc(m.num_preemptions, len(plan.preempted))
        for request in plan.newly_admitted:
            if request.metrics.first_scheduled_time is None:  # not again after a preemption
                request.metrics.first_scheduled_time = time.time()
            device_hits = request.num_cached_tokens - request.num_tier_cached_tokens
            registry.inc(m.prefix_cache_queries, request.num_prompt_tokens)
            registry.inc(m.prefix_cache_hits, device_hits)
            if self.kv_cache.tier is not None:
                registry.inc(m.external_prefix_cache_queries, request.num_prompt_tokens - device_hits)
                registry.inc(m.external_prefix_cache_hits, request.num_tier_cached_tokens)

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        self._finished(request)

    def _finished(self, request: Request) -> None:
        if self.spec is not None:
            self.spec.finish(request)

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
        """Stop the grammar pool and the tensor/pipeline-parallel worker ranks, if any (idempotent)."""
        self.grammars.shutdown()
        self.runner.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
