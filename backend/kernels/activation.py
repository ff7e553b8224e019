"""SiLU-and-mul: x [T, 2 * I] holding (gate, up) -> silu(gate) * up, [T, I].

silu rounds to the activation dtype before the multiply, as `F.silu(gate) * up` does.
Reference: `reference.silu_and_mul_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import tl, triton  # first: it sets up Triton

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_out, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < SIZE
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + SIZE + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out + row * stride_out + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    num_tokens, double = x.shape
    size = double // 2
    assert x.stride(1) == 1
    out = torch.empty(num_tokens, size, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(BLOCK, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            x, out, x.stride(0), out.stride(0), SIZE=size, BLOCK=block)
    return out
