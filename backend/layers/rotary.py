"""Rotary position embeddings: the inverse frequencies of each `rope_type` Hugging Face defines
(default, linear, dynamic, llama3, yarn, longrope), a partial rotary dimension, and the cos/sin
tables the model indexes by position. Numerics follow Hugging Face's (float32 tables, scaled by the
type's attention factor, cast to the activation dtype), so float32 tokens match.

Two types change with the sequence in Hugging Face: "dynamic" rescales only past
max_position_embeddings, which the engine never reaches, so it is "default" here; "longrope" uses
its short factors up to original_max_position_embeddings and its long ones past it. Hugging Face
picks one set for a whole forward pass by its longest position, so a prompt already longer than the
original context is rotated with the long factors throughout there; here each position picks its
own (the same tokens for prompts within the original context, as generation crosses it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from backend import ops

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """A Hugging Face config's RoPE settings as one dict with rope_type and rope_theta, whichever
    way the config spells them (v5's `rope_parameters`, possibly per layer type; v4's `rope_theta`
    beside `rope_scaling`; Phi-3's top-level partial_rotary_factor and original context)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    per_layer_type = layer_type is not None and layer_type in params
    params = dict(params[layer_type] if per_layer_type else params)
    if "rope_theta" in config and not per_layer_type:  # v4: the top-level base, rope_scaling beside it
        params["rope_theta"] = config["rope_theta"]
    params.setdefault("rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if config.get(key) is not None and key not in params:
            params[key] = config[key]
    if params["rope_type"] not in ROPE_TYPES:
        raise NotImplementedError(f"rope_scaling type {params['rope_type']!r} is not supported "
                                  f"(supported: {', '.join(ROPE_TYPES)})")
    return params


def rotary_dim(params: dict[str, Any], head_dim: int) -> int:
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def inverse_frequencies(params: dict[str, Any], head_dim: int, max_position_embeddings: int,
                        long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, attention factor). `long`: longrope's long factors."""
    dim = rotary_dim(params, head_dim)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = params["rope_type"]
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    if rope_type == "yarn":
        return _yarn(params, dim, base, factor, original)
    # longrope
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** exponents), attention_factor


def _yarn(params: dict[str, Any], dim: int, base: float, factor: float, original: int) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def rope_tables(params: dict[str, Any], head_dim: int, max_position_embeddings: int,
                num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_positions, rotary_dim] float32, halves repeated (Hugging Face's rotate_half form)."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    inv_freq, attention_factor = inverse_frequencies(params, head_dim, max_position_embeddings)
    freqs = torch.outer(positions, inv_freq)
    if params["rope_type"] == "longrope":
        long_freq, _ = inverse_frequencies(params, head_dim, max_position_embeddings, long=True)
        beyond = positions >= params["original_max_position_embeddings"]
        freqs[beyond] = torch.outer(positions[beyond], long_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D]; cos/sin [T, R] rotate the first R dims of each head (R = D
    but for partial rotary, as Phi-4-mini's)."""
    rotary = cos.shape[-1]
    if rotary == query.shape[-1]:
        return ops.rotary_embedding(query, key, cos, sin)
    q_rot, k_rot = ops.rotary_embedding(query[..., :rotary].contiguous(), key[..., :rotary].contiguous(), cos, sin)
    return torch.cat((q_rot, query[..., rotary:]), dim=-1), torch.cat((k_rot, key[..., rotary:]), dim=-1)


def mrope(table: torch.Tensor, section: tuple[int, ...]) -> torch.Tensor:
    """M-RoPE (Qwen2-VL's family): cos or sin [3, T, R] at each token's (temporal, height, width)
    positions -> [T, R], frequency block i of `section` (over R / 2, the halves repeated) taken from
    part i % 3, as Hugging Face recomposes them."""
    part = torch.cat([torch.full((size,), i % 3, dtype=torch.int64) for i, size in enumerate(section)])
    part = torch.cat((part, part)).to(table.device)
    return table.gather(0, part.expand(1, table.shape[1], -1)).squeeze(0)
