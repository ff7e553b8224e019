"""The generic checkpoint loader: (name, tensor) pairs in, every parameter of this rank filled. It
knows no family's names. The model supplies them:

- `checkpoint_names(name, tensor)`: the family's renames and splits (a mixture of experts' names and
  fused 3D expert tensors, `layers/moe.py`), as (name, tensor) pairs under the decoder's names;
- `local_name(name)`: this pipeline stage's parameter name, or None for another stage's weight;
- `packed_modules_mapping`: checkpoint layers the model packs into one (q_proj -> (qkv_proj, 0));
- `weight_loaders` on its layers: how each parameter takes its tensor on this tensor rank
  (`layers/sharding.py`); a whole copy where a layer names none.

Loaders live on the layers, not on the parameters as in nano-vllm: the model is built on the meta
device and `to_empty` makes new parameters, and quantization swaps a layer's children before the
weights load, while the layer that names the loader stays.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from backend.layers.sharding import WeightLoader, copy_whole


def weight_loader(model: nn.Module, name: str) -> WeightLoader:
    """Parameter `name`'s loader: the one its own layer names for it, or its parent names for that
    layer (an attention block for its qkv_proj, whatever module the qkv_proj is now)."""
    module_path, _, leaf = name.rpartition(".")
    parent_path, _, child = module_path.rpartition(".")
    for path, key in ((module_path, leaf), (parent_path, child)):
        loaders = getattr(model.get_submodule(path), "weight_loaders", {})
        if key in loaders:
            return loaders[key]
    return copy_whole


def packed_target(name: str, mapping: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """(parameter name, part) for a checkpoint layer the model packs into another, else (name, None)."""
    *module, layer, tensor = name.split(".")
    if layer not in mapping:
        return name, None
    target, part = mapping[layer]
    return ".".join([*module, target, tensor]), part


def kv_cache_scale(name: str) -> tuple[str, list[str]] | None:
    """An 8-bit KV cache's scale in a checkpoint, under the names vLLM reads (`self_attn.k_scale`,
    `self_attn.k_proj.k_scale`, the older `kv_scale` for both): (the attention block's path, its
    attributes), else None."""
    *path, leaf = name.split(".")
    if leaf not in ("k_scale", "v_scale", "kv_scale") or "self_attn" not in path:
        return None
    path = path[:path.index("self_attn") + 1]
    return ".".join(path), ["k_scale", "v_scale"] if leaf == "kv_scale" else [leaf]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill `model`'s parameters from a checkpoint's (name, tensor) pairs, then let layers rework
    what they loaded (`after_load`). Refuses a tensor no parameter takes and a parameter no tensor
    fills."""
    params = dict(model.named_parameters())
    mapping = model.packed_modules_mapping
    num_parts = Counter(target for target, _ in mapping.values())
    loaded: dict[str, set[int | None]] = {}
    for checkpoint_name, checkpoint_tensor in weights:
        for name, tensor in model.checkpoint_names(checkpoint_name, checkpoint_tensor):
            local = model.local_name(name)
            if local is None:
                continue
            if kv_scale := kv_cache_scale(local):
                for attribute in kv_scale[1]:  # a float on the attention block, not a parameter
                    setattr(model.get_submodule(kv_scale[0]), attribute, float(tensor))
                continue
            target, part = packed_target(local, mapping)
            if target not in params:
                raise ValueError(f"unexpected weight {local!r} in checkpoint")
            try:
                with torch.no_grad():
                    weight_loader(model, target)(params[target], tensor, part)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            loaded.setdefault(target, set()).add(part)

    def complete(name: str) -> bool:
        parts = loaded.get(name)
        if parts is None:
            return False
        packed_layer = name.split(".")[-2] if "." in name else ""
        return None in parts or len(parts) == num_parts.get(packed_layer, 0)

    missing = [name for name in params if not complete(name)]
    if missing:
        raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "after_load"):  # a layer reworking its loaded weights (MLA's rope rows)
                module.after_load()
