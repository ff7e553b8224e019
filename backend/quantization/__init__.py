"""Quantized weights: AWQ and GPTQ checkpoints (`awq.py`, `gptq.py`, run by `linear.IntLinear`),
GGUF files in their block formats (`gguf.py`), and float checkpoints quantized as they load to
FP8 (`fp8.py`) or INT8 (`int8.py`). The model runner calls, in order:

    detect(hf_config, option)              -> QuantConfig, or None for a float model
    kv_cache_dtype(option, dtype)          the KV cache's element type ("fp8": float8 E4M3, "fp8_e5m2")
    prepare(model, quant, path, dtype)     on the meta-device model, before the weights load: the
                                           checkpoint's quantized layers replace nn.Linear / nn.Embedding
    iterate_weights(path, quant, config)   the GGUF file's weights (None: read the safetensors)
    quantize_loaded(model, quant)          after the weights load and the model took its dtype:
                                           repack AWQ/GPTQ, quantize the float linears for fp8 / int8

The decoder's linear layers are quantized (a mixture of experts' experts too, with fp8 / int8; its
quantized checkpoints are refused for now); the embeddings and lm_head stay as the checkpoint has
them (float, or GGUF blocks).
"""

from __future__ import annotations

import torch
from torch import nn

from backend.config import QUANTIZATION_METHODS as METHODS  # the one list, beside EngineConfig
from backend.errors import EngineError
from backend.quantization import awq, gguf, gptq
from backend.quantization.config import LOAD_TIME_METHODS, QuantConfig, detect
from backend.quantization.fp8 import KV_CACHE_DTYPES, Fp8Linear, kv_cache_dtype
from backend.quantization.int8 import Int8Linear
from backend.quantization.linear import IntLinear

__all__ = ["KV_CACHE_DTYPES", "METHODS", "QuantConfig", "detect", "iterate_weights", "kv_cache_dtype", "prepare",
           "quantize_loaded", "weight_bytes"]

LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, module) for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in LINEAR_NAMES and isinstance(module, nn.Linear)]


def prepare(model: nn.Module, quant: QuantConfig | None, model_path: str, dtype: torch.dtype) -> None:
    """Swap in the checkpoint's quantized layers (call inside the meta-device context)."""
    if quant is None or quant.method in LOAD_TIME_METHODS:
        return
    if getattr(model.args, "moe", None) is not None:  # expert tensors' names and layouts differ per format
        raise EngineError("quantization", f"{quant.method} checkpoints of mixture-of-experts models are not supported "
                                          f"yet; int8 and fp8 quantize a float MoE checkpoint at load")
    if quant.method == "gguf":
        for name, qtype in gguf.block_types(gguf.gguf_file(model_path), model.args.tie_word_embeddings).items():
            old = model.get_submodule(name)
            if isinstance(old, nn.Embedding):
                new = gguf.GGUFEmbedding(old.num_embeddings, old.embedding_dim, qtype, dtype)
            else:
                new = gguf.GGUFLinear(old.in_features, old.out_features, old.bias is not None, qtype)
            model.set_submodule(name, new)
        return
    layout = awq if quant.method == "awq" else gptq
    for name, linear in decoder_linears(model):
        model.set_submodule(name, IntLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                            quant, layout))


def iterate_weights(model_path: str, quant: QuantConfig | None, hf_config: dict):
    """The checkpoint's (name, tensor) pairs when they don't come from safetensors (GGUF), else None."""
    if quant is None or quant.method != "gguf":
        return None
    num_heads = hf_config["num_attention_heads"]
    return gguf.iterate_weights(model_path, num_heads, hf_config.get("num_key_value_heads") or num_heads,
                                hf_config.get("tie_word_embeddings", False))


@torch.no_grad()
def quantize_loaded(model: nn.Module, quant: QuantConfig | None) -> None:
    """Finish the quantized layers once the weights are in and the model has its dtype."""
    if quant is None:
        return
    for module in model.modules():
        if isinstance(module, IntLinear):
            module.finish_loading()
    if quant.method in LOAD_TIME_METHODS:
        quantized = Fp8Linear if quant.method == "fp8" else Int8Linear
        for name, linear in decoder_linears(model):
            model.set_submodule(name, quantized(linear))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (each shared tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
