"""Fused dequantize + matmul for group-quantized integer weights (AWQ and GPTQ, 4 or 8 bits):
out [M, N] = x [M, K] @ W^T with W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], g = k // group.

qweight is [N, K * bits / 32] int32, packed along K (the layout `backend/quantization/linear.py`
repacks both checkpoint formats into); scales and zeros are [N, K / group]. Each program computes a
[BLOCK_M, BLOCK_N] tile of the output: for every BLOCK_K slice it loads the packed words (each
word once per value it holds, from cache), shifts out the values, dequantizes them in float32,
rounds them to the activation dtype like the reference does, and feeds `tl.dot`, accumulating in
float32. The weight never exists unpacked in memory.
Reference: `reference.quant_matmul_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import dot_settings, tl, triton  # first: it sets up Triton


@triton.jit
def _quant_matmul_kernel(
    x, qweight, scales, zeros, bias, out, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    dtype = x.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        packed = tl.load(qweight + cols[None, :].to(tl.int64) * stride_qn + (ks // PACK)[:, None],
                         mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N]
        q = (packed >> ((ks % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
        groups = (ks // GROUP)[:, None]
        scale = tl.load(scales + cols[None, :] * stride_sn + groups, mask=w_mask, other=0.0).to(tl.float32)
        zero = tl.load(zeros + cols[None, :] * stride_zn + groups, mask=w_mask, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - zero) * scale).to(scales.dtype.element_ty).to(dtype)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]; see the module docstring for the weight layout."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, num_in = x.shape
    num_out = qweight.shape[0]
    group = num_in // scales.shape[1]
    assert qweight.shape[1] * 32 // bits == num_in and num_in % group == 0
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    if num_rows:
        block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
        block_n, block_k = 64, min(64, triton.next_power_of_2(group))
        upcast, precision = dot_settings(x.dtype)
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
        _quant_matmul_kernel[grid](
            x, qweight, scales, zeros, bias if bias is not None else scales, out, num_rows, num_out, num_in,
            x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
            BITS=bits, GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision)
    return out.view(*shape[:-1], num_out)
