"""The paged-attention op's inputs (`AttentionMetadata`) and its CPU implementation: write a step's
new keys and values into their cache slots, then attend each query over its sequence's blocks.

The step's tokens come flat: first one token per decoding sequence, then each prefill chunk in
turn. The C++ kernel of `backend/cpu_ops.py` attends every token of the step in one call, reading
the blocks in place. Where it does not apply (an fp8 cache, other head sizes), decodes run as one
batched, masked attention over gathered blocks and prefill chunks one at a time through SDPA,
reading straight from the new keys when nothing of the sequence is cached yet. On CUDA,
`backend/ops.py` runs the Triton kernels on the same metadata instead.

The KV cache of a layer is [2, KVH, num_blocks, block_size, D]: each KV head's blocks together, so
gathering a sequence's blocks yields [KVH, L, D] slabs that feed batched matmuls without a copy.
The kernels see it through `cache_views` as [num_blocks, block_size, KVH, D] with strides. A cache
of one part, [1, 1, num_blocks, block_size, D] (multi-head latent attention: one latent per token,
`backend/models/layers/mla.py`), is read as both the keys and the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend import cpu_ops
from backend.kernels.reference import causal_attention_reference, gather_blocks, paged_attention_decode_reference


@dataclass
class PrefillSpan:
    start: int  # first token of the chunk in the flat batch
    num_query_tokens: int
    context_len: int  # tokens the chunk attends to, itself included
    block_table: torch.Tensor  # blocks covering context_len


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
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D], kv_cache [2, KVH, num_blocks, block_size, D].
    Returns [T, H * D]. The options as in `ops.paged_attention`; the C++ kernel starts each token
    at its window, never reading blocks before it (the engine may have freed them)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    fused = (cpu_ops.supports(query) and head_dim in (64, 128) and num_heads // num_kv_heads <= 8
             and kv_cache.dtype == query.dtype  # an fp8 cache takes the torch path, converting at its edges
             and meta.token_rows is not None and sinks is None and kv_cache.shape[0] == 2)
    if fused:
        cpu_ops.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        out = cpu_ops.paged_attention(query, kv_cache, meta.block_tables, meta.token_rows,
                                      meta.token_context_lens, scale, sliding_window=sliding_window,
                                      logits_soft_cap=logits_soft_cap)
        return out.view(num_tokens, num_heads * head_dim)
    key_slots = kv_cache[0].view(num_kv_heads, -1, head_dim)  # [KVH, num_slots, D]
    value_slots = kv_cache[-1].view(num_kv_heads, -1, head_dim)
    # Indexed assignment, not index_copy_, which has no float8 kernel on the CPU.
    key_slots[:, meta.slot_mapping] = key.transpose(0, 1).to(kv_cache.dtype)
    value_slots[:, meta.slot_mapping] = value.transpose(0, 1).to(kv_cache.dtype)
    key_cache, value_cache = cache_views(kv_cache)
    gqa = num_heads != num_kv_heads

    outputs = []
    if meta.num_decodes:
        out = paged_attention_decode_reference(query[:meta.num_decodes], key_cache, value_cache,
                                               meta.decode_block_tables, meta.decode_seq_lens, scale,
                                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                               sinks=sinks)
        outputs.append(out.view(meta.num_decodes, num_heads * head_dim))
    for span in meta.prefills:
        end = span.start + span.num_query_tokens
        if sliding_window is not None or logits_soft_cap is not None or sinks is not None:
            k = gather_blocks(key_cache, span.block_table)[:, :span.context_len].to(query.dtype)
            v = gather_blocks(value_cache, span.block_table)[:, :span.context_len].to(query.dtype)
            positions = torch.arange(span.num_query_tokens, device=query.device) + span.context_len - span.num_query_tokens
            out = causal_attention_reference(query[span.start:end].transpose(0, 1), k, v, positions, scale,
                                             sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                             sinks=sinks)
            outputs.append(out.transpose(0, 1).reshape(span.num_query_tokens, num_heads * head_dim))
            continue
        q = query[span.start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        if span.context_len == span.num_query_tokens:  # nothing cached before this chunk
            k = key[span.start:end].transpose(0, 1).unsqueeze(0)
            v = value[span.start:end].transpose(0, 1).unsqueeze(0)
            mask, causal = None, True
        else:
            k = gather_blocks(key_cache, span.block_table)[:, :span.context_len].to(query.dtype).unsqueeze(0)
            v = gather_blocks(value_cache, span.block_table)[:, :span.context_len].to(query.dtype).unsqueeze(0)
            offset = span.context_len - span.num_query_tokens
            rows = torch.arange(span.num_query_tokens, device=query.device).unsqueeze(1) + offset
            mask, causal = torch.arange(span.context_len, device=query.device).unsqueeze(0) <= rows, False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=gqa)
        outputs.append(out[0].transpose(0, 1).reshape(span.num_query_tokens, num_heads * head_dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
