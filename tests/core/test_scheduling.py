"""Prefix caching, chunked prefill, swap and recompute preemption, priorities: none of them may
change a single greedy token (float32), and every block comes back."""

from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from tests.utils.models import BLOCK_BYTES_FP32

SYSTEM = ("You are a meticulous assistant for a logistics company. Always answer with the shipment id, "
          "the current location, the expected delivery date and a short, polite explanation. ") * 5
QUESTIONS = ["Where is shipment 4411?", "Why is order 17 late?", "Can I change my address?",
             "What does status HOLD mean?", "How do I return a parcel?", "Is Sunday delivery possible?",
             "My parcel is damaged, what now?", "Which carrier handles Norway?"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def workload():
    return [SYSTEM + "\n" + q for q in QUESTIONS]


def make(model_path, **kwargs):
    kwargs.setdefault("kv_cache_memory_bytes", 256 << 20)
    return LLM(model_path, dtype="float32", **kwargs)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_free(llm):
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert len(engine.kv_cache.free_swap_blocks) == engine.kv_cache.num_swap_blocks
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(model_path):
    plain = make(model_path, enable_prefix_caching=False, enable_chunked_prefill=False)
    return token_ids(plain.generate(workload(), GREEDY))


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=True),
    dict(enable_prefix_caching=True, max_num_batched_tokens=64),
    dict(enable_prefix_caching=False, max_num_batched_tokens=48),
    dict(kv_cache_memory_bytes=36 * BLOCK_BYTES_FP32, preemption_mode="recompute"),
    dict(kv_cache_memory_bytes=36 * BLOCK_BYTES_FP32, preemption_mode="swap", swap_space=0.1),
    dict(kv_cache_memory_bytes=36 * BLOCK_BYTES_FP32, preemption_mode="swap", swap_space=0.1,
         enable_prefix_caching=False, max_num_batched_tokens=64),
], ids=["cache", "cache+chunk64", "chunk48", "recompute", "swap", "swap+chunk64"])
def test_outputs_identical_under_every_scheduling_option(model_path, reference, options):
    llm = make(model_path, **options)
    budget = llm.llm_engine.scheduler.max_num_batched_tokens
    steps = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording_schedule(drafts=None):
        plan = schedule(drafts)
        steps.append(plan)
        return plan

    llm.llm_engine.scheduler.schedule = recording_schedule
    assert token_ids(llm.generate(workload(), GREEDY)) == reference
    assert max(plan.num_batched_tokens for plan in steps) <= budget
    if "preemption_mode" in options:
        assert any(plan.preempted for plan in steps), "the KV budget was meant to force preemption"
        if options["preemption_mode"] == "swap":
            assert any(plan.swap_out for plan in steps) and any(plan.swap_in for plan in steps)
    assert_all_free(llm)


def test_second_pass_hits_the_prefix_cache(model_path, reference):
    llm = make(model_path)
    llm.generate(workload(), GREEDY)
    before = {m.name: m.value for m in llm.get_metrics()}
    assert token_ids(llm.generate(workload(), GREEDY)) == reference
    after = {m.name: m.value for m in llm.get_metrics()}
    queries = after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"]
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    assert hits / queries > 0.8
    assert_all_free(llm)


def test_cache_salt_keeps_tenants_apart(llm):
    engine = llm.llm_engine
    prompt = SYSTEM + "\nHello"
    for request_id, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        while engine.has_unfinished_requests():
            for output in engine.step():
                cached = output.num_cached_tokens
        if request_id == "b":
            assert cached == 0, "a different salt must never share blocks"
        if request_id == "c":
            assert cached > 0, "the same salt shares blocks"


def test_long_prompt_delays_decodes_by_at_most_one_chunk(model_path):
    llm = make(model_path, max_num_batched_tokens=64)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"d{i}", QUESTIONS[i], SamplingParams(max_tokens=60, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.add_request("long", SYSTEM * 2, SamplingParams(max_tokens=2))
    decoding = list(engine.scheduler.running)
    for _ in range(12):  # the long prompt needs ~11 chunks of 60
        before = {r.request_id: r.num_output_tokens for r in decoding}
        plan = engine.scheduler.schedule()
        scheduled = dict((r.request_id, n) for r, n in plan.scheduled)
        assert all(scheduled.get(rid) == 1 for rid in before), "a decode was stalled by the prompt"
        assert plan.num_batched_tokens <= 64
        # finish the step the normal way
        engine.scheduler.schedule = lambda drafts=None, plan=plan: plan
        engine.step()
        del engine.scheduler.schedule
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(llm)


def test_prompts_arriving_together_on_a_cpu_get_first_tokens_step_by_step(model_path):
    """The CPU default step budget of an engine that serves (512 tokens): eight ~180-token prompts
    added at once (1,400 tokens of prefill) take more than one step, so the first ones stream their
    first token while the rest are computed, instead of all eight waiting for one step; the tokens
    are the same as in one step. A long prompt alone takes one step of up to 2,048 tokens, and the
    offline LLM takes 2,048 a step (its caller waits for the batch)."""
    from backend.config import EngineConfig
    from backend.engine.engine import LLMEngine

    llm = make(model_path)
    assert llm.llm_engine.limits.max_num_batched_tokens == 2048
    whole = llm.generate(workload(), GREEDY)
    llm.llm_engine = engine = LLMEngine(EngineConfig(model=str(model_path), dtype="float32",
                                                     kv_cache_memory_bytes=256 << 20))
    assert engine.limits.max_num_batched_tokens == 512
    for i, prompt in enumerate(workload()):
        engine.add_request(str(i), prompt, GREEDY)
    first_token_step, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            if output.outputs[0].token_ids:
                first_token_step.setdefault(output.request_id, step)
    assert first_token_step["0"] == 1 and first_token_step[str(len(QUESTIONS) - 1)] > 1
    assert_all_free(llm)
    assert [o.outputs[0].token_ids for o in whole] == token_ids(llm.generate(workload(), GREEDY))
    # A prompt longer than the budget arriving alone is computed in one step of up to 2,048.
    long_prompt = " ".join(QUESTIONS) * 14  # nothing of it in the prefix cache
    assert len(engine.tokenizer(long_prompt).input_ids) > 700
    engine.add_request("long", long_prompt, GREEDY)
    [output] = engine.step()
    assert output.outputs[0].token_ids, "the whole prompt in the first step"
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(llm)


def test_priority_policy_runs_urgent_requests_first(model_path):
    llm = make(model_path, scheduling_policy="priority", max_num_seqs=1)
    engine = llm.llm_engine
    engine.add_request("low", "Count: one, two,", SamplingParams(max_tokens=3), priority=5)
    engine.add_request("high", "Count: one, two,", SamplingParams(max_tokens=3), priority=-1)
    engine.add_request("mid", "Count: one, two,", SamplingParams(max_tokens=3), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_big_request_does_not_block_small_ones_forever(model_path):
    llm = make(model_path, kv_cache_memory_bytes=24 * BLOCK_BYTES_FP32)
    engine = llm.llm_engine
    engine.add_request("hog", "word " * 200, SamplingParams(max_tokens=150, ignore_eos=True))
    engine.add_request("big", "word " * 250, SamplingParams(max_tokens=60, ignore_eos=True))
    engine.add_request("small", "Hi", SamplingParams(max_tokens=4, ignore_eos=True))
    finished = []
    for _ in range(8):
        finished += [o.request_id for o in engine.step() if o.finished]
    assert "small" in finished, "the small request was stuck behind one that does not fit"
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(llm)
