"""Inputs and comparisons for the kernel tests: the device they run on (CUDA, or the CPU under
Triton's interpreter), tolerances per dtype, a paged KV cache laid out as the engine lays it out."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def on_torch_and_triton(generate):
    """generate(device) on the torch path and on the Triton kernels (CUDA, or the CPU under the
    interpreter)."""
    from backend import ops

    on_torch = generate("cpu")
    if DEVICE.type == "cuda":
        return on_torch, generate("cuda")
    with ops.triton_kernels():
        return on_torch, generate("cpu")


def paged_cache(num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype):
    """Random key and value caches [num_blocks, block_size, KVH, D] as the engine lays them out:
    views of a head-major [2, KVH, num_blocks, block_size, D] tensor."""
    cache = torch.randn(2, NUM_KV_HEADS, num_blocks, block_size, head_dim, dtype=dtype, device=DEVICE)
    return cache, cache[0].permute(1, 2, 0, 3), cache[1].permute(1, 2, 0, 3)


def block_tables_for(seq_lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Distinct random blocks for each sequence, padded with block 0 to the longest."""
    width = max(-(-n // block_size) for n in seq_lens)
    blocks = torch.randperm(num_blocks)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        count = -(-n // block_size)
        tables[i, :count] = blocks[used:used + count]
        used += count
    return tables.to(DEVICE)
