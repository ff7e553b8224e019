"""The second KV tier end to end (`kv_offloading_size`) on the prepared SmolLM2 in float32: with a KV
cache too small for the prompts' working set, revisited prefixes come back from the tier instead of
being recomputed, and not one greedy token changes against an engine without prefix caching; with
swap preemption beside it (the two share the host store and the block mover) too. The hits are
counted in vLLM's external prefix-cache counters, and every block comes back."""

from __future__ import annotations

import argparse

import pytest

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.errors import EngineError
from tests.utils.models import BLOCK_BYTES_FP32
from tools.cli import add_engine_arguments, engine_config_from_args

TOPICS = ["shipping containers", "the history of tea", "volcanoes in Iceland", "compilers and parsers"]
# Four documents of 12 to 15 blocks each: the KV caches below hold one or two of them.
DOCUMENTS = [(f"Document {i}: a long and careful report about {topic}. " * 14) for i, topic in enumerate(TOPICS)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TIER_GIB = 0.05  # about 70 float32 blocks: every document fits


def rounds() -> list[str]:
    """Each document with a first question, then each again with a second one."""
    return ([doc + "\nQuestion: what is it about?" for doc in DOCUMENTS]
            + [doc + "\nQuestion: who would read it?" for doc in DOCUMENTS])


def counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if m.kind == "counter" and not m.labels}


def one_by_one(llm, prompts) -> list[list[int]]:
    return [llm.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in prompts]


def assert_all_free(llm):
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert len(kv.free_swap_blocks) == kv.num_swap_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(model_path):
    plain = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    return one_by_one(plain, rounds())


def test_option_from_keyword_flag_and_model_json():
    assert EngineConfig(kv_offloading_size=2.5).kv_offloading_size == 2.5
    assert EngineConfig.from_dict({"kv_offloading_size": "4"}).kv_offloading_size == 4.0
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-offloading-size", "8"])).kv_offloading_size == 8.0
    assert engine_config_from_args(parser.parse_args([])).kv_offloading_size is None
    with pytest.raises(EngineError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_size=-1)


def test_revisited_prefixes_come_back_from_the_tier_token_for_token(model_path, reference):
    small = dict(dtype="float32", kv_cache_memory_bytes=24 * BLOCK_BYTES_FP32)
    tiered = LLM(model_path, kv_offloading_size=TIER_GIB, **small)
    assert tiered.llm_engine.kv_cache.tier.num_slots == int(TIER_GIB * (1 << 30)) // BLOCK_BYTES_FP32
    assert one_by_one(tiered, rounds()) == reference
    with_tier = counters(tiered)
    assert with_tier["vllm:external_prefix_cache_hits"] >= 2 * 9 * 16, "the first two documents come from the tier"
    assert with_tier["vllm:external_prefix_cache_queries"] == (with_tier["vllm:prefix_cache_queries"]
                                                               - with_tier["vllm:prefix_cache_hits"])
    assert_all_free(tiered)

    untiered = LLM(model_path, **small)
    assert one_by_one(untiered, rounds()) == reference
    without = counters(untiered)
    assert without["vllm:external_prefix_cache_hits"] == without["vllm:external_prefix_cache_queries"] == 0
    # the same device hits; the tier's on top
    assert with_tier["vllm:prefix_cache_hits"] == without["vllm:prefix_cache_hits"]
    assert with_tier["vllm:prompt_tokens"] == without["vllm:prompt_tokens"]


def test_tier_and_swap_preemption_share_the_host_store(model_path, reference):
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=26 * BLOCK_BYTES_FP32, preemption_mode="swap",
              swap_space=0.02, kv_offloading_size=TIER_GIB)
    kv = llm.llm_engine.kv_cache
    assert kv.num_swap_blocks > 0 and kv.tier.free_slots[-1] == kv.num_swap_blocks  # tier slots after swap's
    steps = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording_schedule(drafts=None):
        plan = schedule(drafts)
        steps.append(plan)
        return plan

    llm.llm_engine.scheduler.schedule = recording_schedule
    prompts = rounds()
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], GREEDY)]  # at once: preemptions
    outputs += [o.outputs[0].token_ids for o in llm.generate(prompts[4:], GREEDY)]
    assert outputs == reference
    assert any(plan.swap_out for plan in steps) and any(plan.load for plan in steps)
    assert counters(llm)["vllm:external_prefix_cache_hits"] > 0
    assert_all_free(llm)
