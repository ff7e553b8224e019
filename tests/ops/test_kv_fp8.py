"""The 8-bit KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) on each attention path: the C++
CPU kernels and the Triton kernels (on the CPU through the interpreter) against the torch
references, which quantize keys and values as x / scale rounded to float8 and read them back as
code * scale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

# Imported at collection, before anything else can import Triton without the interpreter.
from backend.kernels import reference
from backend.kernels.cache import reshape_and_cache
from backend.kernels.paged_attention import paged_attention_decode
from backend.kernels.prefill_attention import paged_attention_prefill
from backend.ops import cpu_ops
from backend.ops.attention import cache_views
from tests.utils.kernels import DEVICE

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.float32, torch.bfloat16]
SCALES = (0.05, 0.8)  # k_scale, v_scale: neither 1, so that a scale left out or swapped shows
# An attention output against the reference, both over the same 8-bit cache: the same codes, read
# alike, so only the kernels' sums differ.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def values_to_store(dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.Tensor:
    """[3 rows, 2 KV heads, 64]: normal values, values in the 8-bit type's subnormal range (as
    multiples of the scale) and some past its largest value (saturated)."""
    torch.manual_seed(0)
    tiny = torch.finfo(cache_dtype).smallest_normal
    rows = [torch.randn(2, 64) * 4, torch.randn(2, 64) * tiny * 2, torch.randn(2, 64) * torch.finfo(cache_dtype).max]
    return (torch.stack(rows) * SCALES[0]).to(dtype)


def test_float8_codes_read_as_torch_reads_them():
    codes = torch.arange(256, dtype=torch.uint8)
    for cache_dtype in FP8:
        as_float = codes.view(cache_dtype).float()
        finite = as_float.isfinite()
        assert torch.equal(reference.fp8_to_float32(codes.view(cache_dtype))[finite], as_float[finite])


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_rounds_as_torch(dtype, cache_dtype, path):
    """The C++ write and the Triton one (CUDA where there is one, else through the interpreter) give
    torch's float8 rounding of x / scale (clamped), code for code."""
    key = values_to_store(dtype, cache_dtype)
    value = key.flip(0) * (SCALES[1] / SCALES[0])
    cache = torch.zeros(2, 2, 4, 16, 64, dtype=torch.uint8).view(cache_dtype)
    expected = cache.clone()
    slots = torch.tensor([5, -1, 40])
    reference.reshape_and_cache_reference(key, value, *cache_views(expected), slots, *SCALES)
    if path == "cpu":
        cpu_ops.reshape_and_cache(key, value, cache, slots, *SCALES)
    else:
        cache = cache.to(DEVICE)
        reshape_and_cache(key.to(DEVICE), value.to(DEVICE), *cache_views(cache), slots.to(DEVICE), *SCALES)
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))


def random_fp8_cache(kv_heads: int, num_blocks: int, head_dim: int, cache_dtype: torch.dtype) -> torch.Tensor:
    """A cache [2, KVH, blocks, 16, D] of the codes of random keys and values at SCALES."""
    cache = torch.randn(2, kv_heads, num_blocks, 16, head_dim)
    return torch.stack([reference.quantize_kv(cache[0], cache_dtype, SCALES[0]),
                        reference.quantize_kv(cache[1], cache_dtype, SCALES[1])])


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 2, 128)])
def test_cpu_attention_over_fp8_cache_matches_reference(dtype, cache_dtype, heads, kv_heads, head_dim, decode_scores):
    """Decodes (over contexts past the kernel's prefetch bound too) and a prefill chunk after a
    cached prefix, in one call of the C++ kernel, against the references over the same codes."""
    torch.manual_seed(0)
    num_blocks = 400
    cache = random_fp8_cache(kv_heads, num_blocks, head_dim, cache_dtype)
    seq_lens = [1, 17, 250, 3000]
    width = -(-max(seq_lens) // 16)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in range(len(seq_lens) + 1)]).to(torch.int32)
    query = torch.randn(len(seq_lens) + 30, heads, head_dim, dtype=dtype)
    rows = torch.tensor(list(range(len(seq_lens))) + [len(seq_lens)] * 30, dtype=torch.int32)
    lens = torch.tensor(seq_lens + list(range(41, 71)), dtype=torch.int32)  # 30 tokens after 40 cached
    scale = head_dim ** -0.5
    actual = cpu_ops.paged_attention(query, cache, tables, rows, lens, scale, k_scale=SCALES[0], v_scale=SCALES[1])
    key_cache, value_cache = cache_views(cache)
    expected_decode = reference.paged_attention_decode_reference(
        query[:len(seq_lens)], key_cache, value_cache, tables[:len(seq_lens)], lens[:len(seq_lens)], scale,
        k_scale=SCALES[0], v_scale=SCALES[1])
    expected_prefill = reference.paged_attention_prefill_reference(
        query[len(seq_lens):], key_cache, value_cache, tables[len(seq_lens):], torch.tensor([0, 30]),
        torch.tensor([70]), scale, k_scale=SCALES[0], v_scale=SCALES[1])
    torch.testing.assert_close(actual.float(), torch.cat([expected_decode, expected_prefill]).float(),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_attention_reads_every_code_exactly(dtype, cache_dtype, head_dim, decode_scores):
    """Each decode attends to one position, so its output is that position's value row times v_scale
    (one rounding to the output type): every finite code, subnormals and signs included, as torch
    reads it. The bfloat16 kernel widens codes by table lookup, float32 by conversion."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[~codes.view(cache_dtype).float().isfinite()] = 0
    rows = codes.view(-1, head_dim)  # 4 or 2 sequences of one position, one value row each
    cache = torch.zeros(2, 1, len(rows), 16, head_dim, dtype=torch.uint8)
    cache[1, 0, :, 0] = rows
    cache = cache.view(cache_dtype)
    tables = torch.arange(len(rows), dtype=torch.int32).view(-1, 1)
    query = torch.randn(len(rows), 1, head_dim, dtype=dtype)
    actual = cpu_ops.paged_attention(query, cache, tables, torch.arange(len(rows), dtype=torch.int32),
                                     torch.ones(len(rows), dtype=torch.int32), 0.125, k_scale=SCALES[0],
                                     v_scale=SCALES[1])
    expected = (rows.view(cache_dtype).float() * SCALES[1]).to(dtype)
    assert torch.equal(actual[:, 0], expected)


@pytest.mark.slow
def test_the_build_without_vbmi_reads_an_fp8_cache_alike():
    """The bfloat16 kernel widens codes 64 at a time by byte tables where the library is built for
    AVX512-VBMI, 32 at a time by word tables where only AVX512-BF16 is there (Cooper Lake): on a CPU
    with both, the CPU attention tests above again on the library built for Cooper Lake (~40 s)."""
    if os.environ.get("TRITONLLM_CPU_ARCH"):
        pytest.skip("the library is already built for TRITONLLM_CPU_ARCH")
    if not {"avx512_bf16", "avx512vbmi"} <= set(cpu_ops.cpu_flags().split()):
        pytest.skip("this CPU lacks AVX512-VBMI or AVX512-BF16: the suite's own build has no byte tables")
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler: the torch references run instead")
    env = {**os.environ, "TRITONLLM_CPU_ARCH": "cooperlake"}
    env.pop("TRITONLLM_CPU_KERNELS", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "test_cpu_attention"], env=env, capture_output=True, text=True,
                            encoding="utf-8", errors="replace", cwd=str(cpu_ops.SOURCES[0].parents[2]))
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_attention_over_fp8_cache_matches_reference(dtype, cache_dtype):
    """The decode and prefill kernels (through the interpreter) read an 8-bit cache with its scales."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, num_blocks = 4, 2, 64, 24
    cache = random_fp8_cache(kv_heads, num_blocks, head_dim, cache_dtype)
    key_cache, value_cache = cache_views(cache)
    scale = head_dim ** -0.5
    seq_lens = torch.tensor([1, 70, 33], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:15].view(3, 5).to(torch.int32)
    query = torch.randn(3, heads, head_dim, dtype=dtype)
    on_device = cache_views(cache.to(DEVICE))  # CUDA where there is one, else the interpreter
    actual = paged_attention_decode(query.to(DEVICE), *on_device, tables.to(DEVICE), seq_lens.to(DEVICE), scale,
                                    k_scale=SCALES[0], v_scale=SCALES[1]).cpu()
    expected = reference.paged_attention_decode_reference(query, key_cache, value_cache, tables, seq_lens, scale,
                                                          k_scale=SCALES[0], v_scale=SCALES[1])
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])
    starts = torch.tensor([0, 20, 21], dtype=torch.int32)  # 20 tokens after 50 cached, one after 32
    query = torch.randn(21, heads, head_dim, dtype=dtype)
    lens = torch.tensor([70, 33], dtype=torch.int32)
    actual = paged_attention_prefill(query.to(DEVICE), *on_device, tables[1:].to(DEVICE), starts.to(DEVICE),
                                     lens.to(DEVICE), 20, scale, k_scale=SCALES[0], v_scale=SCALES[1]).cpu()
    expected = reference.paged_attention_prefill_reference(query, key_cache, value_cache, tables[1:], starts, lens,
                                                           scale, k_scale=SCALES[0], v_scale=SCALES[1])
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


def test_scales_leave_a_float_cache_alone():
    """A checkpoint's scales reach every layer, whatever the cache: a float cache's paths ignore them."""
    torch.manual_seed(0)
    cache = torch.randn(2, 2, 8, 16, 64)
    query, tables, lens = torch.randn(2, 4, 64), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor([20, 9])
    lens = lens.to(torch.int32)
    on_device = [tensor.to(DEVICE) for tensor in (query, *cache_views(cache.to(DEVICE)), tables, lens)]
    plain = paged_attention_decode(*on_device, 0.125)
    scaled = paged_attention_decode(*on_device, 0.125, k_scale=0.5, v_scale=3.0)
    assert torch.equal(plain, scaled)
    rows = torch.arange(2, dtype=torch.int32)
    assert torch.equal(cpu_ops.paged_attention(query, cache, tables, rows, lens, 0.125),
                       cpu_ops.paged_attention(query, cache, tables, rows, lens, 0.125, k_scale=0.5, v_scale=3.0))
