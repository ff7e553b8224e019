"""Prefill/extend attention over the paged KV cache: each sequence's new queries (a whole prompt, a
chunk of one, or the tail after a prefix-cache hit) attend causally to its cached prefix and to
themselves. The new keys are already in the cache (`reshape_and_cache` runs first), so every key
is read from there.

One program per (sequence, head, tile of BLOCK_M queries), flash-attention style: an online softmax
over BLOCK_N-key tiles, stopping at the tile's last causal key. Under a sliding window the tiles
start at the window of the program's first query, so blocks before it are never read. A head's
attention sink (gpt-oss) starts its online softmax at (max = sink, sum = 1). The cache is
read through strides, and an 8-bit cache read with its scales, as in `paged_attention.py`. Reference: `reference.paged_attention_prefill_reference`.
"""

from __future__ import annotations

import torch

from backend.kernels.jit import dot_settings, tl, triton  # first: it sets up Triton
from backend.kernels.reference import FP8_KV_DTYPES
from backend.kernels.paged_attention import LOG2E, TILE, soft_cap, window_arg

BLOCK_M = 64  # queries per program


@triton.jit(do_not_specialize=["stride_table_seq", "window"])  # the table width changes every step
def _prefill_kernel(
    query, key_cache, value_cache, block_tables, query_starts, seq_lens, out,
    sinks,  # [H] logits, used where HAS_SINKS
    qk_scale,  # softmax scale * log2(e)
    window,  # the sliding window; a huge number for none
    cap,  # the logit soft cap * log2(e), used where SOFT_CAP
    v_scale,  # an 8-bit cache's value scale, used where FP8 (its key scale is in qk_scale)
    stride_q_token, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table_seq, stride_out_token, stride_out_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile_m = tl.program_id(2)
    query_start = tl.load(query_starts + seq)
    num_queries = tl.load(query_starts + seq + 1) - query_start
    if tile_m * BLOCK_M >= num_queries:
        return
    seq_len = tl.load(seq_lens + seq)
    kv_head = head // GROUP

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < num_queries
    d_mask = offs_d < HEAD_DIM
    rows = (query_start + offs_m).to(tl.int64)
    q = tl.load(query + rows[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    positions = seq_len - num_queries + offs_m  # each query's position in the sequence

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks + head).to(tl.float32) * 1.4426950408889634
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq * stride_table_seq
    last_key = tl.minimum(seq_len, seq_len - num_queries + (tile_m + 1) * BLOCK_M)  # causal bound
    first_key = tl.maximum(seq_len - num_queries + tile_m * BLOCK_M - window + 1, 0)  # the first query's window
    for tile in range(first_key, last_key, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < last_key
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
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFT_CAP:
            scores = soft_cap(scores, cap)
        causal = ((offs_n[None, :] <= positions[:, None]) & (offs_n[None, :] > positions[:, None] - window)
                  & n_mask[None, :])
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if FP8:  # the values' scale, once per output (the merge of splits is linear in acc)
        acc = acc * v_scale

    result = acc / l_i[:, None]  # every valid query sees at least its own key
    tl.store(out + rows[:, None] * stride_out_token + head * stride_out_head + offs_d[None, :],
             result.to(out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_attention_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            out: torch.Tensor | None = None, *, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """query [T, H, D], sequence i's queries at rows query_starts[i]:query_starts[i + 1] (int32,
    [P + 1]); seq_lens int32 [P] count each sequence's tokens, its new ones included; block_tables
    int32 [P, max_blocks]; key/value_cache [num_blocks, block_size, KVH, D] holding every key,
    the new ones too. max_query_len (a host int) sizes the launch. Returns out [T, H, D]. The options
    as in `reference.paged_attention_prefill_reference`."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, page_size, num_kv_heads, _ = key_cache.shape
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    fp8 = key_cache.dtype in FP8_KV_DTYPES
    upcast, precision = dot_settings(query.dtype if fp8 else key_cache.dtype)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, BLOCK_M))
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_starts, seq_lens, out,
        sinks if sinks is not None else query, scale * (k_scale if fp8 else 1.0) * LOG2E, window_arg(sliding_window),
        (logits_soft_cap or 1.0) * LOG2E, v_scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=BLOCK_M, BLOCK_N=TILE, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=upcast, PRECISION=precision, SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None,
        FP8=fp8,
    )
    return out
