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

from backend import LLM, SamplingParams
from tests.utils.kernels import DEVICE, NUM_KV_HEADS, TOLERANCE, block_tables_for, paged_cache
from tests.utils.models import (PROMPTS, VOCAB, assert_greedy_matches_hf, assert_tensor_parallel_matches_hf,
                                hf_greedy_logprobs, tiny_model)


@pytest.mark.parametrize("window", [None, 16, 40])
def test_decode_attention_kernel_with_sinks(window):
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
def test_prefill_attention_kernel_with_sinks(window):
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


# -- the families against transformers --------------------------------------------------------------------------

DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                 "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
DEEPSEEK_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                      qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=256, initializer_range=0.3)
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
CASES = {
    "gpt-oss": ("GptOss", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                               num_experts_per_tok=2, sliding_window=16, swiglu_limit=1.5,
                               max_position_embeddings=256, initializer_range=0.3, rope_parameters=GPT_OSS_YARN)),
    "deepseek-v3": ("DeepseekV3", dict(DEEPSEEK_SHAPE, num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1,
                                       n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                       moe_intermediate_size=32, n_shared_experts=2, routed_scaling_factor=2.5,
                                       rope_parameters=DEEPSEEK_YARN)),
    "deepseek-dense": ("DeepseekV3", dict(DEEPSEEK_SHAPE, q_lora_rank=24, first_k_dense_replace=2,
                                          rope_parameters=DEEPSEEK_YARN)),
    "deepseek-dense-no-q-lora": ("DeepseekV3", dict(DEEPSEEK_SHAPE, q_lora_rank=None, first_k_dense_replace=2,
                                                    attention_bias=True, rope_interleave=False)),
}


def tiny(name: str, path) -> torch.nn.Module:
    import transformers

    prefix, options = CASES[name]
    return tiny_model(path, getattr(transformers, f"{prefix}Config")(**options), perturb="all",
                      attn_implementation="eager")


@pytest.mark.parametrize("name", list(CASES))
def test_family_matches_hf(tmp_path, name):
    assert_greedy_matches_hf(tiny(name, tmp_path), tmp_path, name)


def test_latent_kv_cache_bytes_per_token(tmp_path):
    """DeepSeek's cache holds one latent (kv_lora_rank + qk_rope_head_dim) per token and layer, no
    heads: 40 floats here against full attention's 4 heads x (24 + 12); the engine sizes its blocks
    by it. DeepSeek-V3's own shape in bfloat16: 1,152 bytes against 81,920 (71x fewer)."""
    from backend.layers.mla import LatentAttentionArgs, cache_bytes_per_token

    tiny("deepseek-dense", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20)
    runner = llm.llm_engine.runner
    cache = runner.kv_caches[0]
    assert (cache.shape[0], cache.shape[1], cache.shape[3], cache.shape[4]) == (1, 1, runner.block_size, 40)
    mla = runner.args.mla
    latent, full = cache_bytes_per_token(mla, 4, element_bytes=4)
    assert (latent, full) == (40 * 4, 4 * (24 + 12) * 4)
    assert runner.block_bytes == latent * runner.block_size * 2  # two layers
    assert runner.num_blocks == (1 << 20) // runner.block_bytes
    v3 = LatentAttentionArgs(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)
    assert cache_bytes_per_token(v3, 128, element_bytes=2) == (1152, 81920)


@pytest.mark.parametrize("name", ["deepseek-dense", "gpt-oss"])
def test_family_on_triton_kernels(tmp_path, name):
    """The same greedy tokens through the Triton kernels (the interpreter on a CPU): latent
    attention reads its one-part cache as keys and values; sinks start the online softmax."""
    from backend import ops

    model = tiny(name, tmp_path)
    prompts = [PROMPTS[1][:20], PROMPTS[0]]
    context = ops.triton_kernels() if DEVICE.type == "cpu" else torch.no_grad()
    with context:
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
                  max_num_batched_tokens=16, max_num_seqs=4, device=DEVICE.type)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for output, prompt in zip(outputs, prompts):
        assert output.outputs[0].token_ids == hf_greedy_logprobs(model, prompt, 5)[0], name


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek-v3"])
def test_tensor_parallel_matches_hf(tmp_path, name):
    """tp=2 over gloo: gpt-oss's sinks split with their heads; DeepSeek's heads (q_b_proj, kv_b_proj)
    split while every rank keeps the whole latent; experts split along their intermediate size."""
    assert_tensor_parallel_matches_hf(tiny(name, tmp_path), tmp_path, name)
