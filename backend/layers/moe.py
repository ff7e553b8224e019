"""The mixture-of-experts MLP every MoE family shares (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss):
a router picks each token's top-k experts and their weights, the chosen experts (gated MLPs) run,
their weighted outputs are summed, and shared experts (dense MLPs every token runs) are added.

Routing (`MoEArgs.scoring`): "softmax" (Mixtral, Qwen: softmax over all experts, then top-k),
"sigmoid" (DeepSeek-V3: sigmoid scores; the choice adds `e_score_correction_bias` and may be limited
to the best `topk_groups` of `num_groups` expert groups, a group scored by its two best experts; the
weights are the uncorrected scores) or "topk_softmax" (gpt-oss: top-k logits, softmax over those).
Then optionally `norm_topk_prob` (weights renormalised to sum to 1) and `routed_scaling_factor`.

Compute: each expert is two plain nn.Linear layers (`experts.{e}.gate_up_proj`, `.down_proj`), so the
dense layers' machinery applies to experts unchanged: the CPU's packed bfloat16 linears
(`cpu_ops.pack_linears`), load-time int8/fp8 quantization (`quantization.decoder_linears` matches
them by name) and tensor-parallel sharding (the same loaders as the dense MLP's, `layers/sharding.py`). On the
CPU, tokens are grouped by expert: the (token, expert) pairs are sorted by expert id, each expert
runs one GEMM over its rows, and the weighted rows are added back per token with one index_add_
(same per-token summation order as Hugging Face, experts ascending). In bfloat16 at a few tokens
(a decode step), where those torch ops cost more in dispatch than in arithmetic, one C++ call does
all of it instead (`backend/csrc/cpu_moe.cpp`, `cpu_ops.moe_experts`); its experts' linears then
stay plain nn.Linear (not packed for oneDNN), so the kernel and the grouped GEMMs of larger
batches read the same single copy of the weights (those GEMMs pay oneDNN's per-call weight reorder
instead, docs/benchmarks.md has the cost; a packed copy too would double the experts' memory). On CUDA (or CPU tensors inside
`ops.triton_kernels()`), the fused Triton kernel (`backend/kernels/fused_moe.py`, `ops.fused_moe`)
runs instead. Both kernels take the experts' weights stacked once into [E, N, K] tensors (the
nn.Linear weights become views of them, so nothing is held twice).

Tensor parallelism shards every expert (and shared expert) along its intermediate dimension:
gate/up column-parallel, down row-parallel, router replicated, so every rank routes identically, and
one all-reduce after routed + shared outputs are summed. Not expert parallelism (each rank owning
whole experts): that needs an all-to-all of tokens and its speed hangs on the routing's balance,
while intermediate sharding splits each expert's work evenly whatever the routing, reuses the
dense MLP's sharding and costs the same single all-reduce per layer as a dense MLP.

Checkpoint names (`checkpoint_tensors`, which the families' mappings apply): the layer's modules
under the names Mixtral (block_sparse_moe, w1/w3/w2), DeepSeek (shared_experts) and gpt-oss (router)
store them, and fused 3D expert tensors split into per-expert gate/up/down.

Expert activation is pluggable: `EXPERT_ACTIVATIONS[name](gate_up, x, moe)` returns the input of
`down_proj`; the gated SiLU/GELU of the dense MLP are registered here, gpt-oss's clamped SwiGLU (with
`expert_bias`) registers itself from its family module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend.ops import cpu_ops

from backend import ops

from backend.worker import parallel_state
from backend.errors import EngineError
from backend.layers.activation import gated_activation
from backend.layers.sharding import Part, output_rows, packed, row_parallel
from backend.worker.parallel_state import ParallelState

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
# The C++ kernel runs while the (token, expert) pairs are at most this many per expert on average
# (32 tokens at 8 experts top-2); above, one oneDNN GEMM per expert is faster: its AMX tiles beat the
# kernel's dot products once an expert has rows enough (`tools/bench_moe.py --num-tokens` measures both).
CPU_KERNEL_MAX_PAIRS_PER_EXPERT = 8


@dataclass
class MoEArgs:
    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    sparse_layers: tuple[bool, ...]  # per layer: True runs the MoE, False the dense MLP (ModelArgs.intermediate_size)
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    num_groups: int = 1  # DeepSeek n_group / topk_group: experts chosen only from the best groups
    topk_groups: int = 1
    correction_bias: bool = False  # DeepSeek e_score_correction_bias (added for the choice only)
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # gpt-oss
    router_float32: bool = False  # DeepSeek: router logits computed in float32 whatever the model's dtype
    shared_intermediate_size: int = 0  # 0: no shared experts
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(x . w)
    expert_bias: bool = False  # gpt-oss: experts' linears carry biases
    activation: str = "silu"  # a key of EXPERT_ACTIVATIONS
    activation_options: dict[str, float] = field(default_factory=dict)  # e.g. gpt-oss's swiglu alpha / limit
    # The fused 3D checkpoint layout: [E, 2I, H] / [E, H, I] (transformers' in-memory layout) unless
    # transposed ([E, H, 2I] / [E, I, H], gpt-oss); gate and up halves unless interleaved (gpt-oss).
    fused_transposed: bool = False
    gate_up_interleaved: bool = False


def sparse_layers(num_layers: int, first_k_dense_replace: int = 0, decoder_sparse_step: int = 1,
                  mlp_only_layers: list[int] | tuple[int, ...] = (), moe_layer_freq: int = 1) -> tuple[bool, ...]:
    """Which layers are MoE: from `first_k_dense_replace` on (DeepSeek, every `moe_layer_freq`-th),
    every `decoder_sparse_step`-th (Qwen: layer i when (i + 1) % step == 0), never `mlp_only_layers`."""
    step = decoder_sparse_step or 1
    return tuple(i >= first_k_dense_replace and i % (moe_layer_freq or 1) == 0 and (i + 1) % step == 0
                 and i not in set(mlp_only_layers) for i in range(num_layers))


def silu_family(gate_up: nn.Module, x: torch.Tensor, moe: MoEArgs) -> torch.Tensor:
    return gated_activation(gate_up, x, moe.activation)


EXPERT_ACTIVATIONS: dict[str, Callable[[nn.Module, torch.Tensor, MoEArgs], torch.Tensor]] = {
    "silu": silu_family, "gelu_tanh": silu_family, "gelu": silu_family}


class GatedMLP(nn.Module):
    """One expert (routed or shared): down(act(gate_up(x))), without the all-reduce (the MoE layer
    reduces once for all of them)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, moe: MoEArgs, parallel: ParallelState,
                 routed: bool = False) -> None:
        super().__init__()
        self.moe, self.routed = moe, routed
        local = intermediate_size // parallel.tp_size  # sharded along the intermediate dim, as the dense MLP
        self.gate_up_proj = nn.Linear(hidden_size, 2 * local, bias=bias)
        self.down_proj = nn.Linear(local, hidden_size, bias=bias)
        gate_or_up = Part(intermediate_size, local, output_rows(parallel))
        self.weight_loaders = {"gate_up_proj": packed([gate_or_up, gate_or_up], parallel.tp_size),
                               "down_proj": row_parallel(parallel)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(EXPERT_ACTIVATIONS[self.moe.activation](self.gate_up_proj, x, self.moe))

    @property
    def keeps_linears_unpacked(self) -> bool:
        """A bfloat16 routed expert the CPU MoE kernel can run: `cpu_ops.pack_linears` leaves its
        linears as they are (the kernel reads nn.Linear's layout)."""
        return (self.routed and self.moe.activation == "silu" and not self.moe.expert_bias
                and type(self.gate_up_proj) is nn.Linear and self.gate_up_proj.weight.dtype == torch.bfloat16
                and cpu_ops.moe_kernel_available())


class Router(nn.Module):
    """Logits x . W^T (+ b) -> (weights [T, k] float32, expert ids [T, k] int64). Its parameters are
    plain tensors, not an nn.Linear, so packing and quantization leave the router as it is."""

    def __init__(self, hidden_size: int, moe: MoEArgs) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False) if moe.router_bias else None
        if moe.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if moe.router_float32:
            bias = None if self.bias is None else self.bias.float()
            logits = F.linear(x.float(), self.weight.float(), bias)
        else:
            logits = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if moe.scoring == "softmax":
            weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(moe.top_k, dim=-1)
        elif moe.scoring == "topk_softmax":
            top, ids = logits.topk(moe.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=top.dtype).float()
        else:
            scores = logits.float().sigmoid()
            choice = scores + self.e_score_correction_bias.float() if moe.correction_bias else scores
            if moe.num_groups > 1:
                grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
                best_groups = grouped.topk(2, dim=-1)[0].sum(-1).topk(moe.topk_groups, dim=-1, sorted=False)[1]
                keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device)
                keep.scatter_(1, best_groups, True)
                choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, moe.num_experts)
            ids = choice.topk(moe.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(order, counts): the flat (token, slot) pair indices sorted by expert id (stable, so each
    expert's tokens stay in order), and how many pairs each expert has."""
    flat = ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts).tolist()


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: nn.ModuleList) -> torch.Tensor:
    """sum over a token's k experts of weight * expert(x), one GEMM per expert over its tokens."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    top_k = ids.shape[1]
    order, counts = group_by_expert(ids, len(experts))
    token_of = order // top_k
    rows = x.index_select(0, token_of)
    outputs, start = [], 0
    for expert, count in zip(experts, counts):
        if count:
            outputs.append(expert(rows[start:start + count]))
            start += count
    out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    out = out * weights.reshape(-1).index_select(0, order).to(out.dtype).unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_of, out)


def per_token_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      experts: nn.ModuleList) -> torch.Tensor:
    """The naive loop the grouped path replaces (one call per token per chosen expert); the
    benchmark's baseline (`tools/bench_moe.py`)."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = experts[int(ids[token, slot])]
            out[token] += (expert(x[token:token + 1])[0] * weights[token, slot].to(x.dtype))
    return out


class SparseMoE(nn.Module):
    """The decoder layer's MLP slot on an MoE layer: router, routed experts, shared experts."""

    def __init__(self, hidden_size: int, moe: MoEArgs, parallel: ParallelState) -> None:
        super().__init__()
        if moe.scoring not in SCORINGS:
            raise EngineError("model", f"MoE scoring {moe.scoring!r} is not supported (supported: {', '.join(SCORINGS)})")
        if moe.activation not in EXPERT_ACTIVATIONS:
            raise EngineError("model", f"expert activation {moe.activation!r} is not supported "
                                       f"(supported: {', '.join(EXPERT_ACTIVATIONS)})")
        self.moe, self.parallel = moe, parallel
        self.gate = Router(hidden_size, moe)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, moe.intermediate_size, moe.expert_bias, moe, parallel,
                                              routed=True) for _ in range(moe.num_experts))
        self.shared_expert = (GatedMLP(hidden_size, moe.shared_intermediate_size, False, moe, parallel)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (w13 [E, 2I, H], w2 [E, H, I]) for the kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.routed_experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return parallel_state.all_reduce(out, self.parallel)

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over a token's k experts of weight * expert(x): on the fused Triton kernel where it
        runs, the C++ kernel for a few bfloat16 tokens on the CPU, else grouped by expert."""
        if ops.fused_moe_applies(x):
            stacked = self.stack_experts()
            if stacked is not None:
                return ops.fused_moe(x, *stacked, weights, ids)
        elif self.cpu_kernel_takes(x, ids):
            return cpu_ops.moe_experts(x, *self.stack_experts(), weights, ids)
        return grouped_experts(x, weights, ids, self.experts)

    def cpu_kernel_takes(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2 and 0 < ids.numel()
                <= CPU_KERNEL_MAX_PAIRS_PER_EXPERT * len(self.experts)
                and self.experts[0].keeps_linears_unpacked and self.stack_experts() is not None
                and self.stacked[0].dtype == torch.bfloat16)

    def stack_experts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13, w2) for the fused kernel, stacked once; the nn.Linear weights become views of the
        stacks. None where the kernel does not apply: biases, another activation, or experts that
        are no longer plain nn.Linear (quantized). Stacked again where the weights moved since (`.to()`)."""
        first = self.experts[0].gate_up_proj
        if self.stacked is not None and type(first) is nn.Linear and first.weight.data_ptr() == self.stacked[0].data_ptr():
            return self.stacked
        if self.moe.activation != "silu" or self.moe.expert_bias or not all(
                type(e.gate_up_proj) is nn.Linear and type(e.down_proj) is nn.Linear for e in self.experts):
            return None
        w13 = torch.stack([e.gate_up_proj.weight.detach() for e in self.experts])
        w2 = torch.stack([e.down_proj.weight.detach() for e in self.experts])
        for index, expert in enumerate(self.experts):
            expert.gate_up_proj.weight = nn.Parameter(w13[index], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(w2[index], requires_grad=False)
        self.stacked = (w13, w2)
        return self.stacked


# -- checkpoint names ----------------------------------------------------------------------------------
RENAMES = {"block_sparse_moe": "mlp", "shared_experts": "shared_expert", "router": "gate",
           "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral, DeepSeek, gpt-oss -> ours
FUSED_EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def checkpoint_tensors(name: str, tensor: torch.Tensor, moe: MoEArgs) -> list[tuple[str, Any]]:
    """An MoE checkpoint tensor under the names the dense loader knows: Mixtral's block_sparse_moe /
    w1 w3 w2, DeepSeek's shared_experts and gpt-oss's router renamed, and the fused 3D expert tensors
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], their biases) split
    into per-expert gate_proj / up_proj / down_proj, which each expert's loaders shard and pack as a
    dense MLP's."""
    parts = name.split(".")
    if "layers" not in parts or len(parts) < 4:
        return [(name, tensor)]
    head = parts.index("layers") + 2  # model.layers.{i}.<block>...
    if parts[head] not in ("mlp", "block_sparse_moe"):
        return [(name, tensor)]
    parts = parts[:head] + [RENAMES.get(p, p) if i < 4 else p for i, p in enumerate(parts[head:])]
    if parts[-2] == "experts" and parts[-1] in FUSED_EXPERT_TENSORS:
        return split_fused_experts(".".join(parts[:-1]), parts[-1], tensor, moe)
    return [(".".join(parts), tensor)]


def split_fused_experts(prefix: str, kind: str, tensor: torch.Tensor, moe: MoEArgs) -> list[tuple[str, Any]]:
    if tensor.shape[0] != moe.num_experts:
        raise EngineError("model", f"{prefix}.{kind}: {tensor.shape[0]} experts, the config says {moe.num_experts}")
    suffix = "bias" if kind.endswith("_bias") else "weight"
    pieces = []
    for expert, weight in enumerate(tensor):
        if moe.fused_transposed and suffix == "weight":
            weight = weight.t()
        base = f"{prefix}.{expert}"
        if kind.startswith("down_proj"):
            pieces.append((f"{base}.down_proj.{suffix}", weight.contiguous()))
            continue
        gate, up = (weight[0::2], weight[1::2]) if moe.gate_up_interleaved else weight.chunk(2, dim=0)
        pieces += [(f"{base}.gate_proj.{suffix}", gate.contiguous()), (f"{base}.up_proj.{suffix}", up.contiguous())]
    return pieces
