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
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool: True = attend
    prefills: list[PrefillSpan]


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D], kv_cache [2, num_blocks, block_size, KVH, D].
    Returns [T, H * D]."""
    num_tokens, num_heads, head_dim = query.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = key_cache.shape[2]
    flat_shape = (-1, num_kv_heads, head_dim)
    key_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, key)
    value_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, value)
    gqa = num_heads != num_kv_heads

    outputs = []
    if meta.num_decodes:
        n = meta.num_decodes
        q = query[:n].unsqueeze(2)  # [n, H, 1, D]
        k = key_cache[meta.decode_block_tables].view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = value_cache[meta.decode_block_tables].view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale,
                                             enable_gqa=gqa)
        outputs.append(out.reshape(n, num_heads * head_dim))
    for span in meta.prefills:
        end = span.start + span.num_query_tokens
        q = query[span.start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        if span.context_len == span.num_query_tokens:  # nothing cached before this chunk
            k, v, mask, causal = key[span.start:end], value[span.start:end], None, True
        else:
            k = key_cache[span.block_table].view(flat_shape)[:span.context_len]
            v = value_cache[span.block_table].view(flat_shape)[:span.context_len]
            offset = span.context_len - span.num_query_tokens
            rows = torch.arange(span.num_query_tokens, device=query.device).unsqueeze(1) + offset
            mask, causal = torch.arange(span.context_len, device=query.device).unsqueeze(0) <= rows, False
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=gqa)
        outputs.append(out[0].transpose(0, 1).reshape(span.num_query_tokens, num_heads * head_dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
