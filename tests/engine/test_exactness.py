"""Greedy tokens and logprobs identical to Hugging Face transformers (float32, same weights),
whatever the batching: ample KV, a KV budget small enough to force preemptions, two sequences."""

from __future__ import annotations

import math

import pytest
import torch

from backend import LLM, SamplingParams
from tests.utils.models import BLOCK_BYTES_FP32
from tests.utils.prompts import PROMPTS

MAX_TOKENS = 32


def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for p in PROMPTS]


def assert_matches_hf(outputs, prompts, hf_greedy):
    mismatches = []
    for output, ids in zip(outputs, prompts):
        expected = hf_greedy(tuple(ids), MAX_TOKENS)
        if output.outputs[0].token_ids != expected:
            mismatches.append((output.prompt_token_ids[:6], output.outputs[0].token_ids, expected))
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ from HF: {mismatches[:2]}"


def greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_greedy_matches_hf_with_ample_kv(llm, tokenizer, hf_greedy):
    prompts = prompt_ids(tokenizer)
    assert len(prompts) >= 16
    outputs = llm.generate(prompts, greedy())
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_matches_hf(outputs, prompts, hf_greedy)


def test_greedy_matches_hf_under_preemption(model_path, tokenizer, hf_greedy):
    small = LLM(model_path, dtype="float32", kv_cache_memory_bytes=40 * BLOCK_BYTES_FP32,
                max_num_batched_tokens=512)
    assert small.llm_engine.kv_cache.num_blocks == 40
    prompts = prompt_ids(tokenizer)
    outputs = small.generate(prompts, greedy())
    preemptions = {m.name: m.value for m in small.get_metrics()}["vllm:num_preemptions"]
    assert preemptions > 0, "the KV budget was meant to force preemptions"
    assert_matches_hf(outputs, prompts, hf_greedy)
    assert small.llm_engine.kv_cache.num_free_blocks == 40


def test_greedy_matches_hf_two_at_a_time_without_prefix_cache(model_path, tokenizer, hf_greedy):
    narrow = LLM(model_path, dtype="float32", max_num_seqs=2, kv_cache_memory_bytes=128 << 20,
                 enable_prefix_caching=False, max_num_batched_tokens=64)  # long prompts get chunked
    prompts = prompt_ids(tokenizer)
    assert_matches_hf(narrow.generate(prompts, greedy()), prompts, hf_greedy)


def test_logprobs_match_hf_log_softmax(llm, tokenizer, hf_model):
    prompts = prompt_ids(tokenizer)[:6]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=5))
    for output, ids in zip(outputs, prompts):
        completion = output.outputs[0]
        full = torch.tensor([ids + completion.token_ids])
        with torch.inference_mode():
            reference = hf_model(full).logits[0].float().log_softmax(-1)
        total = 0.0
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(ids) - 1 + step]
            assert len(entry) in (5, 6) and token in entry
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == 1  # greedy picks the top token
            top = row.topk(5)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                assert abs(entry[tid].logprob - lp) < 1e-4
            total += entry[token].logprob
        assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-6)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("architecture,rope_scaling", [("llama", None), ("llama", LLAMA3_ROPE), ("qwen2", None)])
def test_tiny_random_models_match_hf(tmp_path, architecture, rope_scaling):
    """GQA, untied embeddings, Llama 3 RoPE scaling and Qwen2's QKV biases on tiny random models."""
    from transformers import LlamaConfig, Qwen2Config

    from tests.utils.models import tiny_model

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=False, initializer_range=0.3)
    if architecture == "qwen2":  # random biases, so a dropped bias would show
        model = tiny_model(tmp_path, Qwen2Config(**shape), perturb="qkv_bias")
    else:
        model = tiny_model(tmp_path, LlamaConfig(**shape, rope_scaling=rope_scaling))
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40, 130, 17])]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for output, ids in zip(outputs, prompts):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert output.outputs[0].token_ids == expected
