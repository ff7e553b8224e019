"""Each Triton kernel against its torch reference on random inputs, and the engine's greedy tokens
unchanged when the model runs on the Triton kernels. Without a GPU the kernels run on CPU tensors
through Triton's interpreter (backend/kernels/jit.py sets it up), so shapes stay small; with one
(tools/gpu_check.sh) the same tests run on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Imported at collection, before anything else can import Triton without the interpreter.
from backend.kernels import reference
from backend.kernels.activation import silu_and_mul
from backend.kernels.cache import reshape_and_cache
from backend.kernels.paged_attention import choose_num_splits, paged_attention_decode
from backend.kernels.prefill_attention import paged_attention_prefill
from backend.kernels.rms_norm import add_rms_norm, rms_norm
from backend.kernels.rotary import rotary_embedding
from tests.utils.kernels import DEVICE, NUM_KV_HEADS, TOLERANCE, block_tables_for, on_torch_and_triton, paged_cache

SHAPES = [(block_size, head_dim, group) for block_size in (16, 32) for head_dim in (64, 128)
          for group in (1, 3, 4)]


@pytest.mark.parametrize("block_size,head_dim,group", SHAPES)
def test_decode_attention_matches_reference(block_size, head_dim, group):
    torch.manual_seed(0)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 150]  # ragged, across blocks and tiles
    _, key_cache, value_cache = paged_cache(24, block_size, head_dim, torch.float32)
    tables = block_tables_for(seq_lens, block_size, 24)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, device=DEVICE)
    expected = reference.paged_attention_decode_reference(query, key_cache, value_cache, tables, lens, 0.1)
    for num_splits in (1, 3):  # 3 splits: flash-decoding, the 150-token context over three programs
        out = paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_half_precision(dtype):
    torch.manual_seed(1)
    seq_lens = [7, 40, 90]
    _, key_cache, value_cache = paged_cache(16, 16, 64, dtype)
    tables = block_tables_for(seq_lens, 16, 16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(3, 6, 64, dtype=dtype, device=DEVICE)
    expected = reference.paged_attention_decode_reference(query, key_cache, value_cache, tables, lens, 0.125)
    for num_splits in (1, 2):
        out = paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_decode_attention_padded_slots_give_zeros():
    """A CUDA graph's batch is rounded up with length-0 entries: they must come out as zeros (not
    NaN) and leave the real ones alone, with or without split-K."""
    torch.manual_seed(2)
    _, key_cache, value_cache = paged_cache(8, 16, 64, torch.float32)
    tables = block_tables_for([20, 16], 16, 8)
    lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 4, 64, device=DEVICE)
    expected = reference.paged_attention_decode_reference(query[:1], key_cache, value_cache, tables[:1],
                                                          lens[:1], 0.125)
    for num_splits in (1, 4):
        out = paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, num_splits=num_splits)
        torch.testing.assert_close(out[:1], expected, **TOLERANCE[torch.float32])
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("block_size,head_dim,group", SHAPES)
def test_prefill_attention_matches_reference(block_size, head_dim, group):
    torch.manual_seed(3)
    # (new query tokens, context length): a fresh prompt longer than a 64-query tile, a chunk after a
    # cached prefix, one token over a prefix, a one-token prompt.
    chunks = [(70, 70), (5, 5 + 2 * block_size + 3), (1, 33), (1, 1)]
    seq_lens = [context for _, context in chunks]
    _, key_cache, value_cache = paged_cache(24, block_size, head_dim, torch.float32)
    tables = block_tables_for(seq_lens, block_size, 24)
    starts = torch.tensor([0] + torch.tensor([n for n, _ in chunks]).cumsum(0).tolist(), dtype=torch.int32,
                          device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(int(starts[-1]), NUM_KV_HEADS * group, head_dim, device=DEVICE)
    expected = reference.paged_attention_prefill_reference(query, key_cache, value_cache, tables, starts, lens, 0.1)
    out = paged_attention_prefill(query, key_cache, value_cache, tables, starts, lens, 70, 0.1)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


WINDOWS = [1, 16, 17, 40, 300]  # smaller than, on and off block boundaries, larger than the contexts


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cap", [None, 1.5])
def test_decode_attention_sliding_window_and_soft_cap(window, cap):
    """Windows against the reference, with and without split-K; a soft cap of 1.5 bends most of
    these scores (about N(0, 1)). Blocks wholly before each window hold NaN: never read."""
    torch.manual_seed(5)
    seq_lens = [1, 16, 17, 40, 150]
    cache, key_cache, value_cache = paged_cache(24, 16, 64, torch.float32)
    tables = block_tables_for(seq_lens, 16, 24)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(seq_lens), 6, 64, device=DEVICE)
    expected = reference.paged_attention_decode_reference(query, key_cache, value_cache, tables, lens, 0.125,
                                                          sliding_window=window, logits_soft_cap=cap)
    for i, n in enumerate(seq_lens):
        unseen = max(0, n - window) // 16  # whole blocks before the window
        cache[:, :, tables[i, :unseen].long()] = float("nan")
    for num_splits in (1, 3):
        out = paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, num_splits=num_splits,
                                     sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cap", [None, 1.5])
def test_prefill_attention_sliding_window_and_soft_cap(window, cap):
    """A fresh 70-token prompt (two query tiles), a chunk after a cached prefix and one token over a
    prefix, under windows and a soft cap; blocks before the first query's window hold NaN."""
    torch.manual_seed(6)
    chunks = [(70, 70), (5, 40), (1, 33)]
    seq_lens = [context for _, context in chunks]
    cache, key_cache, value_cache = paged_cache(24, 16, 64, torch.float32)
    tables = block_tables_for(seq_lens, 16, 24)
    starts = torch.tensor([0] + torch.tensor([n for n, _ in chunks]).cumsum(0).tolist(), dtype=torch.int32,
                          device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(int(starts[-1]), 6, 64, device=DEVICE)
    expected = reference.paged_attention_prefill_reference(query, key_cache, value_cache, tables, starts, lens,
                                                           0.125, sliding_window=window, logits_soft_cap=cap)
    for i, (new, context) in enumerate(chunks):
        unseen = max(0, context - new + 1 - window) // 16
        cache[:, :, tables[i, :unseen].long()] = float("nan")
    out = paged_attention_prefill(query, key_cache, value_cache, tables, starts, lens, 70, 0.125,
                                  sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_attention_half_precision(dtype):
    torch.manual_seed(4)
    _, key_cache, value_cache = paged_cache(12, 16, 64, dtype)
    tables = block_tables_for([50, 9], 16, 12)
    starts = torch.tensor([0, 20, 29], dtype=torch.int32, device=DEVICE)  # 20 new tokens over 30, then 9
    lens = torch.tensor([50, 9], dtype=torch.int32, device=DEVICE)
    query = torch.randn(29, 8, 64, dtype=dtype, device=DEVICE)
    expected = reference.paged_attention_prefill_reference(query, key_cache, value_cache, tables, starts, lens, 0.125)
    out = paged_attention_prefill(query, key_cache, value_cache, tables, starts, lens, 20, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_reshape_and_cache_writes_slots(dtype, block_size, head_dim):
    torch.manual_seed(5)
    cache, key_cache, value_cache = paged_cache(6, block_size, head_dim, dtype)
    expected = cache.clone()
    # Keys and values as views of a fused QKV projection, the way the model hands them over.
    qkv = torch.randn(5, 4 * head_dim + 2 * NUM_KV_HEADS * head_dim, dtype=dtype, device=DEVICE)
    key = qkv[:, 4 * head_dim:(4 + NUM_KV_HEADS) * head_dim].view(5, NUM_KV_HEADS, head_dim)
    value = qkv[:, (4 + NUM_KV_HEADS) * head_dim:].view(5, NUM_KV_HEADS, head_dim)
    slots = torch.tensor([0, block_size - 1, -1, 3 * block_size + 2, 6 * block_size - 1], device=DEVICE)
    reference.reshape_and_cache_reference(key, value, expected[0].permute(1, 2, 0, 3),
                                          expected[1].permute(1, 2, 0, 3), slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(key_cache[3, 2], key[3]) and torch.equal(value_cache[5, block_size - 1], value[4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_and_fused_residual_add(dtype, hidden):
    torch.manual_seed(6)
    x = torch.randn(9, hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn(9, hidden, dtype=dtype, device=DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), reference.rms_norm_reference(x, weight, 1e-5),
                               **TOLERANCE[dtype])
    out, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = reference.add_rms_norm_reference(x, residual, weight, 1e-5)
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    torch.testing.assert_close(new_residual, expected_residual, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 1)])
def test_rotary_embedding_in_place_on_fused_qkv(dtype, head_dim, group):
    torch.manual_seed(7)
    num_heads = NUM_KV_HEADS * group
    q_size, kv_size = num_heads * head_dim, NUM_KV_HEADS * head_dim
    qkv = torch.randn(11, q_size + 2 * kv_size, dtype=dtype, device=DEVICE)
    query = qkv[:, :q_size].view(11, num_heads, head_dim)
    key = qkv[:, q_size:q_size + kv_size].view(11, NUM_KV_HEADS, head_dim)
    angles = torch.randn(11, head_dim // 2, device=DEVICE) * 3
    cos, sin = angles.cos().repeat(1, 2).to(dtype), angles.sin().repeat(1, 2).to(dtype)
    expected_q, expected_k = reference.rotary_embedding_reference(query, key, cos, sin)
    value_before = qkv[:, q_size + kv_size:].clone()
    out_q, out_k = rotary_embedding(query, key, cos, sin)
    assert out_q.data_ptr() == query.data_ptr()  # rotated in place
    torch.testing.assert_close(query, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(key, expected_k, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, q_size + kv_size:], value_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [256, 1536 + 64])
def test_silu_and_mul(dtype, size):
    torch.manual_seed(8)
    x = torch.randn(6, 2 * size, dtype=dtype, device=DEVICE) * 3
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul_reference(x), **TOLERANCE[dtype])


def test_num_splits_fill_the_gpu_and_stay_within_the_context():
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 16  # capped
    assert choose_num_splits(4, 8, 32768, num_sms=132) == 9  # 4 * 8 * 9 programs >= 2 * 132
    assert choose_num_splits(1, 8, 100, num_sms=132) == 2  # no more splits than 64-key tiles
    assert choose_num_splits(256, 8, 32768, num_sms=132) == 1


def test_engine_greedy_tokens_unchanged_on_triton_kernels(tmp_path):
    """A tiny random Llama (GQA 3, head_dim 32), float32: the same greedy tokens from the torch ops
    on the CPU and from the Triton kernels (through the interpreter, or on CUDA with its graphs),
    across fresh prompts, a prefix-cache hit, chunked prefill and batched decode; and both the same
    as Hugging Face."""
    from transformers import LlamaConfig

    from backend import LLM, SamplingParams
    from tests.utils.models import tiny_model

    model = tiny_model(tmp_path, LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=384,
                                             num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                             max_position_embeddings=256, initializer_range=0.3))
    shared = [(11 * j) % 250 + 3 for j in range(40)]
    prompts = [shared + [5, 6, 7], shared + [9], [(7 * j) % 250 + 3 for j in range(90)], [42]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate(device: str) -> list[list[int]]:
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20,
                  max_num_batched_tokens=64, max_num_seqs=8, device=device)
        first = llm.generate(prompts[:1], params)  # fills the prefix cache for the second prompt
        return [o.outputs[0].token_ids for o in first + llm.generate(prompts[1:], params)]

    on_torch, on_triton = on_torch_and_triton(generate)
    assert on_triton == on_torch
    for ids, tokens in zip(prompts, on_torch):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert tokens == expected


def test_cuda_graph_sizes_and_padding():
    from backend.worker.cuda_graphs import cuda_graph_batch_sizes, padded_batch_size

    assert cuda_graph_batch_sizes(256)[:5] == [1, 2, 4, 8, 16] and cuda_graph_batch_sizes(256)[-1] == 256
    assert len(cuda_graph_batch_sizes(256)) == 3 + 32
    assert cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_batch_sizes(1) == [1]
    assert cuda_graph_batch_sizes(1000)[-1] == 256
    sizes = cuda_graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 8, 9, 63, 64)] == [1, 4, 8, 8, 16, 64, 64]
    assert padded_batch_size(65, sizes) is None


def test_kv_budget_and_profiling_step():
    from backend.config import EngineConfig
    from backend.config import max_step_tokens
    from backend.core.kv_memory import gpu_kv_cache_budget, profile_sequence_lengths

    gib = 1 << 30
    # 80 GiB GPU at 0.9: 72 GiB, less 3 GiB in use, 2 GiB of activations, the 256 MiB reserve.
    assert gpu_kv_cache_budget(80 * gib, 77 * gib, 2 * gib, 0.9) == 67 * gib - (256 << 20)
    assert max_step_tokens(EngineConfig(), 8192, "cuda") == 2048
    assert max_step_tokens(EngineConfig(), 8192, "cpu") == 512
    assert max_step_tokens(EngineConfig(enable_chunked_prefill=False), 8192, "cpu") == 8192
    assert max_step_tokens(EngineConfig(max_num_batched_tokens=1024), 8192, "cpu") == 1024
    assert profile_sequence_lengths(2048, 8192) == [2048]
    assert profile_sequence_lengths(5000, 2048) == [2048, 2048, 904]


def test_cpu_kv_cache_is_resident_zeros_from_the_start():
    """The CPU cache is faulted in at allocation (first touches inside a step cost its prefill up
    to 45%), and on huge pages where the kernel gives them to a madvise'd private mapping."""
    from backend.core.kv_memory import KVCacheLayout, allocate_kv_caches

    layout = KVCacheLayout(num_layers=2, num_kv_heads=3, block_size=16, head_dim=64, dtype=torch.bfloat16)
    caches = allocate_kv_caches(layout, 2048, torch.device("cpu"))  # 2 x 24 MiB
    kib = 2 * 3 * 2048 * 16 * 64 * 2 // 1024
    for cache in caches:  # before anything reads it (a read maps untouched pages to the zero page)
        assert _smaps_kib(cache.data_ptr(), "Rss") >= kib
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text(encoding="utf-8"):
        assert _smaps_kib(caches[0].data_ptr(), "AnonHugePages") > 0, "the cache is on 4 KiB pages"
    assert [tuple(c.shape) for c in caches] == [layout.shape(2048)] * 2
    assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)


def _smaps_kib(address: int, field: str) -> int:
    """A field (Rss, AnonHugePages, ...) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text(encoding="utf-8").splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    return 0
