"""vLLM's engine argument names, and what each means here: a `model.json` written for Triton's vLLM
backend (or a `vllm serve` command line) loads unchanged.

Every name of vLLM's `EngineArgs` / `AsyncEngineArgs` (the union over its recent releases) is in
one of three places: an `EngineConfig` field of the same name (backend/config.py), or this table as
an alias (a vLLM spelling of one of our values), as accepted-and-ignored (it tunes something this
engine does not have: CUDA graphs are ours to decide, there is no Ray, no multimodal model...; the
engine logs that it ignored it), or as honoured only at its default (a value asking for something
we cannot do is refused with the reason: remote code, other tasks than generation, data
parallelism inside one engine, ...). Nothing from `backend/` but `errors`: config.py imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from backend.errors import EngineError


@dataclass(frozen=True)
class VllmArg:
    """How one vLLM engine argument is taken: `target` (our field it sets, through `convert`), or
    ignored with `reason`; `accepts(value)` false means the value is refused with `reason`."""
    reason: str
    target: str | None = None
    convert: Callable[[Any], Any] = lambda value: value
    accepts: Callable[[Any], bool] = lambda value: True


def ignored(reason: str) -> VllmArg:
    return VllmArg(reason)


def unset(value: Any) -> bool:
    """vLLM's defaults for the arguments refused when set: None, False, 0, "", {}, []."""
    return value in (None, False, 0, "", "none", "None", "false", "False", "0") or value == {} or value == []


def default_only(reason: str, accepts: Callable[[Any], bool] = unset) -> VllmArg:
    return VllmArg(reason, accepts=accepts)


def one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


def at_most_one(value: Any) -> bool:
    try:
        return value is None or int(value) <= 1
    except (TypeError, ValueError):
        return False


DTYPE_ALIASES = {"half": "float16", "float": "float32", "bfloat": "bfloat16"}
NO_REMOTE_CODE = "no remote code runs here: architectures are tritonllm's own (backend/models/)"
MULTIMODAL = ("tunes vLLM's own multimodal processor, its caches or its encoder; tritonllm runs transformers' "
              "processor per request and schedules an image's tokens with the prompt (docs/openai.md, Images)")
MEDIA_FLAG = "the OpenAI frontend's flag: it reads the images (`tritonllm serve` passes it there; docs/openai.md)"
CUDA_GRAPHS = "the engine decides CUDA-graph capture itself (backend/worker/cuda_graphs.py); nothing to do on a CPU"
NO_RAY = "one engine process with its own workers (backend/worker/distributed.py); no Ray, no executor choice"
LOGGING = "the engine logs no periodic stats or requests; metrics are on Triton's metrics port"
LORA = "LoRA adapters are served (enable_lora, max_loras, max_lora_rank, lora_modules); this setting has no counterpart"
SPECULATIVE = "give speculative_config (vLLM's JSON) instead of the older separate arguments"
DATA_PARALLEL = ("one engine per Triton model instance: scale out with replicas behind the OpenAI "
                 "frontend's router (`tritonllm serve --no-frontend` on each, docs/deploy.md)")
MODEL_CHANGES = "the model is run as its checkpoint defines it; overrides of its config are not applied"

VLLM_ENGINE_ARGS: dict[str, VllmArg] = {
    # -- vLLM spellings of our values
    "dtype": VllmArg("vLLM's dtype aliases", target="dtype",
                     convert=lambda value: DTYPE_ALIASES.get(value, value)),
    "served_model_name": VllmArg("vLLM takes a list; the first name is the one reported", target="served_model_name",
                                 convert=lambda value: value[0] if isinstance(value, list) and value else value),
    # -- accepted, with nothing to do here
    "enforce_eager": ignored(CUDA_GRAPHS),
    "max_seq_len_to_capture": ignored(CUDA_GRAPHS),
    "cuda_graph_sizes": ignored(CUDA_GRAPHS),
    "compilation_config": ignored(CUDA_GRAPHS),
    "disable_custom_all_reduce": ignored("tensor parallelism uses torch.distributed's all-reduce"),
    "distributed_executor_backend": ignored(NO_RAY),
    "ray_workers_use_nsight": ignored(NO_RAY),
    "worker_use_ray": ignored(NO_RAY),
    "engine_use_ray": ignored(NO_RAY),
    "disable_log_stats": ignored(LOGGING),
    "disable_log_requests": ignored(LOGGING),
    "enable_log_requests": ignored(LOGGING),
    "aggregate_engine_logging": ignored(LOGGING),
    "max_log_len": ignored(LOGGING),
    "show_hidden_metrics_for_version": ignored("every metric the engine has is always shown"),
    "download_dir": ignored("nothing is downloaded: models come from folders or the local Hugging Face cache"),
    "hf_token": ignored("nothing is downloaded: models come from folders or the local Hugging Face cache"),
    "ignore_patterns": ignored("the loader reads only the files it needs"),
    "safetensors_load_strategy": ignored("the loader memory-maps safetensors files"),
    "use_tqdm_on_load": ignored("loading shows no progress bar"),
    "pt_load_map_location": ignored("weights load where the engine's device is"),
    "max_parallel_loading_workers": ignored("one loader per worker"),
    "model_loader_extra_config": ignored("the loader has no extra settings"),
    "config_format": ignored("configs are read as Hugging Face config.json (or from a .gguf file)"),
    "model_impl": ignored("models are tritonllm's own implementations (backend/models/)"),
    "use_v2_block_manager": ignored("the KV-cache manager is the engine's own (backend/core/kv_cache.py)"),
    "num_lookahead_slots": ignored("speculative decoding reserves its own slots"),
    "num_scheduler_steps": ignored("one scheduling decision per step"),
    "multi_step_stream_outputs": ignored("one scheduling decision per step"),
    "scheduler_delay_factor": ignored("the scheduler never delays a prompt"),
    "disable_async_output_proc": ignored("outputs are processed on the engine's thread"),
    "async_scheduling": ignored("the engine schedules one step after the other"),
    "disable_cascade_attn": ignored("attention has no cascade path"),
    "prefix_caching_hash_algo": ignored("prefix blocks are matched by hash and confirmed by token ids"),
    "disable_sliding_window": ignored("full attention capped at the model's window, as this setting does in vLLM"),
    "disable_hybrid_kv_cache_manager": ignored("one KV-cache manager for one attention type"),
    "kv_sharing_fast_prefill": ignored("no cross-layer KV sharing here"),
    "max_num_partial_prefills": ignored("chunked prefill schedules by the token budget alone"),
    "max_long_partial_prefills": ignored("chunked prefill schedules by the token budget alone"),
    "long_prefill_token_threshold": ignored("chunked prefill schedules by the token budget alone"),
    "disable_chunked_mm_input": ignored(MULTIMODAL),
    "max_logprobs": ignored("requests may ask for up to 20 logprobs (OpenAI's limit)"),
    "logprobs_mode": default_only("logprobs are the model's raw log-softmax (vLLM's raw_logprobs)",
                                  one_of("raw_logprobs")),
    "guided_decoding_backend": ignored("structured outputs always compile with xgrammar"),
    "guided_decoding_disable_fallback": ignored("structured outputs always compile with xgrammar"),
    "guided_decoding_disable_any_whitespace": ignored(
        "set disable_any_whitespace in a request's structured_outputs instead"),
    "guided_decoding_disable_additional_properties": ignored("structured outputs always compile with xgrammar"),
    "structured_outputs_config": ignored("structured outputs always compile with xgrammar"),
    "enable_sleep_mode": ignored("the engine has no sleep mode; unload the Triton model to free memory"),
    "calculate_kv_scales": ignored("the fp8 KV cache uses the checkpoint's k/v scales, else 1.0"),
    "tokenizer_pool_size": ignored("tokenizing happens on the requests' threads"),
    "tokenizer_pool_type": ignored("tokenizing happens on the requests' threads"),
    "tokenizer_pool_extra_config": ignored("tokenizing happens on the requests' threads"),
    "otlp_traces_endpoint": ignored("the engine exports no OpenTelemetry traces; Triton's --trace-config traces requests"),
    "collect_detailed_traces": ignored("the engine exports no OpenTelemetry traces"),
    "collect_model_forward_time": ignored("the engine exports no OpenTelemetry traces"),
    "collect_model_execute_time": ignored("the engine exports no OpenTelemetry traces"),
    "additional_config": ignored("no platform plugins here"),
    "override_neuron_config": ignored("no Neuron devices here"),
    "pooler_config": ignored("generation only: there is no pooler"),
    "override_pooler_config": ignored("generation only: there is no pooler"),
    "mamba_cache_dtype": ignored("no Mamba models here"),
    "mamba_ssm_cache_dtype": ignored("no Mamba models here"),
    "enable_expert_parallel": ignored("no mixture-of-experts models here"),
    "enable_eplb": ignored("no mixture-of-experts models here"),
    "eplb_config": ignored("no mixture-of-experts models here"),
    "num_redundant_experts": ignored("no mixture-of-experts models here"),
    "eplb_window_size": ignored("no mixture-of-experts models here"),
    "eplb_step_interval": ignored("no mixture-of-experts models here"),
    "eplb_log_balancedness": ignored("no mixture-of-experts models here"),
    "all2all_backend": ignored("no mixture-of-experts models here"),
    "enable_dbo": ignored("no mixture-of-experts models here"),
    "dbo_decode_token_threshold": ignored("no mixture-of-experts models here"),
    "dbo_prefill_token_threshold": ignored("no mixture-of-experts models here"),
    "limit_mm_per_prompt": ignored(MEDIA_FLAG),
    "interleave_mm_strings": ignored(MULTIMODAL),
    "media_io_kwargs": ignored(MULTIMODAL),
    "mm_processor_kwargs": ignored(MULTIMODAL),
    "disable_mm_preprocessor_cache": ignored(MULTIMODAL),
    "mm_processor_cache_gb": ignored(MULTIMODAL),
    "mm_processor_cache_type": ignored(MULTIMODAL),
    "mm_shm_cache_max_object_size_mb": ignored(MULTIMODAL),
    "mm_encoder_tp_mode": ignored(MULTIMODAL),
    "skip_mm_profiling": ignored(MULTIMODAL),
    "video_pruning_rate": ignored(MULTIMODAL),
    "allowed_local_media_path": ignored(MEDIA_FLAG),
    "allowed_media_domains": ignored(MEDIA_FLAG),
    "enable_multimodal_encoder_data_parallel": ignored(MULTIMODAL),
    "io_processor_plugin": ignored("no plugins here"),
    "data_parallel_rank": ignored(DATA_PARALLEL),
    "data_parallel_start_rank": ignored(DATA_PARALLEL),
    "data_parallel_size_local": ignored(DATA_PARALLEL),
    "data_parallel_address": ignored(DATA_PARALLEL),
    "data_parallel_rpc_port": ignored(DATA_PARALLEL),
    "data_parallel_backend": ignored(DATA_PARALLEL),
    "data_parallel_hybrid_lb": ignored(DATA_PARALLEL),
    "data_parallel_external_lb": ignored(DATA_PARALLEL),
    "max_cpu_loras": ignored(LORA),
    "lora_dtype": ignored(LORA),
    "lora_extra_vocab_size": ignored(LORA),
    "fully_sharded_loras": ignored(LORA),
    "long_lora_scaling_factors": ignored(LORA),
    # -- honoured at their defaults only; any other value asks for what we cannot do
    "trust_remote_code": default_only(NO_REMOTE_CODE),
    "code_revision": default_only(NO_REMOTE_CODE),
    "tokenizer_revision": default_only("give the tokenizer's folder (tokenizer) or the model's revision"),
    "tokenizer_mode": default_only("Hugging Face tokenizers only (fast when the model has one)",
                                   one_of("auto", "hf", "slow")),
    "load_format": default_only("weights load from safetensors (or a .gguf model file)",
                                one_of("auto", "safetensors", "gguf")),
    "task": default_only("text generation only", one_of("auto", "generate")),
    "runner": default_only("text generation only", one_of("auto", "generate")),
    "convert": default_only("text generation only", one_of("auto", "none")),
    "enable_prompt_embeds": default_only("prompts are text or token ids, not embeddings"),
    "data_parallel_size": default_only(DATA_PARALLEL, at_most_one),
    "decode_context_parallel_size": default_only("no context parallelism here", at_most_one),
    "cpu_offload_gb": default_only("weights stay on the engine's device; no CPU offload"),
    "num_gpu_blocks_override": default_only("size the KV cache with kv_cache_memory_bytes"),
    "kv_cache_memory": default_only("size the KV cache with kv_cache_memory_bytes"),
    "hf_config_path": default_only(MODEL_CHANGES),
    "hf_overrides": default_only(MODEL_CHANGES),
    "rope_scaling": default_only(MODEL_CHANGES),
    "rope_theta": default_only(MODEL_CHANGES),
    "override_attention_dtype": default_only(MODEL_CHANGES),
    "enable_lora_bias": default_only(LORA),
    "default_mm_loras": default_only(LORA),
    "qlora_adapter_name_or_path": default_only(LORA),
    "enable_prompt_adapter": default_only("prompt adapters are not served by this engine"),
    "max_prompt_adapters": ignored("prompt adapters are not served by this engine"),
    "max_prompt_adapter_token": ignored("prompt adapters are not served by this engine"),
    "speculative_model": default_only(SPECULATIVE),
    "num_speculative_tokens": default_only(SPECULATIVE),
    "speculative_draft_tensor_parallel_size": default_only(SPECULATIVE),
    "ngram_prompt_lookup_max": default_only(SPECULATIVE),
    "ngram_prompt_lookup_min": default_only(SPECULATIVE),
    "kv_transfer_config": default_only("no disaggregated prefill / KV transfer here"),
    "scheduler_cls": default_only(NO_REMOTE_CODE + "; the scheduler is backend/core/scheduler.py",
                                  one_of("vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler")),
    "worker_cls": default_only(NO_REMOTE_CODE, one_of("auto")),
    "worker_extension_cls": default_only(NO_REMOTE_CODE),
    "logits_processor_pattern": default_only(NO_REMOTE_CODE),
    "logits_processors": default_only(NO_REMOTE_CODE),
    "reasoning_parser": default_only("reasoning is split from the output by the OpenAI frontend "
                                      "(tritonllm serve --reasoning-parser), not by the model"),
}

# vLLM's EngineArgs / AsyncEngineArgs field names that are EngineConfig fields of the same name and
# meaning (config.py checks each value); listed so that tests can walk vLLM's whole list.
SAME_NAME = ("model", "tokenizer", "skip_tokenizer_init", "revision", "seed", "max_model_len",
             "pipeline_parallel_size", "tensor_parallel_size", "block_size", "enable_prefix_caching",
             "swap_space", "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_batched_tokens",
             "max_num_seqs", "quantization", "kv_cache_dtype", "device", "preemption_mode",
             "enable_chunked_prefill", "speculative_config", "scheduling_policy", "generation_config",
             "override_generation_config", "stream_interval", "nnodes", "node_rank", "master_addr",
             "master_port", "enable_lora", "max_loras", "max_lora_rank", "kv_events_config")


def translate(values: dict[str, Any], own_fields: set[str]) -> tuple[dict[str, Any], list[str]]:
    """model.json-style keys -> (our fields' values, notes on what was ignored). An unknown name, or
    a vLLM value we cannot honour, raises EngineError naming it and saying why."""
    ours, notes, unknown = {}, [], []
    for name, value in values.items():
        arg = VLLM_ENGINE_ARGS.get(name)
        if arg is None or (name in own_fields and arg.target is None):
            if name in own_fields:
                ours[name] = value
            else:
                unknown.append(name)
        elif not arg.accepts(value):
            raise EngineError(name, f"{value!r} is not supported: {arg.reason}")
        elif arg.target is not None:
            ours[arg.target] = arg.convert(value)
        else:
            notes.append(f"{name}={value!r} ignored: {arg.reason}")
    if unknown:
        raise EngineError(None, f"unknown engine argument(s): {', '.join(sorted(unknown))} (neither "
                                "tritonllm's nor vLLM's)")
    return ours, notes
