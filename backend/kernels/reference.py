"""Torch references for the Triton kernels, with the kernels' signatures. The CPU path runs these
(through `backend/ops/__init__.py`) and the tests hold each kernel to them. No Triton import here.

Numerics follow Hugging Face step for step: norms in float32, each elementwise product rounded to
the activation dtype, so greedy tokens match it exactly in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next sublayer's input."""
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


def rotary_embedding_reference(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D]; cos/sin [T, D] with the halves repeated (HF's
    rotate_half form)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (gate, then up) -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Keys or values as a cache of `cache_dtype` holds them: as they are for a float cache; for an
    8-bit one x / scale in float32, saturated at the type's largest value and rounded to nearest even."""
    if cache_dtype not in FP8_KV_DTYPES:
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a cache's keys or values stand for, in `dtype`: an 8-bit cache's codes times its scale
    (in float32, then rounded), a float cache's as they are."""
    if x.dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    return (fp8_to_float32(x) * scale).to(dtype)


def fp8_to_float32(x: torch.Tensor) -> torch.Tensor:
    """float8 E4M3 (fn) or E5M2 codes -> float32, exactly, in vectorised integer ops (torch converts
    float8 one element at a time on the CPU): the code's bits moved into a float16's places (E5M2 is
    a float16's top byte; E4M3's exponent and mantissa sit one bit lower, scaled back by 2^8)."""
    code = x.view(torch.uint8).to(torch.int16)
    if x.dtype == torch.float8_e5m2:
        return (code << 8).view(torch.float16).float()
    half = (((code & 0x7F) << 7) | ((code & 0x80) << 8)).view(torch.float16)
    return half.float() * 256


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key/value [T, KVH, D] into key/value_cache [num_blocks, block_size, KVH, D] (any strides) at
    slot_mapping [T] (block * block_size + offset; negative slots are padding and not written); an
    8-bit cache stores them divided by k_scale / v_scale (`quantize_kv`)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    for cache, new, scale in ((key_cache, key[keep], k_scale), (value_cache, value[keep], v_scale)):
        # Indexed assignment, not index_put_ with accumulate or index_copy_: no float8 kernels for those.
        cache[slots // block_size, slots % block_size] = quantize_kv(new, cache.dtype, scale)


def paged_attention_decode_reference(query: torch.Tensor, key_cache: torch.Tensor,
                                     value_cache: torch.Tensor, block_tables: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                                     logits_soft_cap: float | None = None,
                                     sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                                     v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence over its cached context.

    query [S, H, D]; key/value_cache [num_blocks, block_size, KVH, D]; block_tables [S, max_blocks]
    (padded with any valid block id); seq_lens [S]. Returns [S, H, D]. `sliding_window`: the query
    (at position seq_len - 1) sees only the last `sliding_window` positions; `logits_soft_cap`:
    scores become cap * tanh(scores / cap) before the softmax.

    Written as two batched matmuls with the query heads grouped under their KV head over the
    gathered blocks: on the CPU this runs several times faster than SDPA's flash kernel, which is
    built for blocks of queries. With the engine's head-major cache the gather yields contiguous
    [KVH, S, L, D] slabs."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    blocks = block_tables.flatten()
    # [KVH, S, L, D], in the query's dtype (an fp8 cache converts as it is read)
    keys = dequantize_kv(gather_blocks(key_cache, blocks), query.dtype, k_scale).view(num_kv_heads, num_seqs, -1,
                                                                                      head_dim)
    values = (keys if value_cache.data_ptr() == key_cache.data_ptr()  # one latent cache (MLA): read it once
              else dequantize_kv(gather_blocks(value_cache, blocks), query.dtype, v_scale).view(
                  num_kv_heads, num_seqs, -1, head_dim))
    grouped = query.view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)  # [KVH, S, G, D]
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * scale  # [KVH, S, G, L]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    key_positions = torch.arange(keys.shape[2], device=query.device)
    hidden = key_positions >= seq_lens.unsqueeze(1)  # [S, L]
    if sliding_window is not None:
        hidden |= key_positions <= seq_lens.unsqueeze(1) - 1 - sliding_window
    scores.masked_fill_(hidden.unsqueeze(1), float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        probs = softmax_with_sinks(scores, sinks.view(num_kv_heads, 1, -1, 1)).to(query.dtype)
    out = torch.matmul(probs, values)  # [KVH, S, G, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def causal_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               query_positions: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                               bidirectional: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """One sequence's queries over its keys at positions 0..L-1. query [H, Tq, D], key/value
    [KVH, L, D], query_positions [Tq]. Returns [H, Tq, D]. Key j is seen by the query at position i
    when j <= i, or both lie in one of the `bidirectional` ranges [first, end) (Gemma 3's images),
    and then i - sliding_window < j; a soft cap applies before the softmax, as in Hugging Face's
    eager attention (SDPA where there is neither, nor `sinks` [H])."""
    key_positions = torch.arange(key.shape[1], device=query.device)
    rows = query_positions.unsqueeze(1)
    visible = key_positions.unsqueeze(0) <= rows  # [Tq, L]
    for first, end in bidirectional:
        visible |= ((rows >= first) & (rows < end)) & ((key_positions >= first) & (key_positions < end))
    if sliding_window is not None:
        visible &= key_positions.unsqueeze(0) > rows - sliding_window
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
                                              attn_mask=visible, scale=scale,
                                              enable_gqa=query.shape[0] != key.shape[0])[0]
    group = query.shape[0] // key.shape[0]
    key, value = key.repeat_interleave(group, dim=0), value.repeat_interleave(group, dim=0)
    scores = torch.matmul(query, key.transpose(1, 2)) * scale  # [H, Tq, L]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        probs = softmax_with_sinks(scores, sinks.view(-1, 1, 1)).to(query.dtype)
    return torch.matmul(probs, value)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] without the sink's column, in float32, as gpt-oss's eager attention
    computes it: the sink (one logit per head, broadcast to scores[..., :1]) only enlarges the
    denominator, so a head may attend to nothing."""
    combined = torch.cat([scores.float(), sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return combined.softmax(dim=-1)[..., :-1]


def paged_attention_prefill_reference(query: torch.Tensor, key_cache: torch.Tensor,
                                      value_cache: torch.Tensor, block_tables: torch.Tensor,
                                      query_starts: torch.Tensor, seq_lens: torch.Tensor,
                                      scale: float, *, sliding_window: int | None = None,
                                      logits_soft_cap: float | None = None,
                                      sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                                      v_scale: float = 1.0) -> torch.Tensor:
    """Variable-length causal queries over the cache, which already holds their own keys.

    query [T, H, D] (sequence i's queries are rows query_starts[i]:query_starts[i + 1], the last
    tokens of its seq_lens[i]); key/value_cache [num_blocks, block_size, KVH, D]; block_tables
    [P, max_blocks]. Returns [T, H, D]. The options as in `causal_attention_reference`; an 8-bit
    cache's keys and values are read as `dequantize_kv` with k_scale / v_scale."""
    out = torch.empty_like(query)
    starts, lens = query_starts.tolist(), seq_lens.tolist()
    block_size = key_cache.shape[1]
    for i, context_len in enumerate(lens):
        rows = slice(starts[i], starts[i + 1])
        num_query = starts[i + 1] - starts[i]
        blocks = block_tables[i, :-(-context_len // block_size)]
        k = dequantize_kv(gather_blocks(key_cache, blocks)[:, :context_len], query.dtype, k_scale)  # [KVH, L, D]
        v = dequantize_kv(gather_blocks(value_cache, blocks)[:, :context_len], query.dtype, v_scale)
        positions = torch.arange(num_query, device=query.device) + context_len - num_query
        attended = causal_attention_reference(query[rows].transpose(0, 1), k, v, positions, scale,
                                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                              sinks=sinks)
        out[rows] = attended.transpose(0, 1)
    return out


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KVH, D] -> [KVH, len(block_ids) * block_size, D]. A free view
    of the engine's head-major cache [KVH, num_blocks, block_size, D] goes in and out without a
    transposing copy."""
    head_major = cache.permute(2, 0, 1, 3)  # [KVH, num_blocks, block_size, D]
    num_kv_heads, head_dim = head_major.shape[0], head_major.shape[3]
    return head_major.index_select(1, block_ids).reshape(num_kv_heads, -1, head_dim)


def unpack_int_reference(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] holding 32 // bits values per word, the i-th at bit bits * i -> int32
    [..., W * 32 // bits], each in [0, 2 ** bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def dequantize_int_reference(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                             bits: int) -> torch.Tensor:
    """Group-quantized integer weights (AWQ, GPTQ after `backend/quantization/linear.py` repacks
    them) -> [N, K] in the scales' dtype: W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g] with
    g = k // (K / G). qweight [N, K * bits / 32] int32 packed along K; scales, zeros [N, G]."""
    q = unpack_int_reference(qweight, bits)
    num_out, num_in = q.shape
    q = q.view(num_out, scales.shape[1], -1).to(scales.dtype)
    return ((q - zeros.unsqueeze(-1)) * scales.unsqueeze(-1)).view(num_out, num_in)


def quant_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized W [N, K]^T (+ bias): the weight is dequantized on every call, so
    memory holds only the packed integers."""
    weight = dequantize_int_reference(qweight, scales, zeros, bits).to(x.dtype)
    return F.linear(x, weight, bias)


def add_lora_reference(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       batch) -> None:
    """out[t] += B[slot] @ (A[slot] @ x[t]) for every token of every segment of `batch` (a
    backend.lora.layers.LoRABatch): a loop over the step's few segments, none over tokens; the
    Triton kernel's reference."""
    for start, end, slot in batch.segments:
        out[start:end].addmm_(x[start:end] @ lora_a[slot].T, lora_b[slot].T)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k] -> [T, H]: each
    (token, slot) pair through its expert (SiLU-gated), scaled by its weight in float32 and rounded,
    then summed over the k slots."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0)
    out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert in flat_ids.unique().tolist():
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        hidden = F.linear(silu_and_mul_reference(F.linear(rows[pairs], w13[expert])), w2[expert])
        out[pairs] = (hidden.float() * topk_weights.reshape(-1)[pairs].float().unsqueeze(1)).to(x.dtype)
    return out.view(num_tokens, top_k, -1).sum(1)
