"""RMSNorm, optionally fused with the residual add that precedes it.

One program per row. Rounding follows the reference (Hugging Face): the residual sum rounds to the
activation dtype, the normalised row rounds to it before the weight multiplies it.
Reference: `reference.rms_norm_reference`, `reference.add_rms_norm_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import tl, triton  # first: it sets up Triton


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, residual_out, eps,
    stride_x, stride_residual, stride_out, stride_residual_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    values = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        values += tl.load(residual + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        values = values.to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * stride_residual_out + cols, values, mask=mask)
        values = values.to(tl.float32)
    variance = tl.sum(values * values, axis=0) / HIDDEN
    normed = (values * tl.rsqrt(variance + eps)).to(out.dtype.element_ty).to(tl.float32)
    scaled = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32) * normed
    tl.store(out + row * stride_out + cols, scaled.to(out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] (rows may be strided) -> [T, hidden]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, x, weight, out, out, eps, add_residual=False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    _launch(x, residual, weight, out, residual_out, eps, add_residual=True)
    return out, residual_out


def _launch(x, residual, weight, out, residual_out, eps, add_residual):
    num_rows, hidden = x.shape
    assert x.stride(1) == 1 and residual.stride(1) == 1
    if num_rows == 0:
        return
    _rms_norm_kernel[(num_rows,)](
        x, residual, weight, out, residual_out, eps,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), ADD_RESIDUAL=add_residual,
    )
