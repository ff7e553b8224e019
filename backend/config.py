"""EngineConfig: the one place every engine knob is named, and the limits derived from it.

The field names are the `LLM(...)` keyword arguments, the `tritonllm serve --flags` (with dashes)
and the keys of the Triton model's `model.json`. Invalid values raise `EngineError` (a ValueError)
naming the field. The bottom of the import graph: nothing from `backend/` but `errors`, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from backend.errors import EngineError, check
from backend.lora import parse_lora_modules  # torch-free, like this module
from backend.vllm_args import NO_REMOTE_CODE, translate

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATION_METHODS = ("awq", "gptq", "fp8", "int8", "gguf")  # backend/quantization/
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; fp8 is E4M3


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={
        "help": "HF model folder, or a hub id (org/name) found in the local Hugging Face cache; "
                "default: the prepared SmolLM2"})
    revision: str | None = field(default=None, metadata={
        "help": "for a hub id: the cached snapshot of this branch, tag or commit (default: main)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "refused when true: no remote code runs here (vLLM's flag, accepted as false)"})
    generation_config: str = field(default="auto", metadata={
        "help": "auto: the model's generation_config.json sets the sampling defaults (temperature, "
                "top_p, top_k, min_p, repetition_penalty, max_tokens) of requests that omit them; "
                "vllm: vLLM's defaults; or a folder holding a generation_config.json"})
    # Given as JSON text or a dict; a dict (or None) once constructed.
    override_generation_config: dict | str | None = field(default=None, metadata={
        "help": "JSON object of sampling defaults laid over generation_config's, e.g. {\"temperature\": 0.5}"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder; default: the model's"})
    served_model_name: str | None = field(default=None, metadata={"help": "name reported to clients"})
    dtype: str = field(default="auto", metadata={"help": "auto = bfloat16 on CUDA and bf16-capable CPUs, else float32"})
    seed: int = field(default=0, metadata={"help": "seed for requests that set none"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    max_model_len: int | None = field(default=None, metadata={"help": "prompt + output limit; default: the model's"})
    max_num_seqs: int = field(default=256, metadata={"help": "requests running at once"})
    max_waiting_requests: int | None = field(default=1024, metadata={
        "help": "servers: requests (samples, for n > 1) queued for a slot before new ones are refused "
                "as overloaded; none: no limit (the offline LLM always queues everything)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens computed per step (default: 2048; 512 for a server on a CPU)"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV cache size in bytes; default on a CPU: room for max_num_seqs sequences of "
                "min(max_model_len, 2048) tokens, at most min(4 GiB, 1/4 of free RAM), resident from "
                "start-up; on a GPU: what gpu_memory_utilization leaves"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "share of GPU memory the engine may use"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of identical prefixes"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts across steps"})
    preemption_mode: str = field(default="recompute", metadata={"help": "recompute or swap"})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs, or priority (lower value first)"})
    stream_interval: int = field(default=1, metadata={
        "help": "streamed outputs every this many tokens (the first at once): fewer, larger messages, "
                "less host work per token"})
    swap_space: float = field(default=4.0, metadata={"help": "GiB of CPU swap space for preemption_mode=swap"})
    kv_offloading_size: float | None = field(default=None, metadata={
        "help": "GiB (across all ranks) of a second KV tier: prefix-cache blocks evicted from the KV "
                "cache are kept there (pinned host memory beside a GPU; on a CPU a file-backed mapping "
                "under $TMPDIR) and copied back on a prefix hit instead of recomputed; default: none"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "tensor-parallel workers"})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "pipeline-parallel stages"})
    nnodes: int = field(default=1, metadata={"help": "hosts the tensor x pipeline ranks span (multi-node)"})
    node_rank: int = field(default=0, metadata={"help": "this host's index among nnodes; 0 runs the engine"})
    master_addr: str | None = field(default=None, metadata={
        "help": "rendezvous host of rank 0 (default: $MASTER_ADDR, else 127.0.0.1)"})
    master_port: int | None = field(default=None, metadata={
        "help": "rendezvous port (default: $MASTER_PORT, else a free port when single-node)"})
    quantization: str | None = field(default=None, metadata={
        "help": "weights: awq, gptq (from such checkpoints), fp8, int8 (a float checkpoint quantized at load); "
                "default: the checkpoint's quantization_config (gguf for a .gguf model)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto (the activation dtype), fp8 or fp8_e4m3 (float8 E4M3), fp8_e5m2: 1 byte per element; "
                "per-layer k/v scales from the checkpoint (k_scale, v_scale), else 1.0"})
    # Given as JSON text or a dict; a SpeculativeConfig (or None) once constructed.
    speculative_config: SpeculativeConfig | dict | str | None = field(default=None, metadata={
        "help": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} or {\"method\": \"draft_model\", "
                "\"model\": PATH, \"num_speculative_tokens\": 4}"})
    # Given as JSON text or a dict; a KVEventsConfig (or None) once constructed.
    kv_events_config: KVEventsConfig | dict | str | None = field(default=None, metadata={
        "help": "publish KV-cache events (blocks stored, removed, all cleared) on ZMQ for routers, vLLM's "
                "JSON: {\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:5557\", "
                "\"replay_endpoint\": null, \"topic\": \"\"} (default endpoint: loopback only)"})
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters (peft format) on the base model"})
    max_loras: int = field(default=1, metadata={"help": "LoRA adapters held in the engine at once (one step mixes at most this many)"})
    max_lora_rank: int = field(default=16, metadata={"help": "the largest LoRA rank an adapter may have"})
    # Given in any form parse_lora_modules reads; {name: absolute path} (or None) once constructed.
    lora_modules: dict[str, str] | list | str | None = field(default=None, metadata={
        "help": "adapters served by name: name=path [name=path ...] (model.json: {\"name\": \"path\"})",
        "nargs": "+"})
    skip_tokenizer_init: bool = field(default=False, metadata={"help": "token ids in, token ids out"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})

    def __post_init__(self) -> None:
        def check_field(ok: bool, name: str, message: str) -> None:
            check(ok, name, message, value=getattr(self, name))

        check_field(not self.trust_remote_code, "trust_remote_code", NO_REMOTE_CODE)
        check_field(isinstance(self.generation_config, str) and bool(self.generation_config),
                    "generation_config", "must be auto, vllm or a folder")
        if self.override_generation_config is not None:
            self.override_generation_config = json_object_option(
                "override_generation_config", self.override_generation_config, list(GENERATION_DEFAULT_KEYS))
        check_field(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        check_field(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                    "block_size", "must be a positive power of two")
        check_field(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be positive")
        check_field(self.max_num_seqs > 0, "max_num_seqs", "must be positive")
        check_field(self.stream_interval >= 1, "stream_interval", "must be at least 1")
        check_field(self.max_waiting_requests is None or self.max_waiting_requests > 0,
                    "max_waiting_requests", "must be positive, or none for no limit")
        check_field(self.max_num_batched_tokens is None or self.max_num_batched_tokens > 0,
                    "max_num_batched_tokens", "must be positive")
        check_field(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                    "kv_cache_memory_bytes", "must be positive")
        check_field(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        check_field(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
                    f"must be one of {', '.join(PREEMPTION_MODES)}")
        check_field(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
                    f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        check_field(self.swap_space >= 0, "swap_space", "must not be negative")
        check_field(self.kv_offloading_size is None or self.kv_offloading_size >= 0, "kv_offloading_size",
                    "must not be negative")
        check_field(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        check_field(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be at least 1")
        check_field(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        check_field(self.quantization is None or self.quantization in QUANTIZATION_METHODS, "quantization",
                    f"must be one of {', '.join(QUANTIZATION_METHODS)}")
        check_field(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        check_field(self.nnodes >= 1, "nnodes", "must be at least 1")
        check_field(0 <= self.node_rank < self.nnodes, "node_rank", "must be in [0, nnodes)")
        world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        check_field(world_size % self.nnodes == 0, "nnodes",
                    f"must divide tensor_parallel_size x pipeline_parallel_size ({world_size})")
        check_field(self.max_loras >= 1, "max_loras", "must be at least 1")
        check_field(1 <= self.max_lora_rank <= 512, "max_lora_rank", "must be in [1, 512]")
        self.lora_modules = parse_lora_modules(self.lora_modules) or None
        check_field(self.enable_lora or not self.lora_modules, "lora_modules", "needs enable_lora")
        check_field(not self.enable_lora or world_size == 1, "enable_lora",
                    "runs without tensor/pipeline parallelism for now")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)  # before anything starts
            check_field(self.speculative_config.method != "draft_model" or world_size == 1, "speculative_config",
                        "method draft_model runs without tensor/pipeline parallelism; use method ngram there")
        if self.kv_events_config is not None:
            self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        """Build from model.json-style keys, ours or vLLM's (backend/vllm_args.py: those with nothing
        to do here are logged and ignored, those we cannot honour refused); strings are cast to the
        field's type."""
        known = {f.name: f for f in fields(cls)}
        values, notes = translate(values, set(known))
        for note in notes:
            logger.warning("engine argument %s", note)
        return cls(**{name: cast_value(name, str(known[name].type), value) for name, value in values.items()})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the sub-configs as dicts) that `from_dict` reads back into this config."""
        return dataclasses.asdict(self)


def cast_value(name: str, type_name: str, value: Any) -> Any:
    """Cast a JSON or CLI value to a dataclass field's annotated type (given as a string)."""
    if value is None or not isinstance(value, str) or type_name.startswith("str"):
        if type_name.startswith("bool") and not isinstance(value, (bool, type(None))):
            raise EngineError(name, "expected a boolean", value=value)
        return value
    text = value.strip()
    if "None" in type_name and text.lower() in ("", "none", "null"):
        return None
    try:
        if type_name.startswith("bool"):
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if type_name.startswith("int"):
            return int(text)
        if type_name.startswith("float"):
            return float(text)
    except ValueError:
        raise EngineError(name, f"cannot read {value!r} as {type_name.split(' ')[0]}") from None
    return value


def json_object_option(name: str, value: Any, known: list[str]) -> dict:
    """An option given as a dict or its JSON text (CLI, model.json, sampling_parameters), with only
    known keys; clear errors naming the option otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise EngineError(name, f"not valid JSON ({error})") from None
    check(isinstance(value, dict), name, f"must be a JSON object, got {value!r:.80}")
    unknown = sorted(set(value) - set(known))
    check(not unknown, name, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return value


# generation_config.json keys that become sampling defaults (vLLM's list), and their SamplingParams names.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
                           "max_tokens": "max_tokens"}


def generation_defaults(config: EngineConfig, model_path: str) -> dict[str, Any]:
    """The sampling defaults for requests that omit them (SamplingParams names): the model's
    generation_config.json under `generation_config: auto` (or the given folder's), none under
    `vllm`, then `override_generation_config` on top."""
    defaults: dict[str, Any] = {}
    if config.generation_config != "vllm":
        folder = model_path if config.generation_config == "auto" else os.path.expanduser(config.generation_config)
        path = os.path.join(folder, "generation_config.json")
        check(config.generation_config == "auto" or os.path.isfile(path), "generation_config",
              f"no generation_config.json in {folder}")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as file:
                values = json.load(file)
            defaults = {GENERATION_DEFAULT_KEYS[k]: v for k, v in values.items()
                        if k in GENERATION_DEFAULT_KEYS and v is not None}
    overrides = config.override_generation_config or {}
    assert isinstance(overrides, dict)  # parsed in __post_init__
    for key, value in overrides.items():
        defaults[GENERATION_DEFAULT_KEYS[key]] = value
    return defaults


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` in vLLM's shape, parsed once from its JSON text or dict (EngineConfig holds
    the result): defaults filled in, so that every consumer reads the fields as they are."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: the longest suffix looked up
    prompt_lookup_min: int | None = None  # ngram: the shortest
    model: str | None = None  # draft_model: its Hugging Face folder

    @classmethod
    def parse(cls, value: "SpeculativeConfig | str | dict") -> "SpeculativeConfig":
        if isinstance(value, cls):  # parsed already (dataclasses.replace re-runs EngineConfig's checks)
            return value

        def require(ok: bool, message: str) -> None:
            check(ok, "speculative_config", message)

        value = json_object_option("speculative_config", value, [f.name for f in fields(cls)])
        values = dict(value)
        if values.get("method") is None:  # vLLM infers the method from a draft model's path
            values["method"] = "draft_model" if values.get("model") else None
        require(values["method"] in SPECULATIVE_METHODS,
                f"method must be one of {', '.join(SPECULATIVE_METHODS)} (got {values['method']!r})")

        def positive(name: str) -> None:
            number = values.get(name)
            require(not isinstance(number, bool) and isinstance(number, int) and number >= 1,
                    f"{name} must be a positive integer (got {number!r})")

        positive("num_speculative_tokens")
        if values["method"] == "ngram":
            require(values.get("model") is None, "model is for method draft_model, not ngram")
            low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if values.get(name) is not None:
                    positive(name)
            if low is None and high is None:
                low = high = 5  # vLLM's default
            values["prompt_lookup_min"] = high if low is None else low
            values["prompt_lookup_max"] = low if high is None else high
            require(values["prompt_lookup_min"] <= values["prompt_lookup_max"],
                    f"prompt_lookup_min ({values['prompt_lookup_min']}) must not exceed "
                    f"prompt_lookup_max ({values['prompt_lookup_max']})")
        else:
            require(isinstance(values.get("model"), str) and bool(values["model"]),
                    "method draft_model needs model, the draft model's folder")
            lookup = [k for k in ("prompt_lookup_min", "prompt_lookup_max") if values.get(k) is not None]
            require(not lookup, f"{', '.join(lookup)} is for method ngram, not draft_model")
        return cls(**values)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults, but for `endpoint`: vLLM's `tcp://*:5557` listens
    on every interface, ours on this machine only unless the operator names another address."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: zmq when events are enabled
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket: past it, slow subscribers lose messages
    max_queue_size: int = 100_000  # batches waiting for the publishing thread; past it, new ones are dropped
    topic: str = ""

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str) -> KVEventsConfig:
        if isinstance(value, cls):
            return value
        values = json_object_option("kv_events_config", value, [f.name for f in fields(cls)])
        config = cls(**values)
        check(isinstance(config.enable_kv_cache_events, bool), "kv_events_config", "enable_kv_cache_events must be true or false")
        check(isinstance(config.topic, str), "kv_events_config", "topic must be a string")
        publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
        check(publisher in ("zmq", "null"), "kv_events_config", f"publisher must be zmq or null, got {publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            number = getattr(config, name)
            check(isinstance(number, int) and not isinstance(number, bool) and number > 0, "kv_events_config",
                  f"{name} must be a positive integer, got {number!r}")
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(config, name)
            check(address is None or (isinstance(address, str) and address.startswith(("tcp://", "ipc://", "inproc://"))),
                  "kv_events_config", f"{name} must be a tcp://, ipc:// or inproc:// address, got {address!r}")
        return cls(**{**values, "publisher": publisher})

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass(frozen=True)
class EngineLimits:
    """The limits derived from the config and the model's config.json, resolved once
    (`resolve_limits`) and used by the engine, the scheduler and the runner alike."""
    max_model_len: int  # prompt + output tokens of one request
    max_num_batched_tokens: int  # tokens computed per step
    sliding_window: int | None  # the window when every layer slides (KV blocks behind it are freed), else None
    lone_prefill_tokens: int  # the most a step computing one prompt alone takes (LARGE_STEP_TOKENS)


# The step budget when max_num_batched_tokens is not given, with chunked prefill: on a CPU a
# smaller step gives the first of several prompts arriving together their first token sooner at
# little cost to throughput (a step's fixed cost, reading the weights once, is a few percent of a
# 512-token prefill there); docs/benchmarks.md, "The step budget on a CPU".
DEFAULT_STEP_TOKENS = {"cpu": 512, "cuda": 2048}
# A step whose size no one's first token waits on takes up to this many: every step of the offline
# LLM (`LLM(...)`, whose caller waits for whole batches; vLLM's LLM class too takes more than its
# server), and, where the budget is the default, a server's step that computes one prompt's chunk
# and nothing else (no decodes, no other prompts: the queue waits behind that prompt's chunks either
# way). On an AMX host 512 a step cost long prompts offline 11% of their throughput and 30% of their
# TTFT, short ones 7-10% (oneDNN splits the linears' work badly between two threads at 384-1,024
# rows), and a lone 8,000-token prompt 5.45 against 4.56 s to its first token; 4,096 gained nothing
# more (docs/benchmarks.md, "Long prompts on AMX"). On a GPU it is the default step.
LARGE_STEP_TOKENS = 2048


def max_step_tokens(config: EngineConfig, max_model_len: int, device_type: str) -> int:
    """The most tokens one step computes (the engine's max_num_batched_tokens default) on a
    device of this type ("cpu" or "cuda")."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    default = DEFAULT_STEP_TOKENS.get(device_type, 2048)
    return default if config.enable_chunked_prefill else max(default, max_model_len)


# Families whose config.json, without `layer_types`, means a window on every layer.
ALL_SLIDING_MODEL_TYPES = {"mistral", "mixtral", "phi3", "starcoder2"}


def all_layers_window(hf_config: dict) -> int | None:
    """The sliding window when every layer attends through it (Mistral), else None: full
    attention, or only some layers sliding (Gemma 2 and 3, Qwen2's max_window_layers), where
    the global layers still need every block."""
    window = hf_config.get("sliding_window")
    if not window or hf_config.get("use_sliding_window") is False:
        return None
    layer_types = hf_config.get("layer_types")
    if layer_types:
        return window if all(t == "sliding_attention" for t in layer_types) else None
    return window if hf_config.get("model_type") in ALL_SLIDING_MODEL_TYPES else None


def resolve_limits(config: EngineConfig, hf_config: dict, device_type: str) -> EngineLimits:
    """max_model_len (the config's, else the model's), the step token budget (its default
    depends on `device_type`, "cpu" or "cuda"), a lone prompt's step and the sliding
    window of a model whose layers all slide. The attention kernels take windows, so the context
    is not capped at the window. A vision-language model's come from its decoder's `text_config`."""
    text = {**hf_config, **hf_config.get("text_config", {})}
    model_limit = text.get("max_position_embeddings", 2048)
    window = all_layers_window(text)
    check(config.max_model_len is None or config.max_model_len <= model_limit, "max_model_len",
          f"{config.max_model_len} exceeds the model's max_position_embeddings ({model_limit})")
    max_model_len = config.max_model_len or model_limit
    max_batched = max_step_tokens(config, max_model_len, device_type)
    check(config.enable_chunked_prefill or max_batched >= max_model_len, "max_num_batched_tokens",
          f"{max_batched} is smaller than max_model_len ({max_model_len}) while chunked prefill is off")
    default_budget = config.max_num_batched_tokens is None and config.enable_chunked_prefill
    lone = max(max_batched, LARGE_STEP_TOKENS) if default_budget else max_batched
    return EngineLimits(max_model_len, max_batched, window, lone)
