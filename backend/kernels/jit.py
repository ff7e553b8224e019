"""Where the kernel modules get Triton from, set up so that their kernels compile for the GPU, or
run through Triton's interpreter on CPU tensors where there is no GPU (tests, CI) or
TRITON_INTERPRET=1 asks for it.

Triton reads TRITON_INTERPRET when it decorates a function, its own library (`tl.sum`, `tl.cdiv`)
included, and again in places later on. So without a GPU this module sets it for the process before
Triton is imported, and refuses to go on if something imported Triton earlier without it.
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if INTERPRET and not isinstance(tl.sum, InterpretedFunction):
    raise RuntimeError("there is no GPU, so the Triton kernels need Triton's interpreter, but Triton was "
                       "imported before backend.kernels without TRITON_INTERPRET=1: set TRITON_INTERPRET=1 "
                       "in the environment")

__all__ = ["INTERPRET", "dot_settings", "tl", "triton"]


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast, input_precision) for `tl.dot` on operands of `dtype`.

    float32 asks for IEEE products (Triton's default for float32 is TF32, which would lose the
    float32 exactness the engine promises). The interpreter keeps bfloat16 as raw bits that its
    `tl.dot` multiplies as integers, so there the operands are upcast to float32 first."""
    upcast = INTERPRET and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"
