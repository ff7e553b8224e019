"""Engine behaviour: admission errors, abort, metrics, configuration."""

from __future__ import annotations

import pytest

from backend import EngineConfig, LLM, SamplingParams


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    engine.add_request("a", "Tell me a long story about dragons.", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("b", "And another about knights.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    engine.abort_request("b")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished_requests()
    assert engine.abort_request("a") is None  # twice is harmless


def test_request_that_can_never_fit_is_rejected(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate(["word " * 80], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["short"], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    # max_tokens=None fills the context.
    out = llm.generate(["Hello"], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == 64
    assert not llm.llm_engine.has_unfinished_requests()


def test_more_blocks_than_exist_is_rejected(model_path):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=4 * block_bytes)
    with pytest.raises(ValueError, match="KV-cache blocks"):
        llm.generate(["Hello"], SamplingParams(max_tokens=100))


def test_metrics_have_vllm_names(llm):
    llm.generate(["Hello there", "General Kenobi"], SamplingParams(max_tokens=5, ignore_eos=True))
    metrics = {m.name: m for m in llm.get_metrics()}
    for name in ("vllm:num_preemptions", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success", "vllm:time_to_first_token_seconds"):
        assert name in metrics
    assert metrics["vllm:generation_tokens"].value >= 10
    assert metrics["vllm:kv_cache_usage_perc"].value == 0.0
    assert metrics["vllm:num_requests_running"].value == 0
    assert metrics["vllm:time_to_first_token_seconds"].count >= 2


def test_token_id_prompts_and_chat(llm, tokenizer):
    ids = tokenizer("The capital of France is").input_ids
    by_ids = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0]
    by_text = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6))[0]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids and by_ids.prompt is None
    chat = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=8))
    assert chat[0].prompt.endswith("<|im_start|>assistant\n") and chat[0].outputs[0].text
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**9]], SamplingParams(max_tokens=2))


def test_engine_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="unknown engine argument"):
        EngineConfig.from_dict({"blocksize": 16})
    config = EngineConfig.from_dict({"max_num_seqs": "8", "enable_prefix_caching": "false",
                                     "kv_cache_memory_bytes": "1048576"})
    assert (config.max_num_seqs, config.enable_prefix_caching, config.kv_cache_memory_bytes) == (8, False, 1 << 20)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.from_dict({"max_num_seqs": "many"})
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


def test_cli_flags_are_the_config_fields():
    import argparse
    from tools.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--block-size", "32", "--no-enable-prefix-caching", "--max-model-len", "512"])
    config = engine_config_from_args(args)
    assert (config.block_size, config.enable_prefix_caching, config.max_model_len) == (32, False, 512)
