"""The paged-attention op's inputs (`AttentionMetadata`) and its CPU implementation: write a step's
new keys and values into their cache slots, then attend each query over its sequence's blocks.

The step's tokens come flat: first one token per decoding sequence, then each prefill chunk in
turn. The C++ kernel of `backend/ops/cpu_ops.py` attends the decodes and short chunks in one call,
reading the blocks in place a token at a time. Prefill chunks of FLASH_MIN_QUERY_TOKENS or more go
through the C++ prefill kernel (`cpu_ops.prefill_attention`: query and key tiles over the blocks in
place, an online softmax), or with TRITONLLM_CPU_PREFILL_ATTENTION=flash through `flash_prefill`:
torch's blocked CPU flash attention over the chunk's own new keys, then over its cached prefix a tile
of blocks at a time, the parts merged by their log-sum-exp (no [Tq, L] score matrix, no copy of the
whole context). An 8-bit (fp8) cache takes the same paths: the C++ kernels quantize as they write and
dequantize as they read, `flash_prefill` dequantizes its gathered tiles.
Where the C++ kernel does not apply (other head sizes, sinks, a one-part cache), decodes run as one batched, masked attention over gathered blocks
and every prefill chunk through `flash_prefill`, or, under a sliding window that hides part of it or
a soft cap, through the torch reference. A chunk holding bidirectional ranges (Gemma 3's images)
always takes the torch reference, on every path. On CUDA, `backend/ops/__init__.py` runs the Triton
kernels on the same metadata instead.

The KV cache of a layer is [2, KVH, num_blocks, block_size, D]: each KV head's blocks together, so
gathering a sequence's blocks yields [KVH, L, D] slabs that feed batched matmuls without a copy.
The kernels see it through `cache_views` as [num_blocks, block_size, KVH, D] with strides. A cache
of one part, [1, 1, num_blocks, block_size, D] (multi-head latent attention: one latent per token,
`backend/layers/mla.py`), is read as both the keys and the values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from backend.ops import cpu_ops
from backend.kernels.reference import (FP8_KV_DTYPES, causal_attention_reference, dequantize_kv, gather_blocks,
                                      paged_attention_decode_reference, quantize_kv, reshape_and_cache_reference)


# Prefill chunks of this many query tokens or more run on a prefill kernel (ours, or torch's blocked
# flash attention) instead of the C++ decode kernel, which reads every key once per query token and
# scores it with vector dot products (fine for decodes and short chunks). One layer alone the prefill
# kernels win at fewer tokens, but whole steps add a call per chunk and the pieces' concatenation:
# where they break even was measured (docs/benchmarks.md, long prompts, and "Measured reasons behind
# code choices").
FLASH_MIN_QUERY_TOKENS = 64
# The same for torch's flash op, where it takes the long chunks (bfloat16 on AMX): on an AMX host its
# whole steps were 5% slower at 128-token prompts than the decode kernel's, the same at 160.
FLASH_OP_MIN_QUERY_TOKENS = 160
# Which kernel takes the long chunks: "own" (csrc/cpu_prefill_attention.cpp), "flash" (torch's op,
# `flash_prefill`), or "auto": ours, except bfloat16 on a CPU with AMX when ours was built without AMX
# tiles, where torch's op (on AMX) ran 3x faster than our vdpbf16ps kernel (docs/benchmarks.md,
# "Long prompts on AMX").
PREFILL_KERNEL = os.environ.get("TRITONLLM_CPU_PREFILL_ATTENTION", "auto")
# Positions of a chunk's cached prefix gathered and attended at a time: a bound on the copy, large
# enough that a context of up to 8k positions takes one tile (each tile adds a pass to merge it).
PREFIX_TILE_TOKENS = 8192


@dataclass
class PrefillSpan:
    start: int  # first token of the chunk in the flat batch
    num_query_tokens: int
    context_len: int  # tokens the chunk attends to, itself included
    block_table: torch.Tensor  # blocks covering context_len
    # Position ranges [first, end) whose tokens see each other, later ones included: the placeholders
    # of one image under Gemma 3. The chunk holds each range's end; the torch reference computes it.
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset; -1: padding
    num_decodes: int
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, the new token included
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32 (padded with block 0)
    prefills: list[PrefillSpan]
    # The prefill chunks again as tensors, for the Triton kernel (one launch for all of them).
    prefill_query_starts: torch.Tensor  # [num_prefills + 1] int32, from the first prefill token
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context_len of each chunk
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    max_prefill_query_len: int
    # Every token at once, for the CPU kernel: the row of its sequence in `block_tables` (decodes,
    # then prefill chunks: decode_block_tables and prefill_block_tables are its two halves) and how
    # many positions it attends to (its position + 1).
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    token_rows: torch.Tensor | None = None  # [num_tokens] int32
    token_context_lens: torch.Tensor | None = None  # [num_tokens] int32


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, KVH, num_blocks, block_size, D] -> key and value views [num_blocks, block_size, KVH, D]
    (a one-part cache: the same view twice)."""
    return kv_cache[0].permute(1, 2, 0, 3), kv_cache[-1].permute(1, 2, 0, 3)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D], kv_cache [2, KVH, num_blocks, block_size, D].
    Returns [T, H * D]. The options as in `ops.paged_attention`; the C++ kernel starts each token
    at its window, never reading blocks before it (the engine may have freed them)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    fused = (cpu_ops.supports(query) and head_dim in (64, 128) and num_heads // num_kv_heads <= 8
             and kv_cache.dtype in (query.dtype, *FP8_KV_DTYPES)
             and meta.token_rows is not None and sinks is None and kv_cache.shape[0] == 2)
    if fused:
        cpu_ops.reshape_and_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return _fused_attention(query, key, value, kv_cache, meta, scale, sliding_window, logits_soft_cap,
                                k_scale, v_scale)
    key_cache, value_cache = cache_views(kv_cache)
    if kv_cache.dtype in FP8_KV_DTYPES:
        reshape_and_cache_reference(key, value, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
    else:
        kv_cache[0].view(num_kv_heads, -1, head_dim)[:, meta.slot_mapping] = key.transpose(0, 1)  # [KVH, slots, D]
        kv_cache[-1].view(num_kv_heads, -1, head_dim)[:, meta.slot_mapping] = value.transpose(0, 1)
    scales = dict(k_scale=k_scale, v_scale=v_scale)

    outputs = []
    if meta.num_decodes:
        out = paged_attention_decode_reference(query[:meta.num_decodes], key_cache, value_cache,
                                               meta.decode_block_tables, meta.decode_seq_lens, scale,
                                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                               sinks=sinks, **scales)
        outputs.append(out.reshape(meta.num_decodes, num_heads * head_dim))
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_query_tokens)
        if flash_takes(span, sliding_window, logits_soft_cap):
            out = flash_prefill(query[rows], key[rows], value[rows], kv_cache, span, scale, sinks=sinks, **scales)
        else:
            out = reference_prefill(query[rows], kv_cache, span, scale, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap, sinks=sinks, **scales)
        outputs.append(out.reshape(span.num_query_tokens, num_heads * head_dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, sliding_window: int | None,
                     logits_soft_cap: float | None, k_scale: float, v_scale: float) -> torch.Tensor:
    """The C++ kernel for the decodes and short prefill chunks (reading the blocks in place, one
    token at a time), the C++ prefill kernel (or `flash_prefill`) for chunks of at least
    FLASH_MIN_QUERY_TOKENS that `flash_takes`."""
    num_tokens, num_heads, head_dim = query.shape
    own_kernel = own_prefill_kernel(query.dtype)
    min_tokens = FLASH_MIN_QUERY_TOKENS if own_kernel else FLASH_OP_MIN_QUERY_TOKENS
    long_spans = [span for span in meta.prefills if span.bidirectional or (
        span.num_query_tokens >= min_tokens and flash_takes(span, sliding_window, logits_soft_cap))]
    if not long_spans:
        out = cpu_ops.paged_attention(query, kv_cache, meta.block_tables, meta.token_rows,
                                      meta.token_context_lens, scale, sliding_window=sliding_window,
                                      logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale)
        return out.view(num_tokens, num_heads * head_dim)
    pieces, kernel_from = [], 0  # the tokens between the long chunks go to the C++ kernel, a run at a time
    for span in long_spans + [PrefillSpan(num_tokens, 0, 0, meta.block_tables[:0])]:
        if span.start > kernel_from:
            rows = slice(kernel_from, span.start)
            pieces.append(cpu_ops.paged_attention(query[rows], kv_cache, meta.block_tables, meta.token_rows[rows],
                                                  meta.token_context_lens[rows], scale, sliding_window=sliding_window,
                                                  logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale))
        rows = slice(span.start, span.start + span.num_query_tokens)
        if span.bidirectional:
            pieces.append(reference_prefill(query[rows], kv_cache, span, scale, sliding_window=sliding_window,
                                            logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale))
        elif span.num_query_tokens and own_kernel:  # the cache holds the chunk's keys by now
            pieces.append(cpu_ops.prefill_attention(query[rows], kv_cache, span.block_table, span.context_len, scale,
                                                    k_scale=k_scale, v_scale=v_scale))
        elif span.num_query_tokens:
            pieces.append(flash_prefill(query[rows], key[rows], value[rows], kv_cache, span, scale,
                                        k_scale=k_scale, v_scale=v_scale))
        kernel_from = rows.stop
    # One piece (a lone long prompt) is returned as it is: no copy into a fresh buffer, whose first
    # touch alone (page faults) cost as much as the copy.
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out.reshape(num_tokens, num_heads * head_dim)


def own_prefill_kernel(dtype: torch.dtype) -> bool:
    """Whether long chunks of `dtype` run on our C++ prefill kernel rather than torch's flash op
    (`PREFILL_KERNEL`)."""
    if PREFILL_KERNEL in ("own", "flash"):
        return PREFILL_KERNEL == "own"
    return dtype != torch.bfloat16 or not cpu_ops.has_amx_bf16() or cpu_ops.prefill_on_amx()


def flash_takes(span: PrefillSpan, sliding_window: int | None, logits_soft_cap: float | None) -> bool:
    """Whether `flash_prefill` computes this chunk: causal, no soft cap, and no window that hides any of it."""
    return (not span.bidirectional and logits_soft_cap is None
            and (sliding_window is None or sliding_window >= span.context_len))


def reference_prefill(query: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan, scale: float, *,
                      sliding_window: int | None = None, logits_soft_cap: float | None = None,
                      sinks: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One prefill chunk's queries [Tq, H, D] over its whole context, gathered from the cache (which
    already holds the chunk's own keys), through the torch reference: any window, soft cap, sinks
    and bidirectional ranges. Returns [Tq, H, D]."""
    key_cache, value_cache = cache_views(kv_cache)
    k = dequantize_kv(gather_blocks(key_cache, span.block_table)[:, :span.context_len], query.dtype, k_scale)
    v = dequantize_kv(gather_blocks(value_cache, span.block_table)[:, :span.context_len], query.dtype, v_scale)
    positions = torch.arange(span.num_query_tokens, device=query.device) + span.context_len - span.num_query_tokens
    return causal_attention_reference(query.transpose(0, 1), k, v, positions, scale, sliding_window=sliding_window,
                                      logits_soft_cap=logits_soft_cap, sinks=sinks,
                                      bidirectional=span.bidirectional).transpose(0, 1)


def flash_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  span: PrefillSpan, scale: float, sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """One prefill chunk's attention in tiles: query [Tq, H, D] causally over its own new keys and
    values [Tq, KVH, D], then over its cached prefix PREFIX_TILE_TOKENS positions at a time,
    gathered from the paged cache tile by tile. Each part runs torch's blocked CPU flash attention
    (which never forms the [Tq, L] scores and multiplies on oneDNN, AMX where the CPU has it) and
    returns its log-sum-exp, by which the parts merge as one softmax; `sinks` [H] then join each
    head's denominator. An 8-bit cache's tiles are dequantized as they are gathered, and the chunk's
    own keys and values pass through its rounding (`quantize_kv`, then back), so that every key is
    read as the cache holds it. Returns [Tq, H, D]."""
    num_query, num_kv_heads, head_dim = key.shape
    cached = span.context_len - num_query
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
    if kv_cache.dtype != query.dtype:  # the chunk's keys as its prefix's: through the cache's type
        key = dequantize_kv(quantize_kv(key, kv_cache.dtype, k_scale), query.dtype, k_scale)
        value = dequantize_kv(quantize_kv(value, kv_cache.dtype, v_scale), query.dtype, v_scale)
    out, lse = _flash(q, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0), scale, causal=True)
    if not cached and sinks is None:
        return out[0].transpose(0, 1)
    out = out.float()
    block_size = kv_cache.shape[3]
    tile_blocks = max(1, PREFIX_TILE_TOKENS // block_size)
    for first in range(0, -(-cached // block_size), tile_blocks):
        blocks = span.block_table[first:first + tile_blocks]
        length = min(cached - first * block_size, tile_blocks * block_size)
        k = kv_cache[0].index_select(1, blocks).view(num_kv_heads, -1, head_dim)[:, :length]
        v = kv_cache[-1].index_select(1, blocks).view(num_kv_heads, -1, head_dim)[:, :length]
        tile_out, tile_lse = _flash(q, dequantize_kv(k, query.dtype, k_scale).unsqueeze(0),
                                    dequantize_kv(v, query.dtype, v_scale).unsqueeze(0), scale, causal=False)
        merged = torch.logaddexp(lse, tile_lse)
        out.mul_((lse - merged).exp_().unsqueeze(-1)).addcmul_(tile_out, (tile_lse - merged).exp_().unsqueeze(-1))
        lse = merged
    if sinks is not None:  # p_j = e^s_j / (sum e^s + e^sink): the softmax's output times sigmoid(lse - sink)
        out.mul_(torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1))
    return out[0].transpose(0, 1).to(query.dtype)


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, H, Tq, D] over [1, KVH, L, D] (KVH dividing H) -> output [1, H, Tq, D] and its
    log-sum-exp [1, H, Tq] (float32). Causal: the last query sees every key (Tq == L here)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
