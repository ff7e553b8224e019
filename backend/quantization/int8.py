"""Weight-only INT8 (`quantization="int8"`): each nn.Linear's float weight is quantized as it loads,
symmetric per output channel, W ~ q * scale with q in [-127, 127] and scale = max|W[n]| / 127.

On the CPU with bfloat16 and float16 activations, up to 16 rows (decoding a few sequences) run
torch's fused int8 matmul (`torch._weight_int8pack_mm`, which reads the int8 weight in place and is
the fastest there); more rows convert the int8 weight to the activation dtype (cheap, unlike float8)
for oneDNN's GEMM and scale its outputs, since the fused op's time grows with the rows about three
times as fast. float32 (where the fused op is slow) and other devices dequantize the weight and use
F.linear, which reproduces the dequantized float model exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FUSED_MAX_ROWS = 16  # measured on SmolLM2's layers: the fused op wins below, oneDNN above


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N])."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def dequantize(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype) * scales.to(dtype)[:, None]


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scales = quantize(linear.weight.detach())
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scales = nn.Parameter(scales.to(linear.weight.dtype), requires_grad=False)  # the op's dtype
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            rows = x.reshape(-1, self.in_features)
            if rows.shape[0] <= FUSED_MAX_ROWS:
                out = torch._weight_int8pack_mm(rows, self.weight, self.scales)
            else:
                out = F.linear(rows, self.weight.to(x.dtype)) * self.scales
            out = out.view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, dequantize(self.weight, self.scales, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"
