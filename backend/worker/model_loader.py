"""Model loading: the checkpoint's config.json, the device and dtype to run in, and `load_model`,
which builds the network, loads its safetensors weights, quantizes and (on a CPU) packs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from backend.ops import cpu_ops

from backend import quantization
from backend.config import EngineConfig
from backend.errors import EngineError
from backend import models
from backend.models import ModelArgs
from backend.models.loading import load_weights
from backend.worker.parallel_state import ParallelState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def load_hf_config(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise EngineError("model", f"{model_path!r} is not a Hugging Face model folder (no config.json)")
    config = json.loads(path.read_text(encoding="utf-8"))
    models.architecture(config)  # an unknown architecture fails here, naming the supported ones
    return config


def model_args(hf_config: dict) -> ModelArgs:
    """The network's shape and options from its config.json (the registry picks the family)."""
    return models.model_args(hf_config)


def iterate_safetensors(model_path: str):
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise EngineError("model", f"no .safetensors files in {model_path!r} (pickle checkpoints are never loaded)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(config: EngineConfig, model_path: str, hf_config: dict, parallel: ParallelState,
               quant: quantization.QuantConfig | None, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """This rank's shard of the model: built on the meta device, its weights loaded straight onto
    `device`, cast to `dtype`, quantized (load-time methods) and, on a CPU, packed for the CPU kernels."""
    with torch.device("meta"):
        model = models.build_model(model_args(hf_config), parallel)
        quantization.prepare(model, quant, model_path, dtype)
    model = model.to_empty(device=device)
    model.post_init()
    load_weights(model, quantization.iterate_weights(model_path, quant, hf_config) or iterate_safetensors(model_path))
    model = model.to(dtype).eval()
    quantization.quantize_loaded(model, quant)  # before pack_linears: not nn.Linear then
    if device.type == "cpu":
        cpu_ops.pack_linears(model, config.max_num_seqs)
    return model
