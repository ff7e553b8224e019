"""`reshape_and_cache`: write a step's new keys and values into their KV-cache slots.

One program per token; it copies all of the token's KV heads. Slots are block * block_size +
offset; a negative slot marks a padded batch entry (a CUDA-graph batch rounded up) and writes
nothing. An 8-bit cache (float8 E4M3 or E5M2) takes key / k_scale and value / v_scale, clamped to
the type's largest value and rounded. Reference: `reference.reshape_and_cache_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import tl, triton  # first: it sets up Triton
from backend.kernels.reference import FP8_KV_DTYPES


@triton.jit
def round_to_fp8(x, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """float32 x -> the nearest float8 value (ties to even, saturated at FP8_MAX), still as float32,
    so that the conversion that follows is exact. Rounded here, not by `.to`, because Triton's
    interpreter converts to float8 wrongly where the rounding carries into the exponent (1.97 to
    1.0, not 2.0); the GPU's conversion of an exact value gives the same code."""
    magnitude = tl.minimum(tl.abs(x), FP8_MAX)
    bits = magnitude.to(tl.uint32, bitcast=True)
    shift: tl.constexpr = 23 - MANTISSA
    normal = ((bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift) << shift
    # Below the smallest normal value, steps of MIN_NORMAL / 2^MANTISSA: adding 2^23 steps rounds to one.
    magic = MIN_NORMAL * (1 << (23 - MANTISSA))
    subnormal = ((magnitude + magic) - magic).to(tl.uint32, bitcast=True)
    rounded = tl.where(magnitude < MIN_NORMAL, subnormal, normal)
    return (rounded | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _reshape_and_cache_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    k_scale, v_scale,  # an 8-bit cache's (used where FP8_MAX > 0)
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,  # FP8_MAX 0: a float cache
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
    if FP8_MAX > 0:
        k = round_to_fp8(k.to(tl.float32) / k_scale, FP8_MAX, FP8_MANTISSA, FP8_MIN_NORMAL)
        v = round_to_fp8(v.to(tl.float32) / v_scale, FP8_MAX, FP8_MANTISSA, FP8_MIN_NORMAL)
        k = k.to(key_cache.dtype.element_ty)
        v = v.to(value_cache.dtype.element_ty)
    tl.store(key_cache + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head + dims,
             k, mask=mask)
    tl.store(value_cache + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + dims,
             v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """key/value [T, KVH, D] (any token and head strides) into key/value_cache
    [num_blocks, block_size, KVH, D] (any strides) at slot_mapping [T]; an 8-bit cache holds
    key / k_scale and value / v_scale."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    if num_tokens == 0:
        return
    fp8 = key_cache.dtype in FP8_KV_DTYPES
    info = torch.finfo(key_cache.dtype)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=info.max if fp8 else 0.0, FP8_MANTISSA=2 if key_cache.dtype == torch.float8_e5m2 else 3,
        FP8_MIN_NORMAL=info.smallest_normal if fp8 else 0.0,
    )
