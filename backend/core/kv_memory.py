"""KV-cache memory: how many blocks fit (a measured budget on a GPU, what the model and max_num_seqs
need on a CPU) and the tensors themselves: the cache, and the host store that holds swap space and
the second KV tier, one per layer, shaped
[2 (key, value), kv heads, blocks, block_size, head_dim]; under multi-head latent attention
[1 (the latent), 1, blocks, block_size, kv_lora_rank + qk_rope_head_dim].
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.config import EngineConfig, max_step_tokens
from backend.errors import check

# The CPU default holds max_num_seqs sequences of this many tokens (of max_model_len, if shorter;
# and at least one of max_model_len)...
CPU_DEFAULT_SEQUENCE_TOKENS = 2048
# ...and never more than this, nor more than a quarter of the free memory.
CPU_DEFAULT_LIMIT_BYTES = 4 << 30
HUGE_PAGE, SMALL_PAGE = 2 << 20, 4096


@dataclass(frozen=True)
class KVCacheLayout:
    """The shape of one layer's cache, less the number of blocks."""
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    num_parts: int = 2  # key and value; 1: one latent per token (ModelArgs.kv_cache_entry)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across every layer (keys and values, or latents)."""
        element = torch.finfo(self.dtype).bits // 8
        return self.num_parts * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.num_parts, self.num_kv_heads, num_blocks, self.block_size, self.head_dim


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_kv_cache_budget(layout: KVCacheLayout, max_num_seqs: int, max_model_len: int,
                        available: int) -> int:
    """The CPU default: room for max_num_seqs sequences of min(max_model_len, 2048) tokens (and for
    one of max_model_len), capped at min(4 GiB, a quarter of the free memory)."""
    blocks_per_seq = -(-min(max_model_len, CPU_DEFAULT_SEQUENCE_TOKENS) // layout.block_size)
    needed = max(max_num_seqs * blocks_per_seq, -(-max_model_len // layout.block_size)) * layout.block_bytes
    return min(needed, CPU_DEFAULT_LIMIT_BYTES, available // 4)


def gpu_kv_cache_budget(total: int, free: int, peak_step_bytes: int, utilization: float,
                        reserve: int = 256 << 20) -> int:
    """Bytes left for KV blocks: the utilization share of the GPU, less what is in use now
    (weights, the CUDA context, other processes), the largest step's activations (measured by
    the profiling pass) and a reserve for the CUDA graphs' pool and allocator slack."""
    return int(total * utilization) - (total - free) - peak_step_bytes - reserve


def profile_sequence_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    """The profiling step: num_tokens of prefill in sequences no longer than max_model_len."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def kv_cache_budget(config: EngineConfig, layout: KVCacheLayout, model, args, dtype: torch.dtype,
                    device: torch.device, world_size: int, max_model_len: int) -> int:
    """Bytes for the KV cache on this rank: the config's, else what the device allows."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cpu":
        return cpu_kv_cache_budget(layout, config.max_num_seqs, max_model_len, available_memory_bytes())
    step_tokens = max_step_tokens(config, max_model_len, device.type)
    if world_size > 1:
        # No profiling pass across ranks: hold back a generous share for the activations.
        peak = 64 * step_tokens * args.hidden_size * 4
    else:
        from backend.worker.cuda_graphs import profile_step_memory

        peak = profile_step_memory(model, args, dtype, device, layout.block_size,
                                   profile_sequence_lengths(step_tokens, max_model_len), config.max_num_seqs)
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_cache_budget(total, free, peak, config.gpu_memory_utilization)


def num_kv_blocks(config: EngineConfig, layout: KVCacheLayout, budget: int, device: torch.device) -> int:
    """Blocks that fit in the budget; a clear error naming the knob when not even one does."""
    knob = ("gpu_memory_utilization" if device.type == "cuda" and config.kv_cache_memory_bytes is None
            else "kv_cache_memory_bytes")
    num_blocks = budget // layout.block_bytes
    check(num_blocks >= 1, knob, f"leaves {budget} bytes for the KV cache, which hold no block "
          f"(one block takes {layout.block_bytes} bytes)")
    return int(num_blocks)


def resident_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros on 2 MiB pages, resident from the start. A private anonymous mapping asks for huge
    pages (transparent huge pages in "madvise" mode need the ask before the first touch; a shared
    mapping, Python's default, is shmem, which gets them only where `shmem_enabled` allows, mostly
    "never"): attention reads small blocks scattered over hundreds of MB, and with 4 KiB pages
    nearly each one misses the TLB. Then one thread writes a byte per page, which the kernel fills
    with zeros. Left to the steps, first touches land in the attention kernels' parallel loops,
    whose threads fault and wait on each other (docs/benchmarks.md, "Measured reasons behind code
    choices", has what each costs). So the
    cache is committed at startup, as vLLM's is: the memory a user sized is taken when the engine
    starts, and a host without it fails then, not under traffic."""
    num_bytes = math.prod(shape) * (torch.finfo(dtype).bits // 8)
    mapping = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    start = pages.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE - start  # offsets of the aligned huge pages inside
    last = (start + num_bytes) // HUGE_PAGE * HUGE_PAGE - start
    if last > first and hasattr(mapping, "madvise"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, first, last - first)
        except (OSError, AttributeError):  # a hint: kernels without THP refuse it
            pass
    pages[::SMALL_PAGE].zero_()
    # frombuffer keeps the mapping alive as long as the tensor.
    return pages[:num_bytes].view(dtype).view(shape)


def allocate_kv_caches(layout: KVCacheLayout, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    if device.type == "cpu":
        return [resident_zeros(layout.shape(num_blocks), layout.dtype) for _ in range(layout.num_layers)]
    return [torch.zeros(layout.shape(num_blocks), dtype=layout.dtype, device=device)
            for _ in range(layout.num_layers)]


def host_store_blocks(config: EngineConfig, layout: KVCacheLayout, world_size: int = 1) -> tuple[int, int]:
    """Blocks of the host store on this rank: swap space (swap_space GiB, for preemption_mode=swap)
    and the second KV tier (kv_offloading_size GiB across all ranks, as vLLM counts it)."""
    num_swap = int(config.swap_space * (1 << 30)) // layout.block_bytes if config.preemption_mode == "swap" else 0
    num_tier = int(config.kv_offloading_size * (1 << 30) / world_size) // layout.block_bytes \
        if config.kv_offloading_size and config.enable_prefix_caching else 0
    return num_swap, num_tier


def file_backed_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in a shared mapping of an unlinked file under $TMPDIR (a sparse file: nothing is
    taken until written). The kernel keeps the pages it has room for in the page cache and writes
    the others to disk, so the host store may outgrow free memory, unlike the KV cache, which is
    committed at start-up (`resident_zeros`)."""
    num_bytes = max(math.prod(shape) * (torch.finfo(dtype).bits // 8), 1)
    with tempfile.TemporaryFile(prefix="tritonllm-kv-") as file:
        file.truncate(num_bytes)
        mapping = mmap.mmap(file.fileno(), num_bytes)  # shared: writes go to the file
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def allocate_host_store(layout: KVCacheLayout, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """The host store, shaped as the KV cache per layer: blocks [0, swap) are swap space, the rest
    the second tier's slots. Pinned memory beside a GPU's cache (the block mover's copies run as
    DMA); on a CPU, where the cache is host memory already, a file-backed mapping, which buys
    capacity past the committed cache."""
    if not num_blocks:
        return []
    if device.type == "cuda":
        return [torch.zeros(layout.shape(num_blocks), dtype=layout.dtype, pin_memory=True)
                for _ in range(layout.num_layers)]
    return [file_backed_zeros(layout.shape(num_blocks), layout.dtype) for _ in range(layout.num_layers)]
