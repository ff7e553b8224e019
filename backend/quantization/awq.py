"""AutoAWQ's GEMM checkpoint layout (`quant_method: awq`, `version: gemm`), 4-bit:

    qweight [K, N / 8] int32    eight outputs per word, nibble i holding output ORDER[i] of its eight
    qzeros  [K / group, N / 8]  int32, packed the same way
    scales  [K / group, N]      float16

W[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n] and y = x @ W (K inputs, N outputs).
"""

from __future__ import annotations

import torch

from backend.kernels.reference import unpack_int_reference
from backend.quantization.config import QuantConfig
from backend.quantization.linear import pack_int

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output (of a word's eight) that nibble i holds
REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # the nibble that holds output j
FUSED_DIMS = {"qweight": 1, "qzeros": 1, "scales": 1}  # q/k/v and gate/up join along the outputs


def pack(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in [0, 16) -> [R, N / 8] int32 in AutoAWQ's order."""
    rows, cols = values.shape
    return pack_int(values.reshape(rows, cols // 8, 8)[..., ORDER].reshape(rows, cols), 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] int32 -> [R, N] int32."""
    rows = packed.shape[0]
    return unpack_int_reference(packed, 4).view(rows, -1, 8)[..., REVERSE_ORDER].reshape(rows, -1)


def tensor_shapes(in_features: int, out_features: int, config: QuantConfig) -> dict[str, tuple]:
    groups = in_features // config.group_size_for(in_features)
    return {"qweight": ((in_features, out_features // 8), torch.int32),
            "qzeros": ((groups, out_features // 8), torch.int32),
            "scales": ((groups, out_features), torch.float16)}


def to_canonical(tensors: dict[str, torch.Tensor], config: QuantConfig):
    """-> (q [N, K], zeros [N, G], scales [N, G], g_idx None)."""
    return (unpack(tensors["qweight"]).t(), unpack(tensors["qzeros"]).t(), tensors["scales"].t(), None)
