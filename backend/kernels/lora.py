"""Batched multi-LoRA (punica's SGMV shape, shrink then expand): out[t] += B[s] @ (A[s] @ x[t])
for every token t of every segment, a run of consecutive tokens sharing the adapter in slot s.

One program takes BLOCK_M tokens of one segment: it shrinks them through A (walking `in` in
BLOCK_K slices, accumulating [BLOCK_M, R] in float32, R the padded rank), rounds that to the
weights' dtype as the reference does, then expands through B one BLOCK_N slice of `out` at a time
and adds into `out`. The shrunk rows never leave registers. Tokens of no adapter belong to no
segment and are not touched. The grid is (token tiles of the longest segment, segments); tiles past
a shorter segment's end return at once.
Reference: `backend.kernels.reference.add_lora_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import dot_settings, tl, triton  # first: it sets up Triton


@triton.jit
def _lora_kernel(
    x, lora_a, lora_b, out, starts, lengths, slots, K, N, R,
    stride_xm, stride_om, stride_as, stride_ar, stride_bs, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    segment = tl.program_id(1)
    length = tl.load(lengths + segment)
    first = tl.program_id(0) * BLOCK_M
    if first < length:
        start = tl.load(starts + segment)
        slot = tl.load(slots + segment).to(tl.int64)
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        tokens = (start + rows).to(tl.int64)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        dtype = lora_b.dtype.element_ty
        shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xs = tl.load(x + tokens[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                         other=0.0)
            a = tl.load(lora_a + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None],
                        mask=k_ok[:, None] & rank_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
            if UPCAST:
                xs, a = xs.to(tl.float32), a.to(tl.float32)
            shrunk += tl.dot(xs, a, input_precision=PRECISION)
        shrunk_rounded = shrunk.to(dtype)
        if UPCAST:
            shrunk_rounded = shrunk_rounded.to(tl.float32)
        for n_start in range(0, N, BLOCK_N):
            ns = n_start + tl.arange(0, BLOCK_N)
            n_ok = ns < N
            b = tl.load(lora_b + slot * stride_bs + ns[None, :] * stride_bn + ranks[:, None],
                        mask=rank_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            if UPCAST:
                b = b.to(tl.float32)
            delta = tl.dot(shrunk_rounded, b, input_precision=PRECISION)
            mask = row_ok[:, None] & n_ok[None, :]
            pointers = out + tokens[:, None] * stride_om + ns[None, :]
            base = tl.load(pointers, mask=mask, other=0.0)
            tl.store(pointers, (base.to(tl.float32) + delta.to(dtype).to(tl.float32)).to(out.dtype.element_ty),
                     mask=mask)


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, max_length: int) -> None:
    """out [T, N] += the segments' deltas, in place. x [T, K]; lora_a [S, R, K]; lora_b [S, N, R];
    starts/lengths/slots [segments] int32."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert out.stride(-1) == 1 and lora_a.stride(-1) == 1 and lora_b.stride(-1) == 1
    num_segments = starts.shape[0]
    if not num_segments or not max_length:
        return
    _, rank, num_in = lora_a.shape
    num_out = lora_b.shape[1]
    block_m = min(64, max(16, triton.next_power_of_2(max_length)))
    upcast, precision = dot_settings(lora_b.dtype)
    grid = (triton.cdiv(max_length, block_m), num_segments)
    _lora_kernel[grid](
        x, lora_a, lora_b, out, starts, lengths, slots, num_in, num_out, rank,
        x.stride(0), out.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1),
        BLOCK_M=block_m, BLOCK_K=64, BLOCK_N=64, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        UPCAST=upcast, PRECISION=precision)
