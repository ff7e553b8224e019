"""The CPU path's prefill attention (`backend/ops/attention.py`): chunks long enough go through
the C++ prefill kernel (`cpu_ops.prefill_attention`, query and key tiles over the paged cache in
place) or `flash_prefill` (torch's blocked flash attention, tile by tile over the paged cache, parts
merged by their log-sum-exp), the rest through the C++ decode kernel or the torch reference. Each
against the torch references, over a step that mixes decodes, short chunks, fresh long chunks and
long chunks after a cached prefix of several tiles; and chunks with bidirectional ranges (Gemma 3's
images) against a mask built here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backend import ops
from backend.ops import attention, cpu_ops
from backend.ops.attention import AttentionMetadata, PrefillSpan, cache_views, flash_prefill
from backend.kernels import reference
from tests.utils.kernels import DEVICE

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BLOCK_SIZE = 16
# (positions cached before this step, tokens this step): two decodes, a short chunk after a prefix,
# a fresh long chunk, a long chunk after a prefix of 150 (five tiles of 32 in these tests).
SEQUENCES = [(40, 1), (7, 1), (20, 10), (0, 100), (150, 80)]


def make_step(sequences, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, parts: int = 2,
              num_decodes: int = 2):
    """A random cache holding each sequence's cached positions, the step's new queries, keys and
    values, and its metadata as the model runner builds it (the first `num_decodes` sequences are
    decodes)."""
    num_blocks = sum(-(-(done + new) // BLOCK_SIZE) for done, new in sequences) + 4
    cache = torch.randn(parts, kv_heads, num_blocks, BLOCK_SIZE, head_dim, dtype=dtype)
    width = max(-(-(done + new) // BLOCK_SIZE) for done, new in sequences)
    free = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(sequences), width, dtype=torch.int32)
    for row, (done, new) in enumerate(sequences):
        count = -(-(done + new) // BLOCK_SIZE)
        tables[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    rows, positions = [], []
    for row, (done, new) in enumerate(sequences):
        rows += [row] * new
        positions += range(done, done + new)
    rows_t, positions_t = torch.tensor(rows), torch.tensor(positions)
    slots = tables[rows_t, positions_t // BLOCK_SIZE].long() * BLOCK_SIZE + positions_t % BLOCK_SIZE
    spans, start = [], num_decodes
    for row, (done, new) in list(enumerate(sequences))[num_decodes:]:
        spans.append(PrefillSpan(start, new, done + new, tables[row, :-(-(done + new) // BLOCK_SIZE)]))
        start += new
    prefill_lens = torch.tensor([done + new for done, new in sequences[num_decodes:]], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=num_decodes,
        decode_seq_lens=torch.tensor([done + 1 for done, _ in sequences[:num_decodes]], dtype=torch.int32),
        decode_block_tables=tables[:num_decodes], prefills=spans,
        prefill_query_starts=torch.tensor([0] + [s.start + s.num_query_tokens - num_decodes for s in spans],
                                          dtype=torch.int32),
        prefill_seq_lens=prefill_lens, prefill_block_tables=tables[num_decodes:],
        max_prefill_query_len=max(s.num_query_tokens for s in spans),
        block_tables=tables, token_rows=rows_t.to(torch.int32), token_context_lens=(positions_t + 1).to(torch.int32))
    tokens = len(rows)
    query = torch.randn(tokens, heads, head_dim, dtype=dtype)
    key = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    value = key if parts == 1 else torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    return query, key, value, cache, meta


def expected_attention(query, key, value, cache, meta, scale, sinks=None, sliding_window=None, k_scale=1.0,
                       v_scale=1.0):
    """The references: the step's keys written into a copy of the cache, then decode and prefill."""
    cache = cache.clone()
    key_cache, value_cache = cache_views(cache)
    if cache.dtype in reference.FP8_KV_DTYPES:  # quantized as they are written
        reference.reshape_and_cache_reference(key, value, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
    else:
        flat_keys = key_cache.reshape(-1, *key_cache.shape[2:])
        flat_keys[meta.slot_mapping] = key
        if cache.shape[0] == 2:
            value_cache.reshape(-1, *value_cache.shape[2:])[meta.slot_mapping] = value
    options = dict(sinks=sinks, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
    parts = []
    if meta.num_decodes:
        parts.append(reference.paged_attention_decode_reference(query[:meta.num_decodes], key_cache, value_cache,
                                                                meta.decode_block_tables, meta.decode_seq_lens,
                                                                scale, **options))
    parts.append(reference.paged_attention_prefill_reference(query[meta.num_decodes:], key_cache, value_cache,
                                                             meta.prefill_block_tables, meta.prefill_query_starts,
                                                             meta.prefill_seq_lens, scale, **options))
    return torch.cat(parts).flatten(1)


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata's tensors on the kernel tests' device."""
    moved = {field.name: getattr(meta, field.name) for field in dataclasses.fields(meta)}
    moved = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in moved.items()}
    moved["prefills"] = [dataclasses.replace(span, block_table=span.block_table.to(DEVICE)) for span in meta.prefills]
    return AttentionMetadata(**moved)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 32 positions, so that the 150-position prefix spans five of them (one partial)."""
    monkeypatch.setattr(attention, "PREFIX_TILE_TOKENS", 32)
    # ...and chunks of this size already count as long, so that the small cases reach flash_prefill.
    monkeypatch.setattr(attention, "FLASH_MIN_QUERY_TOKENS", 64)
    monkeypatch.setattr(attention, "FLASH_OP_MIN_QUERY_TOKENS", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("path", ["fused", "fused_flash", "torch"])
def test_mixed_step_matches_reference(dtype, heads, kv_heads, head_dim, path, monkeypatch):
    """The C++ kernels' path (decodes and the short chunk on the decode kernel, the long chunks on the
    prefill kernel, or with fused_flash in flash tiles) and the torch path (no token_rows: every chunk
    in flash tiles) against the references."""
    torch.manual_seed(0)
    query, key, value, cache, meta = make_step(SEQUENCES, heads, kv_heads, head_dim, dtype)
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "own" if path == "fused" else "flash")
    if path == "torch":
        meta.token_rows = None
    scale = head_dim ** -0.5
    expected = expected_attention(query, key, value, cache, meta, scale)
    actual = attention.paged_attention(query, key, value, cache, meta, scale)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["fused", "torch", "triton"])
def test_fp8_cache_step_matches_reference(dtype, cache_dtype, path):
    """An 8-bit cache (kv_cache_dtype fp8) on each path of a mixed step: the C++ kernel's (decodes and
    the short chunk; the long chunks in flash tiles, dequantized as gathered), the torch path's and the
    Triton kernels' (on CUDA, else through the interpreter). The references write and read the same
    codes with the same scales, so a path differs from them by its sums' order only (the flash tiles
    take the chunk's own keys through the cache's rounding too)."""
    torch.manual_seed(6)
    query, key, value, cache, meta = make_step(SEQUENCES, 9, 3, 64, dtype)
    k_scale, v_scale = 0.05, 0.8  # neither 1: a scale left out or swapped shows
    cache = torch.stack([reference.quantize_kv(cache[0], cache_dtype, k_scale),
                         reference.quantize_kv(cache[1], cache_dtype, v_scale)])
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    expected = expected_attention(query, key, value, cache, meta, 0.125, **scales)
    if path == "triton" and DEVICE.type == "cuda":
        tensors = [t.to(DEVICE) for t in (query, key, value, cache)]
        actual = ops.paged_attention(*tensors, on_device(meta), 0.125, **scales).cpu()
    elif path == "triton":
        with ops.triton_kernels():
            actual = ops.paged_attention(query, key, value, cache, meta, 0.125, **scales)
    else:
        if path == "torch":
            meta.token_rows = None
        actual = attention.paged_attention(query, key, value, cache, meta, 0.125, **scales)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("done,new", [(0, 100), (150, 80), (31, 64), (32, 1)])
def test_flash_prefill_matches_reference_over_cached_prefix(done, new):
    """One chunk through flash_prefill alone: fresh, after a prefix of several tiles (the last one
    partial), a prefix ending one short of a block, a single token after a whole block."""
    torch.manual_seed(1)
    query, key, value, cache, meta = make_step([(done, new)], 6, 2, 64, torch.float32, num_decodes=0)
    span = meta.prefills[0]
    expected = expected_attention(query, key, value, cache, meta, 0.125)
    key_slots = cache[0].view(2, -1, 64)
    value_slots = cache[1].view(2, -1, 64)
    key_slots[:, meta.slot_mapping], value_slots[:, meta.slot_mapping] = key.transpose(0, 1), value.transpose(0, 1)
    actual = flash_prefill(query, key, value, cache, span, 0.125)
    torch.testing.assert_close(actual.flatten(1), expected, **TOLERANCE[torch.float32])


needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels are not built here")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("done,new", [(0, 200), (150, 80), (31, 65), (32, 1), (0, 33), (260, 100)])
def test_prefill_kernel_matches_reference(dtype, heads, kv_heads, head_dim, done, new, tiles):
    """The C++ prefill kernel alone, one chunk over the cache that already holds it: fresh, after a
    prefix, chunks and prefixes that end mid tile (its query tiles are 64 tokens, its key tiles 32,
    or 128 on AMX at head size 64 and 64 at 128), a single token. Blocks outside the table and positions past the context hold NaN:
    a read of any of them would show."""
    torch.manual_seed(7)
    query, key, value, cache, meta = make_step([(done, new)], heads, kv_heads, head_dim, dtype, num_decodes=0)
    span = meta.prefills[0]
    cache_views(cache)[0].reshape(-1, kv_heads, head_dim)[meta.slot_mapping] = key
    cache_views(cache)[1].reshape(-1, kv_heads, head_dim)[meta.slot_mapping] = value
    expected = attention.reference_prefill(query, cache, span, head_dim ** -0.5)
    poisoned = torch.full_like(cache, float("nan"))
    for block in span.block_table.tolist():
        poisoned[:, :, block] = cache[:, :, block]
    poisoned.view(2, kv_heads, -1, head_dim)[:, :, (span.block_table[-1] + 1) * BLOCK_SIZE - (-(done + new) % BLOCK_SIZE):
                                             (span.block_table[-1] + 1) * BLOCK_SIZE] = float("nan")
    actual = cpu_ops.prefill_attention(query, poisoned, span.block_table, span.context_len, head_dim ** -0.5)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("cache_dtype,block_size", [(torch.float8_e4m3fn, 16), (torch.float8_e5m2, 16),
                                                    (torch.bfloat16, 8)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128)])
@pytest.mark.parametrize("done,new", [(150, 80), (260, 100), (300, 40)])
def test_prefill_kernel_copies_tiles_it_cannot_read_in_place(cache_dtype, block_size, heads, kv_heads, head_dim,
                                                              done, new, tiles):
    """bfloat16 queries over an 8-bit cache (its scales neither 1) or over blocks of 8 positions: AMX
    tiles read a bfloat16 cache's 16-position blocks where they lie, and these tiles are copied (and
    widened) instead, into the same products: once a call for a chunk of several query tiles, by the
    one item of a chunk of one (40 tokens). Blocks outside the table hold NaN (or its 8-bit code)."""
    torch.manual_seed(11)
    k_scale, v_scale = (0.05, 0.8) if cache_dtype != torch.bfloat16 else (1.0, 1.0)
    context = done + new
    blocks = -(-context // block_size)
    values = torch.randn(2, kv_heads, blocks + 4, block_size, head_dim)
    if cache_dtype == torch.bfloat16:
        cache = values.to(torch.bfloat16)
    else:
        cache = torch.stack([reference.quantize_kv(values[0], cache_dtype, k_scale),
                             reference.quantize_kv(values[1], cache_dtype, v_scale)])
    table = torch.randperm(blocks + 4)[:blocks].to(torch.int32)
    poisoned = torch.full_like(values, float("nan")).to(cache_dtype)
    poisoned[:, :, table.long()] = cache[:, :, table.long()]
    query = torch.randn(new, heads, head_dim, dtype=torch.bfloat16)
    span = PrefillSpan(0, new, context, table)
    scale = head_dim ** -0.5
    expected = attention.reference_prefill(query, cache, span, scale, k_scale=k_scale, v_scale=v_scale)
    actual = cpu_ops.prefill_attention(query, poisoned, table, context, scale, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[torch.bfloat16])


@needs_kernels
def test_prefill_kernel_leaves_the_callers_subnormals_alone():
    """The kernel's threads flush subnormal results to zero while it runs (its 2^x leaves its smallest
    results to that), and hand the calling thread back its own floating-point mode."""
    tiny = torch.tensor([1e-30], dtype=torch.float32)
    assert (tiny * 1e-10).item() != 0.0  # subnormal, as the process runs by default
    query, key, value, cache, meta = make_step([(40, 80)], 4, 2, 64, torch.float32, num_decodes=0)
    cpu_ops.prefill_attention(query, cache, meta.prefills[0].block_table, meta.prefills[0].context_len, 0.125)
    assert (tiny * 1e-10).item() != 0.0


@needs_kernels
def test_prefill_kernel_float32_within_a_few_ulp():
    """float32 scores and weights from the kernel's polynomial 2^x (relative error ~2e-7): the output
    within 1e-5 of float64 attention over a 600-token chunk after a 300-token prefix, scores spread
    over tens of units (large logits exercise the running max)."""
    torch.manual_seed(8)
    query, key, value, cache, meta = make_step([(300, 600)], 9, 3, 64, torch.float32, num_decodes=0)
    span = meta.prefills[0]
    query = query * 4
    cache_views(cache)[0].reshape(-1, 3, 64)[meta.slot_mapping] = key
    cache_views(cache)[1].reshape(-1, 3, 64)[meta.slot_mapping] = value
    expected = attention.reference_prefill(query.double(), cache.double(), span, 0.125)
    actual = cpu_ops.prefill_attention(query, cache, span.block_table, span.context_len, 0.125)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


def test_flash_prefill_reads_no_block_past_the_prefix():
    """Positions after the cached prefix in its last block, and blocks outside the table, hold NaN:
    the tiles must trim them, not let them into the softmax."""
    torch.manual_seed(2)
    query, key, value, cache, meta = make_step([(40, 70)], 6, 2, 64, torch.float32, num_decodes=0)
    span = meta.prefills[0]
    expected = expected_attention(query, key, value, cache, meta, 0.125)
    poisoned = torch.full_like(cache, float("nan"))
    for block in span.block_table.tolist():  # only the prefix's positions survive
        poisoned[:, :, block] = cache[:, :, block]
    poisoned.view(2, 2, -1, 64)[:, :, meta.slot_mapping] = float("nan")
    actual = flash_prefill(query, key, value, poisoned, span, 0.125)
    torch.testing.assert_close(actual.flatten(1), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_join_the_denominator(dtype):
    """gpt-oss's sinks on the torch path: flash tiles with each head's sink logit merged in by the
    log-sum-exp, as the reference's softmax over [scores, sink]."""
    torch.manual_seed(3)
    query, key, value, cache, meta = make_step(SEQUENCES, 8, 2, 64, dtype)
    sinks = torch.randn(8, dtype=dtype) * 2
    expected = expected_attention(query, key, value, cache, meta, 0.125, sinks=sinks)
    actual = attention.paged_attention(query, key, value, cache, meta, 0.125, sinks=sinks)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


def test_one_part_latent_cache():
    """Multi-head latent attention's cache of one part: keys and values are the same latent."""
    torch.manual_seed(4)
    query, key, value, cache, meta = make_step(SEQUENCES, 4, 1, 96, torch.float32, parts=1)
    expected = expected_attention(query, key, value, cache, meta, 0.1)
    actual = attention.paged_attention(query, key, value, cache, meta, 0.1)
    torch.testing.assert_close(actual, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("path", ["fused", "torch", "triton"])
@pytest.mark.parametrize("window", [None, 4])
def test_bidirectional_ranges_see_their_later_keys(path, window):
    """Gemma 3's images: a query inside a chunk's bidirectional range also sees that range's later keys
    (Hugging Face's (causal or same image) and then the window); a range that started before the
    chunk (a cached prefix) too. The step's decodes and other chunks keep their causal attention, on
    the C++ kernel's path, the torch path and the Triton kernels' (on CUDA, else through the interpreter)."""
    torch.manual_seed(5)
    query, key, value, cache, meta = make_step(SEQUENCES, 4, 2, 64, torch.float32)
    ranges = ((16, 24), (26, 29))  # the chunk holds positions 20..29: the first range began before it
    meta.prefills[0] = dataclasses.replace(meta.prefills[0], bidirectional=ranges)
    if path == "torch":
        meta.token_rows = None
    expected = expected_attention(query, key, value, cache, meta, 0.125, sliding_window=window)
    span = meta.prefills[0]
    rows = slice(span.start, span.start + span.num_query_tokens)
    filled = cache.clone()
    cache_views(filled)[0].reshape(-1, 2, 64)[meta.slot_mapping] = key
    cache_views(filled)[1].reshape(-1, 2, 64)[meta.slot_mapping] = value
    keys, values = (reference.gather_blocks(part, span.block_table)[:, :30].repeat_interleave(2, dim=0)
                    for part in cache_views(filled))
    q_pos, k_pos = torch.arange(20, 30).unsqueeze(1), torch.arange(30).unsqueeze(0)
    visible = k_pos <= q_pos
    for first, end in ranges:
        visible |= (q_pos >= first) & (q_pos < end) & (k_pos >= first) & (k_pos < end)
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = (query[rows].transpose(0, 1) @ keys.transpose(1, 2) * 0.125).masked_fill(~visible, float("-inf"))
    expected[rows] = (scores.softmax(-1) @ values).transpose(0, 1).flatten(1)
    if path == "triton" and DEVICE.type == "cuda":
        tensors = [t.to(DEVICE) for t in (query, key, value, cache)]
        actual = ops.paged_attention(*tensors, on_device(meta), 0.125, sliding_window=window).cpu()
    elif path == "triton":
        with ops.triton_kernels():
            actual = ops.paged_attention(query, key, value, cache, meta, 0.125, sliding_window=window)
    else:
        actual = attention.paged_attention(query, key, value, cache, meta, 0.125, sliding_window=window)
    torch.testing.assert_close(actual, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("amx,ours_on_amx", [(False, False), (True, False), (True, True)])
def test_long_bfloat16_chunks_go_to_torchs_flash_op_where_the_cpu_has_amx_and_ours_does_not(amx, ours_on_amx,
                                                                                        monkeypatch):
    """By default float32 chunks take our kernel everywhere; bfloat16 ones too, except on a CPU with
    AMX where our kernel was built without AMX tiles (torch's op multiplies on them);
    TRITONLLM_CPU_PREFILL_ATTENTION's own / flash override both."""
    monkeypatch.setattr(attention.cpu_ops, "has_amx_bf16", lambda: amx)
    monkeypatch.setattr(attention.cpu_ops, "prefill_on_amx", lambda: ours_on_amx)
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "auto")
    assert attention.own_prefill_kernel(torch.float32)
    assert attention.own_prefill_kernel(torch.bfloat16) is (not amx or ours_on_amx)
    for forced in ("own", "flash"):
        monkeypatch.setattr(attention, "PREFILL_KERNEL", forced)
        assert attention.own_prefill_kernel(torch.bfloat16) is (forced == "own")
