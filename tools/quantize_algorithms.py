"""The quantization algorithms of `tritonllm quantize` (tools/quantize.py walks the model and writes
the checkpoint): round-to-nearest on a per-group grid, GPTQ, and AWQ's scale and clip searches.
Every function works on one float32 weight [out, in] (and its inputs [n, in]) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SEQUENTIAL = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
LINEARS = [name for group in SEQUENTIAL for name in group]


@dataclass
class Quantized:
    """One weight [out, in] as integers with a scale and zero per (group, output)."""
    q: torch.Tensor  # [out, in] int64
    zeros: torch.Tensor  # [G, out] int64
    scales: torch.Tensor  # [G, out] float32 holding float16 values (what the checkpoint stores)
    g_idx: torch.Tensor  # [in] int64, each input's group

    def dequantized(self) -> torch.Tensor:
        return ((self.q - self.zeros[self.g_idx].t()) * self.scales[self.g_idx].t()).float()


# -- round to nearest ------------------------------------------------------------------------------------
def find_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of w: (scale, zero) mapping [min(w, 0), max(w, 0)] onto [0, 2^bits - 1]. Scales are
    rounded to float16 (the stored precision); asymmetric zeros are kept >= 1, since GPTQ's v1
    format stores zero - 1."""
    maxq = (1 << bits) - 1
    low, high = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = -high
    scale = ((high - low) / maxq).clamp(min=1e-5).half().float()
    if sym:
        return scale, torch.full_like(scale, 1 << (bits - 1))
    return scale, (-low / scale).round().clamp(1, maxq)


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return (w / scale + zero).round().clamp(0, (1 << bits) - 1)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """What round-to-nearest (asymmetric) makes of w [out, in]: quantize_rtn(...).dequantized(),
    without building the integers (the searches call this many times)."""
    grouped = w.reshape(w.shape[0], -1, group_size)
    scale, zero = find_params(grouped, bits, sym=False)
    scale, zero = scale[..., None], zero[..., None]
    return ((round_to_grid(grouped, scale, zero, bits) - zero) * scale).reshape(w.shape)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> Quantized:
    out_features, in_features = w.shape
    grouped = w.reshape(out_features, -1, group_size)
    scale, zero = find_params(grouped, bits, sym)  # [out, G]
    q = round_to_grid(grouped, scale[..., None], zero[..., None], bits).reshape(out_features, in_features)
    g_idx = torch.arange(in_features) // group_size
    return Quantized(q.long(), zero.t().long(), scale.t(), g_idx)


# -- GPTQ ------------------------------------------------------------------------------------------------
def quantize_gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
                  act_order: bool, block_size: int = 128, damp: float = 0.01) -> Quantized:
    w = w.clone().float()
    out_features, columns = w.shape
    H = hessian.clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(columns)
    w, H = w[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    q = torch.zeros_like(w)
    scales = torch.zeros(out_features, columns // group_size)
    zeros = torch.zeros_like(scales)
    block_size = max(group_size, block_size // group_size * group_size)  # groups never straddle blocks
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block, h_block = w[:, start:end].clone(), h_inv[start:end, start:end]
        errors = torch.zeros(out_features, end - start)
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:  # this group's grid, from its columns as updated so far
                group = column // group_size
                scales[:, group], zeros[:, group] = find_params(block[:, i:i + group_size], bits, sym)
            scale, zero = scales[:, column // group_size], zeros[:, column // group_size]
            q[:, column] = round_to_grid(block[:, i], scale, zero, bits)
            error = (block[:, i] - (q[:, column] - zero) * scale) / h_block[i, i]
            block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    inverse = torch.argsort(perm)
    g_idx = (torch.arange(columns) // group_size)[inverse]
    return Quantized(q[:, inverse].long(), zeros.t().long(), scales.t(), g_idx)


# -- AWQ -------------------------------------------------------------------------------------------------
def sample_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    return x[::max(1, x.shape[0] // count)][:count]


def awq_search_scales(linears: list[nn.Linear], x: torch.Tensor, bits: int, group_size: int,
                      grid: int) -> torch.Tensor:
    """Per-input-channel scales for linears sharing the input x [n, in] (AutoAWQ's duo scaling)."""
    w = torch.cat([linear.weight for linear in linears])
    x_mean = x.abs().mean(0)
    x = sample_rows(x, 512)  # the loss on a strided sample of the tokens
    w_norm = w.abs().reshape(-1, group_size)
    w_mean = (w_norm / (w_norm.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    reference = x @ w.t()
    best_error, best = float("inf"), torch.ones_like(x_mean)
    for ratio in (i / grid for i in range(grid)):
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        trial = fake_quantize(w * s, bits, group_size) / s
        error = (x @ trial.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best = error, s
    return best


def awq_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, grid: int,
             max_shrink: float = 0.5) -> torch.Tensor:
    """w clamped per (output, group) to the range whose quantized outputs on x err least."""
    out_features, in_features = w.shape
    groups = in_features // group_size
    xg = x.reshape(-1, groups, group_size).transpose(0, 1)  # [G, n, g]
    wg = w.reshape(out_features, groups, group_size).permute(1, 2, 0)  # [G, g, out]
    reference = torch.bmm(xg, wg)  # [G, n, out]: each group's share of the outputs
    original_max = wg.abs().amax(dim=1, keepdim=True)  # [G, 1, out]
    best_error = torch.full_like(original_max, float("inf"))
    best_max = original_max.clone()
    for i in range(int(max_shrink * grid)):
        max_value = original_max * (1 - i / grid)
        clipped = torch.maximum(torch.minimum(wg, max_value), -max_value)
        trial = fake_quantize(clipped.permute(2, 0, 1).reshape(out_features, in_features), bits, group_size)
        trial_g = trial.reshape(out_features, groups, group_size).permute(1, 2, 0)
        error = (torch.bmm(xg, trial_g) - reference).pow(2).mean(dim=1, keepdim=True)
        better = error < best_error
        best_error, best_max = torch.where(better, error, best_error), torch.where(better, max_value, best_max)
    clipped = torch.maximum(torch.minimum(wg, best_max), -best_max)
    return clipped.permute(2, 0, 1).reshape(out_features, in_features)


@torch.no_grad()
def awq_layer(layer: nn.Module, inputs: dict[str, torch.Tensor], bits: int, group_size: int,
              grid: int) -> None:
    """Fold searched scales into the layer's weights and norms, then clip its weights (in place).
    inputs: each linear's input rows [n, in], from the float layer."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj"),
              (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj"),
              (mlp.up_proj, [mlp.down_proj], "mlp.down_proj")]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # o after v only without grouped heads
        groups.append((attn.v_proj, [attn.o_proj], "self_attn.o_proj"))
    for previous, linears, input_name in groups:
        s = awq_search_scales(linears, inputs[input_name], bits, group_size, grid)
        previous.weight.div_(s.view(-1, *[1] * (previous.weight.dim() - 1)))  # a norm [in], a linear [in, ...]
        if getattr(previous, "bias", None) is not None:
            previous.bias.div_(s)
        for linear in linears:
            linear.weight.mul_(s)
        for name in {"self_attn.q_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                     "mlp.gate_proj": ["mlp.gate_proj", "mlp.up_proj"]}.get(input_name, [input_name]):
            inputs[name] = inputs[name] / s
    for name in LINEARS:
        if name not in ("self_attn.q_proj", "self_attn.k_proj"):  # as AutoAWQ: their errors meet in q.k
            linear = layer.get_submodule(name)
            linear.weight.copy_(awq_clip(linear.weight, sample_rows(inputs[name], 64), bits, group_size, grid))


def hessian(x: torch.Tensor) -> torch.Tensor:
    """GPTQ's H = 2 X^T X / n of a layer's inputs x [n, in] (accumulated in float64)."""
    x = x.double()
    return (2 / x.shape[0] * x.t() @ x).float()
