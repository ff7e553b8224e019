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
        logger.info("model %s on %s in %s; KV cache %d blocks of %d tokens", model_path,
                    self.device, self.dtype, self.num_blocks, self.block_size)

    @property
    def block_bytes(self) -> int:
        element = torch.finfo(self.dtype).bits // 8
        return (2 * self.args.num_layers * self.block_size * self.args.num_kv_heads
                * self.args.head_dim * element)

    def _num_blocks(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used - (256 << 20)
        elif self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
        else:
            budget = min(4 << 30, available_memory_bytes() // 4)
        if self.config.kv_cache_memory_bytes is not None and self.device.type == "cuda":
            budget = self.config.kv_cache_memory_bytes
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes: {budget} bytes hold no block "
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

        device = self.device
        num_decodes = len(decodes)
        if num_decodes:
            seq_lens = [r.num_computed_tokens + 1 for r, _ in decodes]
            max_blocks = -(-max(seq_lens) // block_size)
            tables = [r.block_table[:max_blocks] + [0] * (max_blocks - len(r.block_table[:max_blocks]))
                      for r, _ in decodes]
            decode_block_tables = torch.tensor(tables, dtype=torch.int64, device=device)
            lens = torch.tensor(seq_lens, device=device)
            beyond = (torch.arange(max_blocks * block_size, device=device).unsqueeze(0)
                      >= lens.unsqueeze(1)).view(num_decodes, 1, -1)
            decode_bias = torch.zeros(beyond.shape, dtype=self.dtype, device=device)
            decode_bias.masked_fill_(beyond, float("-inf"))
        else:
            decode_block_tables = decode_bias = torch.empty(0, device=device)
        spans = []
        offset = num_decodes
        for request, n in prefills:
            context_len = request.num_computed_tokens + n
            table = request.block_table[:-(-context_len // block_size)]
            spans.append(PrefillSpan(offset, n, context_len,
                                     torch.tensor(table, dtype=torch.int64, device=device)))
            offset += n
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=device),
                                 num_decodes, decode_block_tables, decode_bias, spans)

        hidden = self.model(torch.tensor(input_ids, device=device),
                            torch.tensor(positions, device=device), self.kv_caches, meta)
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
        rows = torch.tensor(sample_rows, device=device)
        return self.model.compute_logits(hidden[rows]).cpu(), sample_requests


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
