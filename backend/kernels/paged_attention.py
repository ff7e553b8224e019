"""Decode attention over the paged KV cache: one query token per sequence, GQA, split-K.

Each program takes one (sequence, KV head, split): it loads the KV head's query group once
(padded to 16 rows for `tl.dot`) and walks its share of the sequence's blocks with an online
softmax, so each key and value is read once for the whole group. For long contexts and few
sequences the context is split across programs (flash-decoding) and a second kernel merges the
partial results; with one split the first kernel writes the output itself.

The cache is read through strides, so any layout of [num_blocks, block_size, KVH, D] with a
contiguous last dimension works, including a view of the engine's head-major cache. Under a sliding
window a sequence's keys start at max(0, seq_len - window): the splits share only those, and blocks
before them are never read (the engine may have freed them). A soft cap bends the scores before the
softmax, as Gemma 2 does. Attention sinks (gpt-oss: one learned logit per head in the softmax's
denominator) start the first split's online softmax at (max = sink, sum = 1) instead of (-inf, 0).
An 8-bit cache (float8 E4M3 or E5M2) is read in the query's type, its key scale folded into the
softmax scale and its value scale applied to each output once. Reference: `reference.paged_attention_decode_reference`.
"""

from __future__ import annotations

import functools

import torch

from backend.kernels.jit import dot_settings, tl, triton  # first: it sets up Triton
from backend.kernels.reference import FP8_KV_DTYPES

LOG2E = 1.4426950408889634
TILE = 64  # keys per loop iteration
MAX_SPLITS = 16


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1) (exp overflowing gives 1);
    scores and cap in the same (base-2) units."""
    return cap - 2.0 * cap / (tl.exp(2.0 * scores / cap) + 1.0)


def window_arg(sliding_window: int | None) -> int:
    """The kernels' window argument: a number larger than any context for none."""
    return sliding_window if sliding_window is not None else 1 << 30


@triton.jit(do_not_specialize=["stride_table_seq", "window"])  # the table width changes every step
def _decode_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, out, partial_out, partial_max, partial_sum,
    sinks,  # [H] logits, used where HAS_SINKS
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # the sliding window; a huge number for none
    cap,  # the logit soft cap * log2(e), used where SOFT_CAP
    v_scale,  # an 8-bit cache's value scale, used where FP8 (its key scale is in qk_scale)
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table_seq, stride_out_seq, stride_out_head,
    SPLIT: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens + seq)
    first = tl.maximum(seq_len - window, 0)  # the window's first key
    # Each split takes a whole number of BLOCK_N tiles; trailing splits of short sequences are empty.
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(query + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS:  # the sink counts once: in the first split
        sink = tl.load(sinks + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables + seq * stride_table_seq
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block_ids = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache + block_ids[:, None] * stride_k_block + slots[:, None] * stride_k_slot
                    + kv_head * stride_k_head + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache + block_ids[:, None] * stride_v_block + slots[:, None] * stride_v_slot
                    + kv_head * stride_v_head + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:  # an 8-bit cache's codes in the query's type: exact (float8 fits in bfloat16)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        if SOFT_CAP:
            scores = soft_cap(scores, cap)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if FP8:  # the values' scale, once per output (the merge of splits is linear in acc)
        acc = acc * v_scale

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # partial_out [S, H, num_splits, BLOCK_D]; partial_max/sum [S, H, num_splits], contiguous.
        row = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(partial_out + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=out_mask)
        tl.store(partial_max + row, m_i, mask=g_mask)
        tl.store(partial_sum + row, l_i, mask=g_mask)
    else:
        # A padded batch slot (seq_len 0) has l_i == 0: write zeros, not NaN.
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + seq * stride_out_seq + heads[:, None] * stride_out_head + offs_d[None, :],
                 result.to(out.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    partial_out, partial_max, partial_sum, out, num_splits, stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    maxes = tl.load(partial_max + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    sums = tl.load(partial_sum + row * num_splits + offs_s, mask=s_mask, other=0.0)
    accs = tl.load(partial_out + (row * num_splits + offs_s[:, None]) * BLOCK_D + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    top = tl.max(maxes, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: a padded batch slot
    weights = tl.exp2(maxes - top)  # empty splits: exp2(-inf) = 0
    total = tl.sum(sums * weights, axis=0)
    result = tl.sum(accs * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out + seq * stride_out_seq + head * stride_out_head + offs_d, result.to(out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Enough splits that (sequences x KV heads x splits) fills the GPU's multiprocessors about
    twice, never more than the longest context has tiles, at most MAX_SPLITS. Depends on shapes
    only, so a CUDA graph fixes it at capture."""
    wanted = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max_context, TILE), MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None, *,
                           sliding_window: int | None = None, logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """query [S, H, D]; key/value_cache [num_blocks, block_size, KVH, D] (any strides, D contiguous);
    block_tables int32 [S, max_blocks]; seq_lens int32 [S] (0 marks a padded slot: zeros out).
    The options as in `reference.paged_attention_decode_reference`.
    Returns out [S, H, D] in query's dtype. num_splits defaults to `choose_num_splits` over the
    block table's width, so a fixed-shape batch (a CUDA graph) gets a fixed launch."""
    num_seqs, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    if out is None:
        out = torch.empty_like(query)
    if num_splits is None:  # one split in the interpreter: it gains nothing from more
        num_splits = 1 if not query.is_cuda else choose_num_splits(
            num_seqs, num_kv_heads, block_tables.shape[1] * page_size, _num_sms(query.device))
    assert 1 <= num_splits <= MAX_SPLITS
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    fp8 = key_cache.dtype in FP8_KV_DTYPES
    upcast, precision = dot_settings(query.dtype if fp8 else key_cache.dtype)
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32,
                                  device=query.device)
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, partial_out, partial_max, partial_sum,
        sinks if sinks is not None else query, scale * (k_scale if fp8 else 1.0) * LOG2E, window_arg(sliding_window),
        (logits_soft_cap or 1.0) * LOG2E, v_scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        SPLIT=num_splits > 1, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=TILE, BLOCK_D=block_d,
        UPCAST=upcast, PRECISION=precision, SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None,
        FP8=fp8,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial_out, partial_max, partial_sum, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=MAX_SPLITS, BLOCK_D=block_d,
        )
    return out
