"""A peft LoRA adapter folder (adapter_config.json + adapter_model.safetensors) read and checked:
each adapted module's A [r, in] and B [out, r] and its scaling (lora_alpha / r, or / sqrt(r) with
rsLoRA; `alpha_pattern` and `rank_pattern` apply per module). Anything this engine cannot apply
(DoRA, biases, modules_to_save, embeddings) is refused with an EngineError naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.errors import EngineError, check

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class Adapter:
    """module path (as in the base checkpoint, e.g. `model.layers.3.self_attn.q_proj`) -> A, B;
    shapes only (`tensors` empty) when read with load=False."""
    path: str
    rank: int  # the largest rank of any module
    scaling: dict[str, float] = field(default_factory=dict)
    shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: the first key that matches the module's name end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_adapter(path: str, load: bool) -> Adapter:
    folder = Path(path)
    check(folder.is_dir(), "lora_path", "is not a folder", path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    check(config_file.is_file(), "lora_path", f"holds no {CONFIG_FILE} (a peft LoRA adapter folder)", path)
    check(weights_file.is_file(), "lora_path", f"holds no {WEIGHTS_FILE} (pickled .bin adapters are never loaded)",
          path)
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise EngineError("lora_path", f"{CONFIG_FILE} is unreadable ({error})", value=path) from None
    check(isinstance(config, dict) and config.get("peft_type", "LORA") == "LORA", "lora_path",
          "is not a LoRA adapter (peft_type)", path)
    for key, ok in (("use_dora", not config.get("use_dora")), ("bias", config.get("bias", "none") == "none"),
                    ("lora_bias", not config.get("lora_bias")), ("modules_to_save", not config.get("modules_to_save")),
                    ("fan_in_fan_out", not config.get("fan_in_fan_out"))):
        check(ok, "lora_path", f"adapter_config {key}={config.get(key)!r} is not supported", path)
    alpha = config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora"))

    from safetensors import safe_open

    adapter = Adapter(str(folder), 0)
    halves: dict[str, dict[str, torch.Tensor | list[int]]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as weights:
            for name in weights.keys():
                match = _TENSOR.match(name)
                check(match is not None, "lora_path", "holds a tensor that is no LoRA A or B weight "
                      "(embeddings and biases are not supported)", name)
                module = match.group("module").removeprefix(PEFT_PREFIX)
                value = weights.get_tensor(name) if load else list(weights.get_slice(name).get_shape())
                halves.setdefault(module, {})[match.group("which")] = value
    except EngineError:
        raise
    except Exception as error:  # a corrupt file: say which
        raise EngineError("lora_path", f"{WEIGHTS_FILE} is unreadable ({error})", value=path) from None
    check(bool(halves), "lora_path", "holds no LoRA weights", path)
    for module, pair in sorted(halves.items()):
        check(set(pair) == {"A", "B"}, "lora_path", "lacks lora_A or lora_B of a module", module)
        a, b = pair["A"], pair["B"]
        a_shape = tuple(a.shape) if isinstance(a, torch.Tensor) else tuple(a)
        b_shape = tuple(b.shape) if isinstance(b, torch.Tensor) else tuple(b)
        check(len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] == b_shape[1], "lora_path",
              f"lora_A {list(a_shape)} and lora_B {list(b_shape)} of {module} do not chain", path)
        module_rank = a_shape[0]
        module_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)  # rank: from the shapes
        adapter.scaling[module] = module_alpha / (math.sqrt(module_rank) if rslora else module_rank)
        adapter.shapes[module] = (a_shape, b_shape)
        adapter.rank = max(adapter.rank, module_rank)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            adapter.tensors[module] = (a, b)
    return adapter
