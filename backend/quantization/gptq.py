"""GPTQ's checkpoint layout (AutoGPTQ / GPTQModel, `quant_method: gptq`), 4 or 8 bits:

    qweight [K * bits / 32, N] int32   packed along the inputs, value i of a word at bit bits * i
    qzeros  [G, N * bits / 32] int32   packed along the outputs; `checkpoint_format: gptq` (v1, the
                                       default) stores zero - 1, `gptq_v2` the zero itself
    scales  [G, N]                     float16
    g_idx   [K] int32                  each input's group: k // group, or any assignment with
                                       act-order (`desc_act`), where groups follow the Hessian

W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] and y = x @ W. Symmetric checkpoints
(`sym: true`) store the zero 2 ** (bits - 1) everywhere.
"""

from __future__ import annotations

import torch

from backend.kernels.reference import unpack_int_reference
from backend.quantization.config import QuantConfig
from backend.quantization.linear import pack_int

FUSED_DIMS = {"qweight": 1, "qzeros": 1, "scales": 1, "g_idx": None}  # g_idx: one copy for all shards


def pack_weight(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] integers -> qweight [K * bits / 32, N]."""
    return pack_int(values.t(), bits).t().contiguous()


def pack_zeros(zeros: torch.Tensor, bits: int, v1: bool = True) -> torch.Tensor:
    """[G, N] integer zeros -> qzeros [G, N * bits / 32] (v1: stored minus one)."""
    return pack_int((zeros - 1) & ((1 << bits) - 1) if v1 else zeros, bits)


def tensor_shapes(in_features: int, out_features: int, config: QuantConfig) -> dict[str, tuple]:
    per_word = 32 // config.bits
    groups = in_features // config.group_size_for(in_features)
    return {"qweight": ((in_features // per_word, out_features), torch.int32),
            "qzeros": ((groups, out_features // per_word), torch.int32),
            "scales": ((groups, out_features), torch.float16),
            "g_idx": ((in_features,), torch.int32)}


def to_canonical(tensors: dict[str, torch.Tensor], config: QuantConfig):
    """-> (q [N, K], zeros [N, G], scales [N, G], g_idx [K])."""
    bits, v1 = config.bits, config.checkpoint_format == "gptq"
    zeros = unpack_int_reference(tensors["qzeros"], bits)
    if v1:
        zeros = zeros + 1  # as vLLM and the exllama kernels read it: a stored -1 (zero 0) reads 2 ** bits
    q = unpack_int_reference(tensors["qweight"].t(), bits)
    return q, zeros.t(), tensors["scales"].t(), tensors["g_idx"]
