"""Rotary embedding of queries and keys, in place, in Hugging Face's rotate_half form
(x * cos + rotate_half(x) * sin, the two halves of the head dimension paired).

One program per token covers all its query and key heads. cos/sin come per token ([T, D], the
halves repeated, already in the activation dtype as HF casts them); each product rounds to the
activation dtype before the sum, as in the reference. Reference: `reference.rotary_embedding_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import tl, triton  # first: it sets up Triton


@triton.jit
def _rotate_heads(x, token, stride_token, stride_head, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = x + token * stride_token + heads * stride_head + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x.dtype.element_ty
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query, key, cos, sin, stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos_half = tl.load(cos + token * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin_half = tl.load(sin + token * stride_sin + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(query, token, stride_q_token, stride_q_head, cos_half, sin_half,
                  NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(key, token, stride_k_token, stride_k_head, cos_half, sin_half,
                  NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D] (any token/head strides, e.g. views of a fused QKV
    output), rotated in place and returned; cos/sin [T, D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert query.stride(2) == 1 and key.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    if num_tokens == 0:
        return query, key
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query, key, cos, sin, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=num_kv_heads, HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return query, key
