"""Fused mixture-of-experts (the shape of vLLM's and SGLang's fused_moe): every token's top-k
experts run as two grouped GEMMs over tokens sorted by expert.

1. `align_by_expert` sorts the T * k (token, slot) pairs by expert and pads each expert's run to a
   multiple of BLOCK_M, so that every BLOCK_M-row tile belongs to one expert: `sorted_pairs` holds
   the pair index of each padded row (T * k for padding), `block_experts` each tile's expert. It is
   sized for the worst case (T * k + E * (BLOCK_M - 1) rows) so that nothing waits on the host;
   tiles past the real padded total (`num_padded`, a device scalar) return at once. Experts without
   tokens get no tile.
2. `_grouped_gemm_kernel`, one program per (row tile, column tile): it gathers its tile's rows of A
   (row = pair // k for the first GEMM, the pair itself for the second), multiplies them by its
   expert's weight [N, K] (read transposed, as nn.Linear stores it) in BLOCK_K slices accumulating in
   float32, optionally scales each row by its routing weight, and scatters the rows to C[pair].
3. gate_up [T * k, 2I] -> SiLU-and-mul (`activation.py`) -> down [T * k, H] with the routing weights
   applied -> summed over the k slots.

Reference: `backend.kernels.reference.fused_moe_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.activation import silu_and_mul
from backend.kernels.jit import dot_settings, tl, triton  # first: it sets up Triton

BLOCK_M = 16


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_rows] int32, block_experts [max_rows / block_m] int32, num_padded [1] int32)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    max_rows = num_pairs + num_experts * (block_m - 1)
    max_rows = -(-max_rows // block_m) * block_m
    # scatter_add_, not bincount: bincount on CUDA reads the largest id back to the host, which a
    # CUDA graph capture forbids
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts_in_order]
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[padded_starts[experts_in_order] + rank_in_expert] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, tile_starts, right=True).clamp(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), padded_ends[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a, w, c, sorted_pairs, block_experts, num_padded, routing_weights, num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_cm,
    ROWS_PER_A: tl.constexpr, MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile * BLOCK_M < tl.load(num_padded):
        pairs = tl.load(sorted_pairs + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = pairs < num_pairs
        a_rows = pairs // ROWS_PER_A
        expert = tl.load(block_experts + tile).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xs = tl.load(a + a_rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                         other=0.0)
            ws = tl.load(w + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST:
                xs, ws = xs.to(tl.float32), ws.to(tl.float32)
            acc += tl.dot(xs, ws, input_precision=PRECISION)
        dtype = c.dtype.element_ty
        if MUL_ROUTING_WEIGHT:  # the expert's output rounds to the dtype first, as the reference's F.linear does
            scale = tl.load(routing_weights + pairs, mask=row_ok, other=0.0)
            acc = acc.to(dtype).to(tl.float32) * scale[:, None]
        tl.store(c + pairs[:, None] * stride_cm + cols[None, :], acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                 block_experts: torch.Tensor, num_padded: torch.Tensor, rows_per_a: int,
                 routing_weights: torch.Tensor | None = None, block_m: int = BLOCK_M) -> None:
    """out[pair] = a[pair // rows_per_a] @ w[expert of pair]^T (* routing_weights[pair])."""
    num_experts, num_out, num_in = w.shape
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and out.stride(-1) == 1
    block_n = min(64, max(16, triton.next_power_of_2(num_out)))
    block_k = min(64, max(16, triton.next_power_of_2(num_in)))
    upcast, precision = dot_settings(w.dtype)
    grid = (sorted_pairs.shape[0] // block_m, triton.cdiv(num_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_experts, num_padded,
        routing_weights if routing_weights is not None else out, out.shape[0], num_out, num_in,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, MUL_ROUTING_WEIGHT=routing_weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights / topk_ids
    [T, k] -> [T, H]: sum over k of weight * down(silu(gate(x)) * up(x))."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    sorted_pairs, block_experts, num_padded = align_by_expert(topk_ids, w13.shape[0])
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, sorted_pairs, block_experts, num_padded, rows_per_a=top_k)
    activated = silu_and_mul(gate_up)
    out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(activated, w2, out, sorted_pairs, block_experts, num_padded, rows_per_a=1,
                 routing_weights=topk_weights.reshape(-1).float().contiguous())
    return out.view(num_tokens, top_k, hidden).sum(1)
