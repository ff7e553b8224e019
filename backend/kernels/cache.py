"""`reshape_and_cache`: write a step's new keys and values into their KV-cache slots.

One program per token; it copies all of the token's KV heads. Slots are block * block_size +
offset; a negative slot marks a padded batch entry (a CUDA-graph batch rounded up) and writes
nothing. Reference: `reference.reshape_and_cache_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import tl, triton  # first: it sets up Triton


@triton.jit
def _reshape_and_cache_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    tl.store(key_cache + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head + dims,
             k, mask=mask)
    tl.store(value_cache + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + dims,
             v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, KVH, D] (any token and head strides) into key/value_cache
    [num_blocks, block_size, KVH, D] (any strides) at slot_mapping [T]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
