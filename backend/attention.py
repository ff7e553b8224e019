"""The paged-attention op: write a step's new keys and values into their cache slots, then attend
each query over its sequence's blocks.

The step's tokens come flat: first one token per decoding sequence, then each prefill chunk in
turn. Decodes run as one batched, masked attention over gathered blocks; prefill chunks run one at a
time, reading straight from the new keys when nothing of the sequence is cached yet. This is the
torch implementation used on the CPU and as the reference the Triton kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # first token of the chunk in the flat batch
    num_query_tokens: int
    context_len: int  # tokens the chunk attends to, itself included
    block_table: torch.Tensor  # blocks covering context_len, int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset per token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64 (padded with block 0)
    decode_bias: torch.Tensor  # [num_decodes, 1, max_blocks * block_size]: 0 to attend, -inf not
    prefills: list[PrefillSpan]


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D], kv_cache [2, KVH, num_blocks, block_size, D].
    Returns [T, H * D].

    The cache keeps each KV head's blocks together, so gathering a sequence's blocks yields
    [KVH, L, D] slabs that feed batched matmuls without another copy."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    key_cache = kv_cache[0].view(num_kv_heads, -1, head_dim)  # [KVH, num_slots, D]
    value_cache = kv_cache[1].view(num_kv_heads, -1, head_dim)
    key_cache.index_copy_(1, meta.slot_mapping, key.transpose(0, 1))
    value_cache.index_copy_(1, meta.slot_mapping, value.transpose(0, 1))
    gqa = num_heads != num_kv_heads

    outputs = []
    if meta.num_decodes:
        outputs.append(_decode_attention(query[:meta.num_decodes], kv_cache, meta, scale))
    for span in meta.prefills:
        end = span.start + span.num_query_tokens
        q = query[span.start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        if span.context_len == span.num_query_tokens:  # nothing cached before this chunk
            k = key[span.start:end].transpose(0, 1).unsqueeze(0)
            v = value[span.start:end].transpose(0, 1).unsqueeze(0)
            mask, causal = None, True
        else:
            k = gather_blocks(kv_cache[0], span.block_table)[:, :span.context_len].unsqueeze(0)
            v = gather_blocks(kv_cache[1], span.block_table)[:, :span.context_len].unsqueeze(0)
            offset = span.context_len - span.num_query_tokens
            rows = torch.arange(span.num_query_tokens, device=query.device).unsqueeze(1) + offset
            mask, causal = torch.arange(span.context_len, device=query.device).unsqueeze(0) <= rows, False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=gqa)
        outputs.append(out[0].transpose(0, 1).reshape(span.num_query_tokens, num_heads * head_dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [KVH, num_blocks, block_size, D] -> [KVH, len(block_ids) * block_size, D]."""
    num_kv_heads, _, _, head_dim = cache.shape
    return cache.index_select(1, block_ids).view(num_kv_heads, -1, head_dim)


def _decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """One query token per sequence against its gathered blocks. Written as two batched matmuls
    with the query heads grouped under their KV head: on the CPU this runs several times faster
    than SDPA's flash kernel, which is built for blocks of queries."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    blocks = meta.decode_block_tables.flatten()
    keys = gather_blocks(kv_cache[0], blocks).view(num_kv_heads, num_seqs, -1, head_dim)  # [KVH, S, L, D]
    values = gather_blocks(kv_cache[1], blocks).view(num_kv_heads, num_seqs, -1, head_dim)
    grouped = query.view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)  # [KVH, S, G, D]
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * scale + meta.decode_bias  # [KVH, S, G, L]
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, values)  # [KVH, S, G, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads * head_dim)
