"""RMSNorm on the fast ops (`ops.rms_norm`, and `ops.add_rms_norm` where a residual joins first).

Gemma's norms scale by (1 + w): the offset is added to the weight once, as the checkpoint loads
(`load_offset`, the weight's loader), so they run the same kernel. In float32 that is Hugging Face's result bit for bit;
in bfloat16 the sum 1 + w is rounded to bfloat16 where Hugging Face keeps it in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from backend import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, load_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.load_offset = load_offset  # added to the checkpoint's weight as it loads (Gemma: 1.0)
        if load_offset:
            self.weight_loaders = {"weight": self.load_with_offset}

    def load_with_offset(self, param: torch.Tensor, tensor: torch.Tensor, part: int | None = None) -> None:
        param.copy_(tensor)
        param += self.load_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
