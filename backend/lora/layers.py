"""The model side of multi-LoRA: the projections wrapped so they add each token's adapter delta,
the adapters' weights in `max_loras` slots (an LRU), and the step's token-to-slot layout.

Model-agnostic: after a model is built and loaded, every child module named like a projection LoRA
targets (fused `qkv_proj` / `gate_up_proj` and plain `o_proj` / `down_proj`, or unfused q/k/v/gate/up
where a family keeps them apart) is wrapped in a `LoRALinear`. peft names its modules as the
checkpoint does; `model.FUSED` maps q/k/v (gate/up) to slices of the fused outputs, and
`model.local_name` maps checkpoint names to the model's own.

A wrapped layer holds, per slot, A as [slices * max_lora_rank, in] and B as [out, slices * max_lora_rank]:
each slice of a fused output takes its own block of rank columns (B is block-diagonal), packed from
column 0, the rest zero; the scaling is folded into B. So one shrink and one expand per adapter serve
q, k and v at once.

The CPU path serves every adapter of a step in one shrink and one expand per layer: the slots the
step uses are adjacent rows of `lora_a` (a view: [slots * ranks, in]), so x @ that^T gives each token
every slot's shrink; a 0/1 mask keeps each token's own slot's columns, and one addmm with B^T
stacked the same way ([slots * ranks, out], kept beside B) adds the deltas. The extra columns cost
(slots - 1) x a rank-r product per token, far less than the base projection; what it saves is the
two small GEMMs per adapter per layer, whose fixed cost dominates on a CPU (the bench_lora figures
in docs/lora.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

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
    _masks: dict = field(default_factory=dict)

    @property
    def span(self) -> tuple[int, int]:
        """The tokens from the first adapter token to the last (those of no adapter between them
        get a zero mask row)."""
        return self.segments[0][0], max(end for _, end, _ in self.segments)

    @property
    def slot_range(self) -> tuple[int, int]:
        slots = [slot for _, _, slot in self.segments]
        return min(slots), max(slots) + 1

    def mask(self, ranks: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[span tokens, slots in range * ranks]: 1 where a column belongs to the token's own slot.
        Built once per step for each (ranks, dtype) and shared by the layers."""
        key = (ranks, dtype)
        if key not in self._masks:
            first, end = self.span
            low, high = self.slot_range
            mask = torch.zeros(end - first, (high - low) * ranks, dtype=dtype)
            for start, stop, slot in self.segments:
                mask[start - first:stop - first, (slot - low) * ranks:(slot - low + 1) * ranks] = 1
            self._masks[key] = mask.to(device)
        return self._masks[key]

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
        # The CPU path's copy of B, transposed: [slots, ranks, out], so adjacent slots stack.
        self.lora_bt = (torch.zeros(max_loras, ranks, self.out_features, dtype=dtype)
                        if weight.device.type == "cpu" else None)
        self.ranks_used = [0] * max_loras  # per slot: the rank columns filled (slices packed from 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.context.batch
        if batch is not None:
            ops.add_lora(out, x, self.lora_a, self.lora_b, batch, self.lora_bt)
        return out

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if self.lora_bt is not None:
            self.lora_bt[slot].zero_()
        self.ranks_used[slot] = 0

    def set_slice(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Slice `index` of the output gets A [r, in] and B * scaling [slice out, r], in the next r
        rank columns of the slot."""
        start, rank = self.ranks_used[slot], a.shape[0]
        offset = sum(self.output_sizes[:index])
        self.lora_a[slot, start:start + rank].copy_(a)
        self.lora_b[slot, offset:offset + self.output_sizes[index], start:start + rank].copy_(b.float() * scaling)
        self.ranks_used[slot] = start + rank
        if self.lora_bt is not None:
            self.lora_bt[slot].copy_(self.lora_b[slot].T)


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
        self.fused = getattr(model, "FUSED", DEFAULT_FUSED)
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
