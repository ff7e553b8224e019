"""IntLinear: the linear layer of AWQ and GPTQ checkpoints, y = x W^T + b with W held as 4- or
8-bit integers and a scale and zero point per group of inputs.

It is built with the checkpoint's own tensors as parameters (their names and shapes come from the
format's module, `awq.py` or `gptq.py`), so the loader (`models/loading.py`) fills them by name,
writing q/k/v and gate/up parts along each tensor's output dim (`FUSED_DIMS`; the packed layers'
loaders find it from the shapes, `layers/sharding.packed_dim`). `finish_loading` then repacks them
once into the one layout every path reads: qweight [N, K * bits / 32] int32 packed along the inputs (like
nn.Linear's [N, K] weight), scales and zeros [N, G] in the activation dtype. GPTQ's act-order
(inputs of one group scattered) becomes a permutation of the inputs: the weight's columns are
sorted by group once, and each call gathers x's columns in the same order, so groups are
contiguous runs for the kernels.

The matmul is `ops.quant_matmul`: the Triton kernel on CUDA, dequantize-then-F.linear on the CPU.
On the CPU in bfloat16 or float16, 4-bit weights in groups of 32-256 inputs (outputs in multiples of
16) are instead repacked once for torch's int4 CPU matmul (`_weight_int4pack_mm_for_cpu`, the
kernel gpt-fast and torchao use), which reads the nibbles in place: many times faster than
dequantizing on every call (docs/quantization.md has the figures). Its weight is
(q - 8) * scale + offset, so the zero point becomes offset = (8 - zero) * scale.
"""

from __future__ import annotations

import torch
from torch import nn

from backend import ops
from backend.quantization.config import QuantConfig


def pack_int(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., K] integers in [0, 2 ** bits) -> [..., K * bits / 32] int32, 32 // bits consecutive
    values to a word, the i-th at bit bits * i."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (values.reshape(*values.shape[:-1], -1, per_word).to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def int4pack_applies(bits: int, group_size: int, out_features: int, scales: torch.Tensor) -> bool:
    return (bits == 4 and group_size in (32, 64, 128, 256) and out_features % 16 == 0
            and scales.device.type == "cpu" and scales.dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


class IntLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, config: QuantConfig, layout) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.config, self.layout, self.bits = config, layout, config.bits
        group_size = config.group_size_for(in_features)
        if in_features % group_size or out_features % (32 // config.bits):
            raise ValueError(f"quantization: a layer of {in_features} inputs and {out_features} outputs does not "
                             f"split into groups of {group_size} inputs and words of {32 // config.bits} outputs")
        for name, (shape, dtype) in layout.tensor_shapes(in_features, out_features, config).items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.register_buffer("perm", None, persistent=False)  # act-order: x's columns in group order

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Repack the loaded checkpoint tensors into the layout the matmul reads."""
        names = list(self.layout.FUSED_DIMS)
        q, zeros, scales, g_idx = self.layout.to_canonical({n: getattr(self, n) for n in names}, self.config)
        for name in names:
            delattr(self, name)
        group_size = self.config.group_size_for(self.in_features)
        in_order = torch.arange(self.in_features, device=q.device) // group_size
        if g_idx is not None and not torch.equal(g_idx.to(in_order.dtype), in_order):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm].to(in_order.dtype), in_order):
                raise ValueError(f"g_idx: groups of other than {group_size} inputs")
            q, self.perm = q[:, perm], perm
        zeros = zeros.to(scales.dtype)
        self.group_size = group_size
        if int4pack_applies(self.bits, group_size, self.out_features, scales):
            self.int4pack = nn.Parameter(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int().contiguous(), 1),
                                         requires_grad=False)
            offsets = (8 - zeros) * scales
            self.scales_and_zeros = nn.Parameter(torch.stack((scales.t(), offsets.t()), dim=-1).contiguous(),
                                                 requires_grad=False)  # [G, N, 2]
            return
        self.qweight = nn.Parameter(pack_int(q, self.bits), requires_grad=False)
        self.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        self.zeros = nn.Parameter(zeros.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if hasattr(self, "int4pack"):
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).contiguous(),
                                                             self.int4pack, self.group_size, self.scales_and_zeros)
            out = out.view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return ops.quant_matmul(x, self.qweight, self.scales, self.zeros, self.bits, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.config.method}, bits={self.bits}, group_size={self.config.group_size}")
