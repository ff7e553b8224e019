"""The model side of multi-LoRA: the projections wrapped so they add each token's adapter delta,
the adapters' weights in `max_loras` slots (an LRU), and the step's token-to-slot layout.

Model-agnostic: after a model is built and loaded, every child module named like a projection LoRA
targets (fused `qkv_proj` / `gate_up_proj` and plain `o_proj` / `down_proj`, or unfused q/k/v/gate/up
where a family keeps them apart) is wrapped in a `LoRALinear`. peft names its modules as the
checkpoint does; `model.packed_modules_mapping` maps q/k/v (gate/up) to slices of the fused outputs, and
`model.local_name` maps checkpoint names to the model's own.

A wrapped layer holds, per slot, A as [slices * max_lora_rank, in] and B as [out, slices * max_lora_rank]:
each slice of a fused output takes its own block of rank columns (B is block-diagonal), packed from
column 0, the rest zero; the scaling is folded into B. So one shrink and one expand per adapter serve
q, k and v at once.

On the CPU a step of up to `ops.LORA_KERNEL_TOKENS` adapter tokens (a decode) runs every adapter's
delta in one call of a C++ kernel (backend/csrc/cpu_lora.cpp: shrink, then expand, on AVX512-BF16
dot products in bfloat16) over its own copies of the weights (A^T, B^T, rank columns padded to
whole vectors, pair-packed for the dot products); larger steps (prefills) run two GEMMs per
segment, where oneDNN's GEMMs (AMX where the CPU has it) run at full speed. Only the rank columns
some segment's slot fills are multiplied. The kernel beats two batched torch GEMMs per projection at
decode sizes, where oneDNN's fixed cost per call dominates (`python -m tools.bench_lora`; the
figures are in docs/benchmarks.md).
"""

from __future__ import annotations

from collections import OrderedDict
import functools
from dataclasses import dataclass

import torch
from torch import nn

from backend.ops import cpu_ops

from backend import ops
from backend.errors import EngineError, check
from backend.lora import LoRARequest
from backend.lora.adapter import Adapter, read_adapter

TARGET_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
DEFAULT_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass
class LoRABatch:
    """A step's tokens by adapter: `segments` are (first token, end, slot) runs of consecutive tokens
    sharing an adapter (the runner lays a step out sorted by slot, so each adapter is one or two
    runs); tokens of no adapter are in none. The same as int32 tensors for the kernel."""
    segments: list[tuple[int, int, int]]
    starts: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    max_length: int

    @functools.cached_property
    def cpu_segments(self) -> torch.Tensor:
        """The segments as [n, 3] int64 (first token, tokens, slot) for the CPU kernel."""
        return torch.tensor([[start, end - start, slot] for start, end, slot in self.segments], dtype=torch.int64)

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(end - start for start, end, _ in self.segments)

    @classmethod
    def build(cls, rows: list[tuple[int, int]], device: torch.device) -> "LoRABatch | None":
        """rows: (number of tokens, slot or -1) per request, in the step's token order."""
        segments: list[list[int]] = []
        start = 0
        for num_tokens, slot in rows:
            if slot >= 0 and segments and segments[-1][2] == slot and segments[-1][1] == start:
                segments[-1][1] += num_tokens
            elif slot >= 0:
                segments.append([start, start + num_tokens, slot])
            start += num_tokens
        if not segments:
            return None
        table = torch.tensor([[s, e - s, slot] for s, e, slot in segments], dtype=torch.int32).T.contiguous()
        table = table.to(device)
        return cls([(s, e, slot) for s, e, slot in segments], table[0], table[1], table[2],
                   max(e - s for s, e, _ in segments))


class LoRAContext:
    """The step's LoRABatch, shared by every LoRALinear of one model. The runner sets `batch` before
    each forward and the layers read it. Why not an argument: passing it down through `forward`
    would put LoRA into every model family's file, for a value that changes once per step. Why not
    a global: each runner (a draft model's too) owns its own context, and nothing else writes it."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """base(x) plus, for the tokens of an adapter, that adapter's delta."""

    def __init__(self, base: nn.Module, output_sizes: list[int], max_loras: int, max_rank: int,
                 context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.in_features = base.in_features
        self.out_features = sum(output_sizes)
        self.output_sizes = output_sizes
        self.max_rank = max_rank
        weight = next(p for p in base.parameters())
        dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
        ranks = len(output_sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, ranks, self.in_features, dtype=dtype,
                                                   device=weight.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, ranks, dtype=dtype,
                                                   device=weight.device), persistent=False)
        # The CPU kernel's copies (small steps): A^T [slots, in, width], B^T [slots, width, out], the
        # rank columns padded to whole vectors, in pairs for the bfloat16 dot products where it has them.
        self.kernel_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pairs = cpu_ops.lora_pairs(dtype) and self.in_features % 2 == 0
        if weight.device.type == "cpu" and dtype in cpu_ops.SUFFIXES and self.out_features % 16 == 0:
            width = -(-ranks // 16) * 16
            self.kernel_weights = (torch.zeros(max_loras, self.in_features, width, dtype=dtype),
                                   torch.zeros(max_loras, width, self.out_features, dtype=dtype))
        self.ranks_used = [0] * max_loras  # per slot: the rank columns filled (slices packed from 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.context.batch
        if batch is None:
            return out
        if out.device.type != "cpu":
            ops.add_lora(out, x, self.lora_a, self.lora_b, batch)
            return out
        ranks = max(self.ranks_used[slot] for _, _, slot in batch.segments)  # the columns any slot fills
        if ranks:
            ops.add_lora_cpu(out, x, self.lora_a, self.lora_b, batch, ranks, self.kernel_weights, self.pairs)
        return out

    def clear_slot(self, slot: int) -> None:
        for weights in (self.lora_a, self.lora_b, *(self.kernel_weights or ())):
            weights[slot].zero_()
        self.ranks_used[slot] = 0

    def set_slice(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Slice `index` of the output gets A [r, in] and B * scaling [slice out, r], in the next r
        rank columns of the slot."""
        start, rank = self.ranks_used[slot], a.shape[0]
        offset = sum(self.output_sizes[:index])
        self.lora_a[slot, start:start + rank].copy_(a)
        self.lora_b[slot, offset:offset + self.output_sizes[index], start:start + rank].copy_(b.float() * scaling)
        self.ranks_used[slot] = start + rank
        if self.kernel_weights is not None:
            at, bt = self.kernel_weights
            a_t, b_t = torch.zeros_like(at[slot]), torch.zeros_like(bt[slot])
            a_t[:, :self.lora_a.shape[1]], b_t[:self.lora_b.shape[2]] = self.lora_a[slot].T, self.lora_b[slot].T
            if self.pairs:  # pair-packed along the sums: in for A^T, the rank columns for B^T
                a_t, b_t = cpu_ops.pack_pairs(a_t), cpu_ops.pack_pairs(b_t)
            at[slot].copy_(a_t.view(at.shape[1:]))
            bt[slot].copy_(b_t.view(bt.shape[1:]))


def output_sizes(parent: nn.Module, name: str, module: nn.Module, fused: dict) -> list[int]:
    """The slices of a (possibly fused) projection's output: `output_sizes` where the layer says,
    q/kv sizes from the attention module for qkv, else equal parts."""
    if getattr(module, "output_sizes", None):
        return list(module.output_sizes)
    num_slices = sum(1 for target, _ in fused.values() if target == name) or 1
    if num_slices == 3 and hasattr(parent, "q_size") and hasattr(parent, "kv_size"):
        return [parent.q_size, parent.kv_size, parent.kv_size]
    return [module.out_features // num_slices] * num_slices


class LoRAModel:
    """The adapters of one model: wraps its projections, checks adapters against them and keeps
    up to `max_loras` loaded, evicting the least recently used one not needed by the step."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_lora_rank
        self.context = LoRAContext()
        self.fused = getattr(model, "packed_modules_mapping", DEFAULT_FUSED)
        self.layers: dict[str, LoRALinear] = {}
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if name in TARGET_NAMES and hasattr(child, "in_features") and hasattr(child, "out_features"):
                    layer = LoRALinear(child, output_sizes(parent, name, child, self.fused), max_loras,
                                       max_lora_rank, self.context)
                    setattr(parent, name, layer)
                    self.layers[f"{parent_name}.{name}" if parent_name else name] = layer
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._checked: dict[int, str] = {}  # lora_int_id -> the path checked for it

    def _target(self, module: str) -> tuple[LoRALinear, int] | None:
        """A peft module path (the checkpoint's name) -> (our layer, slice), None on another stage."""
        local_name = getattr(self.model, "local_name", None)
        local = local_name(module + ".weight") if local_name else module.removeprefix("model.") + ".weight"
        if local is None:
            return None
        path = local.removesuffix(".weight")
        if path in self.layers:
            return self.layers[path], 0
        parent, _, leaf = path.rpartition(".")
        if leaf in self.fused:
            target, index = self.fused[leaf]
            key = f"{parent}.{target}" if parent else target
            if key in self.layers:
                return self.layers[key], index
        raise EngineError("lora_path", "adapts a module LoRA cannot serve on this model "
                          f"(supported: {', '.join(TARGET_NAMES)})", value=module)

    def _validate(self, lora: LoRARequest, adapter: Adapter) -> None:
        check(adapter.rank <= self.max_rank, "lora_path",
              f"adapter {lora.lora_name!r} has rank {adapter.rank}, over max_lora_rank ({self.max_rank})",
              lora.lora_path)
        for module, (a_shape, b_shape) in adapter.shapes.items():
            target = self._target(module)
            if target is None:
                continue
            layer, index = target
            out_features = layer.output_sizes[index]
            check(a_shape[1] == layer.in_features and b_shape[0] == out_features, "lora_path",
                  f"adapter {lora.lora_name!r}: {module} has lora_A {list(a_shape)} and lora_B {list(b_shape)}, "
                  f"which do not fit the model's projection ({layer.in_features} in, {out_features} out)",
                  lora.lora_path)

    def check(self, lora: LoRARequest) -> None:
        """Raise EngineError unless the adapter can be served (read once per id: its shapes only)."""
        if self._checked.get(lora.lora_int_id) == lora.lora_path:
            return
        self._validate(lora, read_adapter(lora.lora_path, load=False))
        self._checked[lora.lora_int_id] = lora.lora_path

    def activate(self, loras: list[LoRARequest]) -> dict[int, int]:
        """Load the step's adapters into slots (evicting the least recently used others);
        returns lora_int_id -> slot. The scheduler never puts more than max_loras in one step."""
        needed = {lora.lora_int_id: lora for lora in loras}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step holds {len(needed)} adapters, more than max_loras ({self.max_loras})")
        for lora_id, lora in needed.items():
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
                continue
            if len(self.slots) < self.max_loras:
                slot = min(set(range(self.max_loras)) - set(self.slots.values()))
            else:
                victim = next(i for i in self.slots if i not in needed)
                slot = self.slots.pop(victim)
            self._load(lora, slot)
            self.slots[lora_id] = slot
        return {lora_id: self.slots[lora_id] for lora_id in needed}

    def _load(self, lora: LoRARequest, slot: int) -> None:
        adapter = read_adapter(lora.lora_path, load=True)
        self._validate(lora, adapter)
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for module, (a, b) in adapter.tensors.items():
            target = self._target(module)
            if target is not None:
                layer, index = target
                layer.set_slice(slot, index, a, b, adapter.scaling[module])
