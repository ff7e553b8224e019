"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM): RMSNorm, RoPE with the config's
scaling, grouped-query attention over the paged KV cache, SwiGLU, optionally tied embeddings.

The hot-path ops come from `backend/ops.py` (Triton kernels on CUDA, torch on the CPU). Numerics
follow Hugging Face's implementation step for step (norms in float32, RoPE tables in float32 cast
to the activation dtype) so greedy tokens match it exactly in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backend import ops
from backend.attention import AttentionMetadata


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "LlamaArgs":
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = config.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
            hidden_act=config.get("hidden_act", "silu"),
        )


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported yet")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rotary_embedding(q.view(-1, self.num_heads, self.head_dim),
                                    k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(ops.paged_attention(q, k, v, kv_cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        if args.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {args.hidden_act!r} is not supported yet")
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """Returns (this layer's output, the residual stream before it is added): the next norm
        adds the two in one kernel."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.post_init()

    def post_init(self) -> None:
        """Tie embeddings and compute the RoPE tables; call again after `to_empty`."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        positions = torch.arange(self.args.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(self.args))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos, self.rope_sin = emb.cos().to(device), emb.sin().to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype)  # [T, D]
        sin = self.rope_sin[positions].to(x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # Hugging Face checkpoint names -> ours. Separate q/k/v and gate/up are fused on load.
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights) -> None:
        """weights: iterable of (hf_name, tensor)."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = self.FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                target = ".".join(parts[:-2] + [fused[0], parts[-1]])
                pending.setdefault(target, {})[fused[1]] = tensor
                expected = 3 if fused[0] == "qkv_proj" else 2
                if len(pending[target]) < expected:
                    continue
                shards = pending.pop(target)
                tensor = torch.cat([shards[i] for i in range(expected)])
                name = target
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if self.args.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing or pending:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing | set(pending))[:5]}")
