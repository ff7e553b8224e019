"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one compressed latent per token
and layer, shared by every head, instead of a key and a value per KV head.

Each token's latent is [c, k_rope]: c = kv_a_layernorm(the first kv_lora_rank outputs of
kv_a_proj_with_mqa), k_rope its last qk_rope_head_dim outputs, rotated. Hugging Face expands the
latent with kv_b_proj into per-head keys [k_nope, k_rope] and values on every call. Here kv_b_proj
is absorbed instead (as DeepSeek's own inference code and vLLM do): with kv_b_proj's rows of head h
split into W_UK [nope, kv_lora] and W_UV [v, kv_lora],

    q . k = q_nope . (W_UK c) + q_rope . k_rope = [W_UK^T q_nope, q_rope] . [c, k_rope]
    out_h = sum_j p_j W_UV c_j = W_UV (sum_j p_j c_j)

so attention runs as multi-query attention straight over the cached latents: queries of width
kv_lora_rank + qk_rope_head_dim, one KV "head" whose key is the latent and whose value is the same
latent (its first kv_lora_rank dims are kept). The paged-attention op, its CPU paths and its Triton
kernels serve it unchanged, reading the one cache tensor as both keys and values.

Cache bytes per token and layer: (kv_lora_rank + qk_rope_head_dim) elements against
2 * num_heads * (qk_head_dim or v_head_dim) for full attention (`cache_bytes_per_token`).

DeepSeek's checkpoints lay the rope dims of q and k out in interleaved pairs (`rope_interleave`);
Hugging Face rotates each pair and writes the results de-interleaved. The same rows of q_b_proj (or
q_proj) and kv_a_proj_with_mqa are permuted once after loading (`after_load`), so the usual
rotate-half RoPE gives Hugging Face's numbers with no per-step shuffle.

Tensor parallelism splits the heads (q_b_proj / q_proj and kv_b_proj column-parallel, o_proj
row-parallel); the latent, the q/kv down-projections and their norms are replicated
(`weight_loaders`, `layers/sharding.py`). The checkpoint's names are the layer's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend import ops

from backend.worker import parallel_state
from backend.ops.attention import AttentionMetadata
from backend.layers.norm import RMSNorm
from backend.layers.rotary import apply_rotary
from backend.layers.sharding import column_parallel, row_parallel
from backend.worker.parallel_state import ParallelState

NORM_EPS = 1e-6  # Hugging Face's q_a_layernorm and kv_a_layernorm keep the default eps, not rms_norm_eps


@dataclass(frozen=True)
class LatentAttentionArgs:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj, no low-rank query
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """Width of one token's cache entry: the compressed KV and the shared rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def cache_bytes_per_token(mla: LatentAttentionArgs, num_heads: int, element_bytes: int) -> tuple[int, int]:
    """(latent cache, full attention's key + value cache) bytes per token and layer."""
    return mla.latent_dim * element_bytes, num_heads * (mla.qk_head_dim + mla.v_head_dim) * element_bytes


class Weight(nn.Module):
    """A bare weight [out, in] (kv_b_proj): read in slices by the attention, never run as a layer, so
    the CPU packing and quantization (which replace nn.Linear) leave it as the checkpoint has it."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class LatentAttention(nn.Module):
    num_kv_heads = 1  # one latent per token

    def __init__(self, args, parallel: ParallelState, layer_id: int) -> None:
        super().__init__()
        mla: LatentAttentionArgs = args.mla
        self.mla, self.parallel = mla, parallel
        self.num_heads = args.num_heads // parallel.tp_size
        hidden = args.hidden_size
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, NORM_EPS)
        self.kv_b_proj = Weight(self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, hidden, bias=args.o_bias)
        self.scale = args.attention_scale if args.attention_scale is not None else mla.qk_head_dim ** -0.5
        heads = column_parallel(parallel)
        self.weight_loaders = {"q_proj": heads, "q_b_proj": heads, "kv_b_proj": heads, "o_proj": row_parallel(parallel)}

    def after_load(self) -> None:
        """Undo the checkpoint's interleaved rope layout: rows (x0, x1, x2, x3, ...) of each rope
        part become (x0, x2, ..., x1, x3, ...), Hugging Face's order after its interleaved rotation."""
        if not self.mla.rope_interleave:
            return
        rope, nope = self.mla.qk_rope_head_dim, self.mla.qk_nope_head_dim
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        q_proj = self.q_proj if self.mla.q_lora_rank is None else self.q_b_proj
        with torch.no_grad():
            per_head = q_proj.weight.view(self.num_heads, self.mla.qk_head_dim, -1)
            per_head[:, nope:] = per_head[:, nope:][:, order].clone()
            kv_a = self.kv_a_proj_with_mqa
            kv_a.weight[self.mla.kv_lora_rank:] = kv_a.weight[self.mla.kv_lora_rank:][order].clone()
            if kv_a.bias is not None:
                kv_a.bias[self.mla.kv_lora_rank:] = kv_a.bias[self.mla.kv_lora_rank:][order].clone()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        mla, heads = self.mla, self.num_heads
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(-1, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        compressed, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        q_rope, k_rope = apply_rotary(q_rope.contiguous(), k_rope.contiguous().unsqueeze(1), cos, sin)
        latent = torch.cat([self.kv_a_layernorm(compressed.contiguous()), k_rope[:, 0]], -1).unsqueeze(1)  # [T, 1, L]
        w_kv = self.kv_b_proj.weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)  # [H, nope | v, kv_lora]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, T, kv_lora]
        query = torch.cat([q_latent.transpose(0, 1), q_rope], -1)  # [T, H, L]
        out = ops.paged_attention(query, latent, latent, kv_cache, meta, self.scale)  # [T, H * L]
        out = out.view(-1, heads, mla.latent_dim)[..., :mla.kv_lora_rank]  # the value: the latent's c
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        out = out.transpose(0, 1).reshape(-1, heads * mla.v_head_dim)
        return parallel_state.all_reduce(self.o_proj(out), self.parallel)
