"""FP8 weights (`quantization="fp8"`, as vLLM's): each nn.Linear's float weight is quantized as it
loads to float8 E4M3 with one float32 scale per output channel, W ~ w8 * scale with
scale = max|W[n]| / 448 (E4M3's largest value).

On Hopper-class GPUs (compute capability 9.0+) with bfloat16 activations the matmul is
`torch._scaled_mm` on FP8 tensor cores, activations quantized per token on the fly. Elsewhere (the
CPU, older GPUs) it is emulated: the weight is dequantized to the activation dtype for the call,
then F.linear.

The FP8 KV cache (`kv_cache_dtype="fp8"`, "fp8_e4m3", "fp8_e5m2") stores keys and values as
float8 codes of x / scale, one key and one value scale per layer (the checkpoint's, else 1.0, vLLM's
default); every attention path reads them back times their scale (backend/ops/__init__.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float32 scales [N])."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (weight / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def to_float(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 E4M3 -> dtype, exactly, for every code but NaN's (which the quantized weights never
    hold). torch converts float8 one element at a time on the CPU; this moves the bits into a
    float16's places (sign; exponent and mantissa, normal or subnormal alike) and scales by 2^8,
    in vectorised integer ops (faster: docs/benchmarks.md, "Timings moved out of docstrings")."""
    code = weight.view(torch.uint8).to(torch.int16)
    half = (((code & 0x7F) << 7) | ((code & 0x80) << 8)).view(torch.float16)
    return (half * 256).to(dtype)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return to_float(weight, dtype) * scales.to(dtype)[:, None]


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Row-wise scaled FP8 GEMMs need Hopper (sm_90+), bfloat16 output and dims in multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scales = quantize(linear.weight.detach())
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scales, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if scaled_mm_supported(x, self.weight):
            return self._scaled_mm(x)
        return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        x8 = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out = torch._scaled_mm(x8, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1),
                               out_dtype=x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per channel"


KV_CACHE_DTYPES = {"fp8": FP8, "fp8_e4m3": FP8, "fp8_e5m2": torch.float8_e5m2}  # and "auto"


def kv_cache_dtype(option: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for EngineConfig.kv_cache_dtype: the activation dtype for auto."""
    return dtype if option == "auto" else KV_CACHE_DTYPES[option]
