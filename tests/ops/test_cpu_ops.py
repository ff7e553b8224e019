"""The CPU path's C++ ops and packed linears against the torch references they replace."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from backend.ops import cpu_ops
from backend.ops.attention import cache_views
from backend.kernels import reference
from tests.utils.kernels import block_tables_for

# Without a compiler the references run instead; with one, a failed build is a failure here.
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler: the torch references run instead")


def test_library_builds_and_loads():
    assert cpu_ops.available(), "the C++ ops did not build: see the warning logged by backend.ops.cpu_ops"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_fma_peak_scales_with_threads():
    """The measured peak is the FMA chains' rate: on two threads more than one thread's (about twice
    on a quiet host; the bound leaves room for a busy one)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.fma_peak_gflops(seconds=0.2)
        torch.set_num_threads(2)
        two = cpu_ops.fma_peak_gflops(seconds=0.2)
    finally:
        torch.set_num_threads(threads)
    assert one > 1 and 1.1 * one < two < 2.5 * one

DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_reference(dtype):
    torch.manual_seed(0)
    wide = torch.randn(37, 3 * 576, dtype=dtype)
    x = wide[:, 576:1152]  # strided rows, as a split of a fused projection
    residual, weight = torch.randn(37, 576, dtype=dtype), torch.randn(576, dtype=dtype)
    close(cpu_ops.rms_norm(x, weight, 1e-5), reference.rms_norm_reference(x, weight, 1e-5), dtype)
    out, summed = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_sum = reference.add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_sum)  # the residual stream is rounded exactly like torch's add
    close(out, expected_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_reference_exactly(dtype, head_dim):
    torch.manual_seed(0)
    tokens, heads, kv_heads = 11, 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.outer(torch.arange(100, 100 + tokens).float(), torch.rand(head_dim // 2))
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for actual, expected in zip(cpu_ops.rotary_embedding(q, k, cos, sin),
                                reference.rotary_embedding_reference(q, k, cos, sin)):
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_reference(dtype):
    torch.manual_seed(0)
    kv_heads, num_blocks, block_size, dim = 3, 10, 16, 64
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, dtype=dtype)
    kv = torch.randn(9, 2 * kv_heads * dim, dtype=dtype)
    key, value = (t.view(9, kv_heads, dim) for t in kv.split(kv_heads * dim, dim=-1))
    slots = torch.tensor([5, 17, 18, -1, 40, 159, 0, 77, -1])
    expected = cache.clone()
    reference.reshape_and_cache_reference(key, value, *cache_views(expected), slots)
    cpu_ops.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


def check_decode_attention(dtype, heads, kv_heads, head_dim, seq_lens: list[int], num_blocks: int) -> None:
    """One decode token per sequence, over random blocks, against the reference."""
    torch.manual_seed(0)
    block_size = 16
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    width = -(-max(seq_lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in seq_lens]).to(torch.int32)
    query = torch.randn(len(seq_lens), heads, head_dim, dtype=dtype)
    rows = torch.arange(len(seq_lens), dtype=torch.int32)
    actual = cpu_ops.paged_attention(query, cache, tables, rows, lens, head_dim ** -0.5)
    expected = reference.paged_attention_decode_reference(query, *cache_views(cache), tables, lens,
                                                          head_dim ** -0.5)
    close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (16, 2, 128), (4, 1, 128)])
def test_decode_attention_matches_reference(dtype, heads, kv_heads, head_dim, decode_scores):
    # partial chunks, one token
    check_decode_attention(dtype, heads, kv_heads, head_dim, [1, 15, 16, 17, 100, 33, 250], num_blocks=40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_over_long_contexts_matches_reference(dtype, decode_scores):
    """Contexts past kMaxPrefetchBytes of keys and values (the kernel then does not prefetch them
    while the item before computes), between short ones that it does prefetch."""
    check_decode_attention(dtype, 9, 3, 64, [40, 3000, 1100, 7, 2049], num_blocks=400)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trend", [1.0, -1.0])
@pytest.mark.parametrize("drift", [30.0, 120.0])
def test_decode_attention_matches_reference_as_the_running_max_moves(dtype, trend, drift, decode_scores):
    """Scores that rise along the positions (each key gets a growing share of its query heads' sum):
    the kernels' running max then moves in every chunk, the partial last one included, and each move
    rescales the accumulators and the denominator kept in lanes. Falling scores: it never moves after
    the first chunk. Random scores leave both cases mostly untested (the max rarely moves late). A
    drift of 30 in the scaled scores keeps every chunk's weights in the sum; 120 passes exp's range, so
    a max that failed to move would overflow."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 40
    group = heads // kv_heads
    lens = [250, 17, 33, 1]
    tables = block_tables_for(lens, block_size, num_blocks).cpu()  # distinct blocks: each its own trend
    query = torch.randn(len(lens), heads, head_dim)
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim)
    for s, n in enumerate(lens):
        for kvh in range(kv_heads):
            direction = query[s, kvh * group:(kvh + 1) * group].sum(0) / group
            for pos in range(n):
                # the scaled scores drift by about `drift` over the sequence (|direction|^2 / 8 ~ 8 / 3)
                shift = trend * drift * 3 / 8 * pos / n
                cache[0, kvh, tables[s, pos // block_size], pos % block_size] += shift * direction
    query, cache = query.to(dtype), cache.to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    rows = torch.arange(len(lens), dtype=torch.int32)
    actual = cpu_ops.paged_attention(query, cache, tables, rows, lens_t, head_dim ** -0.5)
    # in float64 over the same (rounded) inputs: the bfloat16 reference rounds the scores to bfloat16,
    # ~6% of a weight at scores near 30, and lands 0.03 off where the kernel is within 0.005
    expected = reference.paged_attention_decode_reference(query.double(), *cache_views(cache.double()), tables,
                                                          lens_t, head_dim ** -0.5)
    if dtype == torch.float32 and drift > 30:  # scores near 120 round at ~1e-5: 2.7e-5 off without FMAs
        torch.testing.assert_close(actual.double(), expected, atol=1e-4, rtol=1e-4)
    else:
        close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_ignores_blocks_beyond_each_sequence(dtype, decode_scores):
    """Padding entries of the block table and slots past seq_len may hold anything, even NaN (AMX
    scores a block's 16 rows at once: those past seq_len too)."""
    torch.manual_seed(0)
    cache = torch.full((2, 1, 4, 16, 64), float("nan"), dtype=dtype)
    cache[:, :, 2, :5] = torch.randn(2, 1, 5, 64, dtype=dtype)
    tables = torch.tensor([[2, 3]], dtype=torch.int32)
    query = torch.randn(1, 2, 64, dtype=dtype)
    one = torch.tensor([5], dtype=torch.int32)
    out = cpu_ops.paged_attention(query, cache, tables, torch.zeros(1, dtype=torch.int32), one, 0.125)
    assert torch.isfinite(out).all()
    expected = F.scaled_dot_product_attention(query.view(1, 2, 1, 64).float(), cache[0, :, 2, :5].unsqueeze(0).float(),
                                              cache[1, :, 2, :5].unsqueeze(0).float(), scale=0.125, enable_gqa=True)
    close(out, expected.view(1, 2, 64).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 2, 128)])
def test_prefill_tokens_attend_causally_over_their_blocks(dtype, heads, kv_heads, head_dim, decode_scores):
    """A step of two decodes and two prefill chunks, one after a cached prefix of 21 tokens: each
    token attends to its sequence's positions up to its own, as causal SDPA over the same keys."""
    torch.manual_seed(0)
    num_blocks, block_size = 64, 16
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    # (context before this step, tokens this step) per sequence: two decodes, a fresh and a cached chunk
    sequences = [(40, 1), (7, 1), (0, 37), (21, 50)]
    width = max(-(-(done + new) // block_size) for done, new in sequences)
    tables = torch.randperm(num_blocks)[:width * len(sequences)].view(len(sequences), width).to(torch.int32)
    rows, lens = [], []
    for row, (done, new) in enumerate(sequences):
        rows += [row] * new
        lens += range(done + 1, done + new + 1)
    query = torch.randn(len(rows), heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    actual = cpu_ops.paged_attention(query, cache, tables, torch.tensor(rows, dtype=torch.int32),
                                     torch.tensor(lens, dtype=torch.int32), scale)
    key_cache, value_cache = cache_views(cache)
    start = 0
    for row, (done, new) in enumerate(sequences):
        keys = reference.gather_blocks(key_cache, tables[row])[:, :done + new].unsqueeze(0)  # [1, KVH, L, D]
        values = reference.gather_blocks(value_cache, tables[row])[:, :done + new].unsqueeze(0)
        q = query[start:start + new].transpose(0, 1).unsqueeze(0)
        allowed = torch.arange(done + new).unsqueeze(0) <= torch.arange(new).unsqueeze(1) + done
        expected = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=allowed,
                                                  scale=scale, enable_gqa=True)
        close(actual[start:start + new].float(), expected[0].transpose(0, 1), dtype)
        start += new


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, bias", [(960, True), (80, False), (16, True), (8, False)])
def test_packed_linear_matches_linear(out_features, bias, dtype):
    """Our kernels where they run (bfloat16: AVX512-BF16 without AMX; float32: AVX2 or
    AVX-512), oneDNN's where it packs the dtype, F.linear on the weight as it is elsewhere: whole
    panels and narrower last ones, row tiles and the rows left over, more rows than one chunk,
    strided rows, a bias. bfloat16: each output is the float32 result rounded, give or take the
    last bit; float32: within a few units of the last place of the exact sum (the order differs)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, out_features, bias=bias).to(dtype)
    packed = cpu_ops.PackedLinear(linear, batch_size_hint=64)
    takes = cpu_ops.own_linear_kernel(dtype) and out_features % cpu_ops.out_multiple(dtype) == 0
    assert packed.own_kernel == takes
    assert packed.onednn == (not packed.own_kernel and cpu_ops.onednn_packing(dtype))
    for rows in (1, 7, 64, 300, 1100):
        x = torch.randn(rows, 2 * 576, dtype=dtype)[:, 576:]
        exact = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
        if dtype == torch.bfloat16:
            torch.testing.assert_close(packed(x).float(), exact.to(dtype).float(), rtol=2 ** -7, atol=1e-3)
        else:
            torch.testing.assert_close(packed(x).double(), exact, rtol=1e-5, atol=1e-5)
    assert packed(x.unsqueeze(0)).shape == (1, 1100, out_features)
    if not packed.onednn:  # torch cannot deep-copy oneDNN's blocked tensors (a Parameter's clone keeps no format)
        assert torch.equal(copy.deepcopy(packed)(x), packed(x))  # nothing unpicklable held (a ctypes function)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gated_packed_linear_applies_silu_and_mul(bias, dtype):
    """A gate_up projection packed gated: as a linear it still gives gate then up; silu_and_mul(x)
    is the two ops in a row bit for bit (rows in uneven tiles, strided, more than a chunk)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 2 * 1536, bias=bias).to(dtype)
    gated = cpu_ops.PackedLinear(linear, batch_size_hint=64, gated=True)
    plain = cpu_ops.PackedLinear(linear, batch_size_hint=64)
    assert gated.gated == cpu_ops.own_linear_kernel(dtype)
    if not gated.gated:
        pytest.skip("the CPU kernel that applies it is not in use here")
    for rows in (1, 5, 64, 1100):
        x = torch.randn(rows, 2 * 576, dtype=dtype)[:, 576:]
        assert torch.equal(gated(x), plain(x))
        assert torch.equal(gated.silu_and_mul(x), cpu_ops.silu_and_mul(plain(x)))


def test_onednn_linears_on_request():
    """TRITONLLM_CPU_LINEARS=onednn keeps oneDNN's (or torch's) linears whatever our kernels offer."""
    code = ("import torch; from backend.ops import cpu_ops; "
            "assert not cpu_ops.own_linear_kernel(torch.float32) and not cpu_ops.own_linear_kernel(); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITONLLM_CPU_LINEARS": "onednn"},
                            capture_output=True, text=True, cwd=str(cpu_ops.SOURCES[0].parents[2]))
    assert result.stdout.strip() == "ok", result.stderr


def test_disabled_kernels_fall_back_to_references():
    code = "from backend.ops import cpu_ops; assert not cpu_ops.available(); print('ok')"
    result = subprocess.run([sys.executable, "-c", code], env={"TRITONLLM_CPU_KERNELS": "0", "PATH": ""},
                            capture_output=True, text=True, cwd=str(cpu_ops.SOURCES[0].parents[2]))
    assert result.stdout.strip() == "ok", result.stderr


def test_portable_build_passes_the_attention_and_linear_tests():
    """The attention and linear tests again on the library a CPU without AVX512-BF16 gets (bfloat16
    attention then widens to float32 instead of using the dot-product instruction; linears run on
    oneDNN)."""
    env = {**os.environ, "TRITONLLM_CPU_KERNELS": "portable"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "attention_matches or attend_causally or beyond_each_sequence or packed_linear"],
                            env=env, capture_output=True, text=True, cwd=str(cpu_ops.SOURCES[0].parents[2]))
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    torch.manual_seed(0)
    x = torch.randn(13, 2 * 1536, dtype=dtype) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.0])  # exp's range ends
    close(cpu_ops.silu_and_mul(x), reference.silu_and_mul_reference(x), dtype)


def test_sample_rows_argmax_and_inverse_cdf():
    """Greedy rows are torch's argmax (ties go to the first index); sampled rows draw what the
    torch path draws at the same uniform numbers (bar the odd one on a rounding boundary) and
    never a token whose logit is -inf."""
    from backend.sampling.sampler import inverse_cdf

    torch.manual_seed(0)
    logits = torch.randn(300, 1000) * 3
    logits[:, 7] = float("-inf")
    logits[0, [3, 9]] = 50.0  # a tie: index 3 wins
    temperatures = torch.full((300,), 0.8)
    temperatures[:50] = 0.0
    uniforms = torch.rand(300)
    tokens = cpu_ops.sample_rows(logits, temperatures, uniforms)
    assert torch.equal(tokens[:50], logits[:50].argmax(dim=-1)) and tokens[0] == 3
    expected = inverse_cdf((logits[50:] / 0.8).softmax(dim=-1), uniforms[50:].unsqueeze(1))
    assert (tokens[50:] == expected).float().mean() >= 0.97
    assert not (tokens == 7).any()
    # A vocabulary that is not whole vectors, and a row where only one token is allowed.
    odd = torch.full((2, 1003), float("-inf"))
    odd[0, 1001], odd[1, 500] = 0.0, 2.0
    assert cpu_ops.sample_rows(odd, torch.ones(2), torch.tensor([0.999, 0.0])).tolist() == [1001, 500]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 2, 128)])
@pytest.mark.parametrize("window", [None, 1, 15, 16, 17, 40, 300])
@pytest.mark.parametrize("cap", [None, 1.5])  # scores about N(0, 1): a cap of 1.5 bends most
def test_sliding_window_and_soft_cap_match_reference(dtype, heads, kv_heads, head_dim, window, cap, decode_scores):
    """Decodes and prefill chunks (one after a cached prefix) under windows smaller than, equal to
    and larger than their contexts, on and off block boundaries, with and without a soft cap: each
    token as the reference's decode of its own position."""
    torch.manual_seed(0)
    num_blocks, block_size = 64, 16
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    sequences = [(40, 1), (15, 1), (16, 1), (0, 37), (21, 50)]  # (cached before, tokens this step)
    width = max(-(-(done + new) // block_size) for done, new in sequences)
    tables = torch.randperm(num_blocks)[:width * len(sequences)].view(len(sequences), width).to(torch.int32)
    rows, lens = [], []
    for row, (done, new) in enumerate(sequences):
        rows += [row] * new
        lens += range(done + 1, done + new + 1)
    rows, lens = torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(rows), heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    actual = cpu_ops.paged_attention(query, cache, tables, rows, lens, scale, sliding_window=window,
                                     logits_soft_cap=cap)
    # Against float32 arithmetic: bfloat16 outputs of a few positions are near 1, where its step is 1/128.
    expected = reference.paged_attention_decode_reference(query.float(), *cache_views(cache.float()),
                                                          tables[rows.long()], lens, scale,
                                                          sliding_window=window, logits_soft_cap=cap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_never_reads_blocks_before_it(dtype, decode_scores):
    """Blocks wholly before every token's window may hold anything (freed, reused): NaN there changes
    nothing. Decodes at 70 and 64 positions and a chunk of 6 ending at 70, window 20, blocks of 16."""
    torch.manual_seed(0)
    cache = torch.randn(2, 2, 8, 16, 64, dtype=dtype)
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 3, 4]], dtype=torch.int32)
    rows = torch.tensor([0, 1] + [1] * 6, dtype=torch.int32)
    lens = torch.tensor([70, 64] + list(range(65, 71)), dtype=torch.int32)
    query = torch.randn(len(rows), 4, 64, dtype=dtype)
    expected = cpu_ops.paged_attention(query, cache, tables, rows, lens, 0.125, sliding_window=20)
    cache[:, :, [0, 1, 5, 6]] = float("nan")  # positions 0-31 of both sequences; windows start at 44+
    actual = cpu_ops.paged_attention(query, cache, tables, rows, lens, 0.125, sliding_window=20)
    assert torch.equal(actual, expected)
