"""ModelRunner: loads the model and its KV cache, and turns a scheduled step into logits.

A step arrives as (request, number of new tokens) pairs. The runner lays the tokens out flat
(decodes first, then prefill chunks), builds positions, the slot mapping and block tables, runs the
model and returns float32 logits for each request whose step reaches its last known token.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from backend.attention import AttentionMetadata, PrefillSpan
from backend.config import EngineConfig
from backend.models.llama import LlamaArgs, LlamaForCausalLM
from backend.request import Request

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def load_hf_config(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: {model_path!r} is not a Hugging Face model folder (no config.json)")
    config = json.loads(path.read_text())
    architectures = set(config.get("architectures") or [])
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: architecture {sorted(architectures)} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    return config


def iterate_safetensors(model_path: str):
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors files in {model_path!r} (pickle checkpoints are never loaded)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, hf_config: dict,
                 max_model_len: int) -> None:
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.args = LlamaArgs.from_hf_config(hf_config)
        with torch.device("meta"):
            model = LlamaForCausalLM(self.args)
        model = model.to_empty(device=self.device)
        model.post_init()
        model.load_weights(iterate_safetensors(model_path))
        self.model = model.to(self.dtype).eval()
        self.num_blocks = self._num_blocks()
        shape = (2, self.args.num_kv_heads, self.num_blocks, self.block_size, self.args.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.args.num_layers)]
        # Swap space for preemption_mode="swap": host memory (pinned when the cache is on a GPU).
        self.num_swap_blocks = 0
        self.swap_caches: list[torch.Tensor] = []
        if config.preemption_mode == "swap":
            self.num_swap_blocks = int(config.swap_space * (1 << 30)) // self.block_bytes
            swap_shape = (2, self.args.num_kv_heads, self.num_swap_blocks, self.block_size, self.args.head_dim)
            pin = self.device.type == "cuda"
            self.swap_caches = [torch.zeros(swap_shape, dtype=self.dtype, pin_memory=pin)
                                for _ in range(self.args.num_layers)]
        self.cuda_graphs = None
        if self.device.type == "cuda":
            from backend.cuda_graphs import CudaGraphs  # GPU only: never imported on the CPU

            self.cuda_graphs = CudaGraphs(self.model, self.kv_caches, cuda_graph_batch_sizes(config.max_num_seqs),
                                          -(-max_model_len // self.block_size))
        logger.info("model %s on %s in %s; KV cache %d blocks of %d tokens", model_path,
                    self.device, self.dtype, self.num_blocks, self.block_size)

    @property
    def block_bytes(self) -> int:
        element = torch.finfo(self.dtype).bits // 8
        return (2 * self.args.num_layers * self.block_size * self.args.num_kv_heads
                * self.args.head_dim * element)

    def _num_blocks(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            from backend.cuda_graphs import profile_step_memory

            peak = profile_step_memory(self.model, self.args, self.dtype, self.device, self.block_size,
                                       profile_sequence_lengths(max_step_tokens(self.config, self.max_model_len),
                                                                self.max_model_len),
                                       self.config.max_num_seqs)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = gpu_kv_cache_budget(total, free, peak, self.config.gpu_memory_utilization)
        else:
            budget = min(4 << 30, available_memory_bytes() // 4)
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            knob = ("gpu_memory_utilization" if self.device.type == "cuda"
                    and self.config.kv_cache_memory_bytes is None else "kv_cache_memory_bytes")
            raise ValueError(f"{knob}: leaves {budget} bytes for the KV cache, which hold no block "
                             f"(one block takes {self.block_bytes} bytes)")
        return int(num_blocks)

    @torch.inference_mode()
    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy preempted blocks to swap space, then resumed ones back (in that order: a block
        swapped out may be handed to a resumed request in the same step)."""
        for pairs, to_swap in ((swap_out, True), (swap_in, False)):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs])
            dst = torch.tensor([p[1] for p in pairs])
            for cache, swap in zip(self.kv_caches, self.swap_caches):
                source, target = (cache, swap) if to_swap else (swap, cache)
                blocks = source.index_select(2, src.to(source.device)).to(target.device, non_blocking=True)
                target.index_copy_(2, dst.to(target.device), blocks)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        """Run one step. Returns logits [num_sampled, vocab] and the requests they belong to."""
        decodes = [(r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens > 0]
        prefills = [(r, n) for r, n in scheduled if not (n == 1 and r.num_computed_tokens > 0)]
        input_ids, positions, meta = self._prepare(decodes, prefills)
        if self.cuda_graphs is not None and not prefills and self.cuda_graphs.fits(len(decodes)):
            hidden = self.cuda_graphs.replay(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # Only a request whose step reaches its last known token samples the next one.
        sample_rows, sample_requests = [], []
        offset = 0
        for request, n in decodes + prefills:
            offset += n
            if request.num_computed_tokens + n == request.num_tokens:
                sample_rows.append(offset - 1)
                sample_requests.append(request)
        if not sample_rows:
            return torch.empty(0, self.args.vocab_size), []
        rows = torch.tensor(sample_rows, device=self.device)
        return self.model.compute_logits(hidden[rows]).cpu(), sample_requests

    def _prepare(self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step as flat tensors: token ids, positions and the attention metadata."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for request, n in decodes + prefills:
            start = request.num_computed_tokens
            input_ids.extend(request.all_token_ids[start:start + n])
            table = request.block_table
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)

        def tables(requests: list[Request], lens: list[int]) -> torch.Tensor:
            """Each request's blocks covering its length, padded with block 0 to the longest."""
            width = -(-max(lens, default=0) // block_size)
            rows = [r.block_table[:width] + [0] * (width - len(r.block_table[:width])) for r in requests]
            return torch.tensor(rows, dtype=torch.int32).view(len(requests), width).to(self.device)

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        decode_lens = [r.num_computed_tokens + 1 for r, _ in decodes]
        prefill_lens = [r.num_computed_tokens + n for r, n in prefills]
        prefill_tables = tables([r for r, _ in prefills], prefill_lens)
        spans, query_starts = [], [0]
        offset = len(decodes)
        for i, ((request, n), context_len) in enumerate(zip(prefills, prefill_lens)):
            spans.append(PrefillSpan(offset, n, context_len, prefill_tables[i, :-(-context_len // block_size)]))
            offset += n
            query_starts.append(query_starts[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decodes=len(decodes),
            decode_seq_lens=int32(decode_lens),
            decode_block_tables=tables([r for r, _ in decodes], decode_lens),
            prefills=spans,
            prefill_query_starts=int32(query_starts),
            prefill_seq_lens=int32(prefill_lens),
            prefill_block_tables=prefill_tables,
            max_prefill_query_len=max((n for _, n in prefills), default=0),
        )
        return (torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device), meta)


def max_step_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The most tokens one step computes (the engine's max_num_batched_tokens default)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return 2048 if config.enable_chunked_prefill else max(2048, max_model_len)


def profile_sequence_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    """The profiling step: num_tokens of prefill in sequences no longer than max_model_len."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def gpu_kv_cache_budget(total: int, free: int, peak_step_bytes: int, utilization: float,
                        reserve: int = 256 << 20) -> int:
    """Bytes left for KV blocks: the utilization share of the GPU, less what is in use now
    (weights, the CUDA context, other processes), the largest step's activations (measured by
    the profiling pass) and a reserve for the CUDA graphs' pool and allocator slack."""
    return int(total * utilization) - (total - free) - peak_step_bytes - reserve


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes captured as CUDA graphs: 1, 2, 4, then every multiple of 8, up to
    max_num_seqs (itself included) and at most 256. A batch runs in the smallest that holds it."""
    limit = min(max_num_seqs, 256)
    sizes = [s for s in [1, 2, 4, *range(8, 257, 8)] if s <= limit]
    if sizes[-1] < limit:
        sizes.append(limit)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding num_seqs, or None when none does (run eagerly)."""
    return next((s for s in sizes if s >= num_seqs), None)


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
