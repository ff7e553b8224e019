"""gpt-oss and DeepSeek-V3 against Hugging Face transformers, and the attention pieces they bring:
attention sinks (the Triton kernels against the torch reference, under the interpreter without a
GPU) and DeepSeek's multi-head latent attention with its compressed latent in the paged KV cache."""

from __future__ import annotations

import pytest
import torch

# Imported at collection, before anything else can import Triton without the interpreter.
from backend.kernels import reference
from backend.kernels.paged_attention import paged_attention_decode
from backend.kernels.prefill_attention import paged_attention_prefill

from tests.test_kernels import DEVICE, NUM_KV_HEADS, TOLERANCE, block_tables_for, paged_cache


@pytest.mark.parametrize("window", [None, 16, 40])
def test_decode_attention_with_sinks(window):
    """Per-head sinks, some large enough to take most of the mass: the kernel, with and without
    split-K (the sink counts in one split only), equals the reference; without sinks it differs."""
    torch.manual_seed(7)
    seq_lens = [1, 17, 40, 150]
    _, key_cache, value_cache = paged_cache(24, 16, 64, torch.float32)
    tables = block_tables_for(seq_lens, 16, 24)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(seq_lens), 3 * NUM_KV_HEADS, 64, device=DEVICE)
    sinks = torch.tensor([0.0, 3.0, -2.0, 1.0, 5.0, -0.5], device=DEVICE)
    expected = reference.paged_attention_decode_reference(query, key_cache, value_cache, tables, lens, 0.125,
                                                          sliding_window=window, sinks=sinks)
    plain = reference.paged_attention_decode_reference(query, key_cache, value_cache, tables, lens, 0.125,
                                                       sliding_window=window)
    assert not torch.allclose(plain, expected, atol=1e-3)
    for num_splits in (1, 3):
        out = paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, num_splits=num_splits,
                                     sliding_window=window, sinks=sinks)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [None, 16])
def test_prefill_attention_with_sinks(window):
    torch.manual_seed(8)
    chunks = [(70, 70), (5, 40), (1, 33)]
    seq_lens = [context for _, context in chunks]
    _, key_cache, value_cache = paged_cache(24, 16, 64, torch.float32)
    tables = block_tables_for(seq_lens, 16, 24)
    starts = torch.tensor([0] + torch.tensor([n for n, _ in chunks]).cumsum(0).tolist(), dtype=torch.int32,
                          device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(int(starts[-1]), 2 * NUM_KV_HEADS, 64, device=DEVICE)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], device=DEVICE)
    expected = reference.paged_attention_prefill_reference(query, key_cache, value_cache, tables, starts, lens,
                                                           0.125, sliding_window=window, sinks=sinks)
    out = paged_attention_prefill(query, key_cache, value_cache, tables, starts, lens, 70, 0.125,
                                  sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_sink_reference_is_hugging_face_eager():
    """The reference's softmax with sinks is gpt-oss's eager attention (transformers), on one
    sequence with a causal mask."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(9)
    heads, kv_heads, length, dim = 4, 2, 9, 16
    q, k, v = torch.randn(heads, length, dim), torch.randn(kv_heads, length, dim), torch.randn(kv_heads, length, dim)
    sinks = torch.randn(heads) * 2
    mask = torch.full((length, length), float("-inf")).triu(1)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks, training=False)
    hf, _ = eager_attention_forward(module, q[None], k[None], v[None], mask[None, None], 0.25)
    ours = reference.causal_attention_reference(q, k, v, torch.arange(length), 0.25, sinks=sinks)
    torch.testing.assert_close(ours.transpose(0, 1), hf[0])
