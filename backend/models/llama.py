"""The Llama-shaped families: pre-norm RMSNorm decoders with SwiGLU, differing in biases, q/k norms
and scalings. Llama 2/3 (SmolLM), Mistral (a sliding window on every layer), Qwen2 (q/k/v
biases), Qwen3 (per-head q/k norms), Granite (embedding, attention, residual and logits
multipliers).

Checkpoint names, which every family reading its config through `dense_args` shares unless it says
otherwise: q/k/v packed into qkv_proj and gate/up into gate_up_proj (`PACKED_MODULES`), the RoPE
tables older checkpoints saved skipped, a mixture of experts' names through `layers/moe.py`."""

from __future__ import annotations

from typing import Any

import torch

from backend.models.decoder import ModelArgs
from backend.layers.activation import activation_name
from backend.layers.moe import checkpoint_tensors as moe_checkpoint_tensors
from backend.layers.rotary import rope_parameters

PACKED_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def checkpoint_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, Any]]:
    """A checkpoint tensor under the decoder's names: as stored, but for the RoPE tables older
    checkpoints saved (`rotary_emb.inv_freq`, computed here instead) and a mixture of experts' names."""
    if "rotary_emb" in name:
        return []
    return [(name, tensor)] if args.moe is None else moe_checkpoint_tensors(name, tensor, args.moe)


def sliding_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window: `layer_types` where the config lists them, else every layer's the same."""
    window = config.get("sliding_window")
    if not window or not config.get("use_sliding_window", True):
        return ()
    types = config.get("layer_types")
    if types:
        windows = tuple(window if t == "sliding_attention" else None for t in types[:num_layers])
        return windows if any(windows) else ()
    return (window,) * num_layers


def dense_args(config: dict[str, Any], **options: Any) -> ModelArgs:
    """The fields every family reads the same way from a Hugging Face config; `options` set the rest."""
    num_heads = config["num_attention_heads"]
    num_layers = config["num_hidden_layers"]
    bias = config.get("attention_bias", False)
    fields = dict(
        architecture=(config.get("architectures") or ["?"])[0],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        rope=rope_parameters(config),
        sliding_windows=sliding_windows(config, num_layers),
        activation=activation_name(config.get("hidden_act", "silu")),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=config.get("mlp_bias", False),
    )
    fields.update(options)
    fields.setdefault("packed_modules_mapping", PACKED_MODULES)
    fields.setdefault("checkpoint_names", checkpoint_tensors)
    return ModelArgs(**fields)


def llama(config: dict[str, Any]) -> ModelArgs:
    return dense_args(config)


def qwen2(config: dict[str, Any]) -> ModelArgs:
    return dense_args(config, qkv_bias=True, o_bias=False)


def qwen3(config: dict[str, Any]) -> ModelArgs:
    return dense_args(config, qk_norm="head")


def granite(config: dict[str, Any]) -> ModelArgs:
    return dense_args(config, attention_scale=config.get("attention_multiplier", 1.0),
                      embed_multiplier=config.get("embedding_multiplier", 1.0),
                      residual_multiplier=config.get("residual_multiplier", 1.0),
                      logits_divisor=config.get("logits_scaling", 1.0))


ARCHITECTURES = {"LlamaForCausalLM": llama, "MistralForCausalLM": llama, "Qwen2ForCausalLM": qwen2,
                 "Qwen3ForCausalLM": qwen3, "GraniteForCausalLM": granite}
