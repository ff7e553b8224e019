"""The attention block: one fused q/k/v projection (biases optional), q/k norms (per head as in
Qwen3 and Gemma 3, or across all heads as in OLMo 2), rotary embeddings, paged attention with the
layer's sliding window, logit soft-cap and attention sinks (gpt-oss: a learned logit per head), and
the output projection (bias optional).

Tensor parallelism: q/k/v are column-parallel (each rank its heads; KV heads are replicated when
ranks outnumber them), o_proj row-parallel with an all-reduce after it (its bias, if any, lives on
rank 0 only, so it is added once), the sinks split with the heads: the block names these loaders
for its parameters (`weight_loaders`, `layers/sharding.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from backend import ops

from backend.worker import parallel_state
from backend.ops.attention import AttentionMetadata
from backend.layers.norm import RMSNorm
from backend.layers.rotary import apply_rotary
from backend.layers.sharding import Part, column_parallel, head_rows, output_rows, packed, row_parallel
from backend.worker.parallel_state import ParallelState


class Attention(nn.Module):
    def __init__(self, args, parallel: ParallelState, layer_id: int) -> None:
        super().__init__()
        self.parallel = parallel
        tp = parallel.tp_size
        self.num_heads, self.head_dim = args.num_heads // tp, args.head_dim
        self.num_kv_heads = max(1, args.num_kv_heads // tp)
        self.q_size = self.num_heads * args.head_dim
        self.kv_size = self.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm is not None:
            q_width, k_width = ((args.head_dim, args.head_dim) if args.qk_norm == "head"
                                else (self.q_size, self.kv_size))
            self.q_norm = RMSNorm(q_width, args.rms_norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(k_width, args.rms_norm_eps, args.norm_offset)
        self.scale = args.attention_scale if args.attention_scale is not None else args.head_dim ** -0.5
        self.sliding_window = args.sliding_windows[layer_id] if args.sliding_windows else None
        self.logits_soft_cap = args.attn_logit_softcap
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if args.attention_sinks else None  # this rank's heads
        # An 8-bit KV cache holds keys / k_scale and values / v_scale: the checkpoint's scales where it
        # has them (backend/models/loading.py), else 1.0, as vLLM's default.
        self.k_scale, self.v_scale = 1.0, 1.0
        q = Part(args.num_heads * args.head_dim, self.q_size, output_rows(parallel))
        kv = Part(args.num_kv_heads * args.head_dim, self.kv_size, head_rows(parallel, args.num_kv_heads))
        self.weight_loaders = {"qkv_proj": packed([q, kv, kv], tp), "o_proj": row_parallel(parallel),
                               "sinks": column_parallel(parallel)}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm == "head":  # the norms take rows: one per head
            q, k = self.q_norm(q.reshape(-1, self.head_dim)), self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, cos, sin)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = ops.paged_attention(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                                  logits_soft_cap=self.logits_soft_cap, sinks=self.sinks,
                                  k_scale=self.k_scale, v_scale=self.v_scale)
        return parallel_state.all_reduce(self.o_proj(out), self.parallel)
