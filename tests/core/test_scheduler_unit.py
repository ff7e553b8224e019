"""The scheduler alone, driven through the step contract (backend/core/step.py) with made-up runner
outputs: no model, no engine. What it plans, what it appends, when it stops a request and what it
gives back."""

from __future__ import annotations

from backend.core.kv_cache import KVCacheManager
from backend.core.request import Request, RequestStatus
from backend.core.scheduler import Scheduler
from backend.core.step import ModelRunnerOutput, SchedulerOutput
from backend.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=16, block_size=4, budget=64, max_num_seqs=8, **kwargs) -> Scheduler:
    kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=kwargs.pop("prefix_caching", True))
    return Scheduler(kv_cache, max_num_seqs, budget, enable_chunked_prefill=True, eos_token_ids={EOS},
                     max_model_len=kwargs.pop("max_model_len", 64), **kwargs)


def request(request_id: str, prompt_len: int = 6, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(request_id, None, list(range(10, 10 + prompt_len)), SamplingParams(**params))


def sample(plan: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """What a runner would return: the given tokens for each request whose step reaches its end."""
    return ModelRunnerOutput(sampled_token_ids={r.request_id: tokens[r.request_id] for r, n in plan.scheduled
                                                if r.num_computed_tokens + n >= r.num_tokens})


def test_a_request_runs_from_prefill_to_max_tokens_and_gives_its_blocks_back():
    scheduler = make_scheduler()
    a = request("a", max_tokens=3)
    scheduler.add(a)
    plan = scheduler.schedule()
    assert plan.scheduled == [(a, 6)] and plan.newly_admitted == [a]
    for step, token in enumerate([5, 6, 7]):
        update = scheduler.update_from_output(plan, sample(plan, {"a": [token]}))
        assert [item.token_ids for item in update.appended] == [[token]]
        assert a.num_computed_tokens == 6 + step
        if step < 2:
            assert not update.finished
            plan = scheduler.schedule()
            assert plan.scheduled == [(a, 1)]
    assert update.finished == [a] and a.finish_reason == "length" and a.is_finished
    assert a.output_token_ids == [5, 6, 7]
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert not scheduler.has_unfinished()


def test_stop_tokens_end_a_request_and_min_tokens_holds_them_back():
    scheduler = make_scheduler()
    eos, held, stop_id = request("eos"), request("held", min_tokens=2), request("stop", stop_token_ids=[9])
    for r in (eos, held, stop_id):
        scheduler.add(r)
    plan = scheduler.schedule()
    update = scheduler.update_from_output(plan, sample(plan, {"eos": [EOS], "held": [EOS], "stop": [9]}))
    assert {r.request_id for r in update.finished} == {"eos", "stop"}
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop_id.finish_reason, stop_id.stop_reason) == ("stop", 9)
    assert held.finish_reason is None and held.status == RequestStatus.RUNNING
    plan = scheduler.schedule()
    assert plan.scheduled == [(held, 1)]
    update = scheduler.update_from_output(plan, sample(plan, {"held": [EOS]}))
    assert update.finished == [held] and held.output_token_ids == [EOS, EOS]


def test_ignore_eos_runs_to_max_tokens_and_the_model_length_stops_everyone():
    scheduler = make_scheduler(max_model_len=8)
    r = request("r", ignore_eos=True, max_tokens=8)
    scheduler.add(r)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, sample(plan, {"r": [EOS]}))
    plan = scheduler.schedule()
    update = scheduler.update_from_output(plan, sample(plan, {"r": [EOS]}))
    assert update.finished == [r] and r.finish_reason == "length" and r.num_tokens == 8


def test_drafts_travel_in_the_plan_and_only_accepted_ones_stay():
    scheduler = make_scheduler(block_size=4)
    r = request("r", prompt_len=4, max_tokens=10)
    scheduler.add(r)
    plan = scheduler.schedule({"r": [1, 1, 1]})  # a prefill verifies nothing
    assert plan.scheduled == [(r, 4)] and plan.spec_token_ids == {}
    scheduler.update_from_output(plan, sample(plan, {"r": [5]}))
    plan = scheduler.schedule({"r": [6, 7, 8]})
    assert plan.scheduled == [(r, 4)] and plan.drafts(r) == [6, 7, 8]
    assert len(r.block_table) == 2  # slots for the drafts: positions 4..7
    # The target agreed with two drafts, then sampled 9 where the third said 8.
    update = scheduler.update_from_output(plan, ModelRunnerOutput(sampled_token_ids={"r": [6, 7, 9]}))
    assert update.appended[0].token_ids == [6, 7, 9]
    assert r.output_token_ids == [5, 6, 7, 9] and r.num_computed_tokens == r.num_tokens - 1
    plan = scheduler.schedule({"r": [1] * 50})  # more drafts than budget allows
    assert plan.scheduled == [(r, 1 + len(plan.drafts(r)))]


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    scheduler = make_scheduler()
    r = request("r", max_tokens=10)
    scheduler.add(r)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, sample(plan, {"r": [5]}))
    plan = scheduler.schedule({"r": [6, EOS, 7]})
    update = scheduler.update_from_output(plan, ModelRunnerOutput(sampled_token_ids={"r": [6, EOS, 7, 8]}))
    assert update.appended[0].token_ids == [6, EOS] and update.finished == [r]
    assert r.output_token_ids == [5, 6, EOS]
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_preemption_takes_the_latest_and_drops_its_drafts():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first, second = request("first", prompt_len=7), request("second", prompt_len=7)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["first", "second"]
    scheduler.update_from_output(plan, sample(plan, {"first": [5], "second": [5]}))
    # Both now need a third block at position 8; only 0 are free: the latest admitted goes.
    scheduler.update_from_output(plan := scheduler.schedule(), sample(plan, {"first": [6], "second": [6]}))
    plan = scheduler.schedule({"first": [1], "second": [1]})
    assert second in plan.preempted and "second" not in plan.spec_token_ids
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert [r for r, _ in plan.scheduled] == [first]


def test_n_samples_wait_for_the_first_to_cache_the_prompt():
    scheduler = make_scheduler()
    samples = [request(f"{i}_p", prompt_len=8) for i in range(3)]
    scheduler.add_samples(samples)
    plan = scheduler.schedule()
    assert [r for r, _ in plan.scheduled] == [samples[0]]
    scheduler.update_from_output(plan, sample(plan, {"0_p": [5]}))
    plan = scheduler.schedule()
    admitted = {r.request_id: n for r, n in plan.scheduled}
    assert admitted["1_p"] == admitted["2_p"] == 4  # two of the prompt's 8 tokens came from the cache
    assert samples[1].num_cached_tokens == 4


def test_a_long_prompt_alone_takes_the_lone_step_and_shares_the_usual_one():
    """A step that computes one long prompt's chunk and nothing else takes up to lone_prefill_tokens:
    from the queue (the short request behind it waits, as it would behind the usual chunks) and
    while it runs alone; once another request decodes beside it, its chunks shrink to the budget."""
    scheduler = make_scheduler(num_blocks=64, budget=8, max_model_len=128, lone_prefill_tokens=32)
    long_one = request("long", prompt_len=70, max_tokens=2)
    short = Request("short", None, list(range(500, 505)), SamplingParams(max_tokens=4))  # no prefix shared
    scheduler.add(long_one)
    scheduler.add(short)
    plan = scheduler.schedule()
    assert plan.scheduled == [(long_one, 32)]  # alone: the lone step, and nobody admitted beside it
    scheduler.update_from_output(plan, sample(plan, {}))
    plan = scheduler.schedule()
    assert plan.scheduled == [(long_one, 32)]  # still alone, still 38 tokens from its prompt's end
    scheduler.update_from_output(plan, sample(plan, {}))
    plan = scheduler.schedule()  # 6 left, under the budget: the usual step, the short one admitted beside it
    assert plan.scheduled == [(long_one, 6), (short, 2)]
    scheduler.update_from_output(plan, sample(plan, {"long": [5]}))
    assert scheduler.schedule().scheduled == [(long_one, 1), (short, 3)]

    scheduler = make_scheduler(num_blocks=64, budget=8, max_model_len=128, lone_prefill_tokens=32)
    first, second = request("first", prompt_len=5, max_tokens=8), request("second", prompt_len=40)
    scheduler.add(first)
    scheduler.update_from_output(plan := scheduler.schedule(), sample(plan, {"first": [5]}))
    scheduler.add(second)
    plan = scheduler.schedule()  # `first` decodes: the long prompt gets the budget's rest
    assert plan.scheduled == [(first, 1), (second, 7)]
    # Without lone_prefill_tokens (a budget the user set): every step is the budget.
    scheduler = make_scheduler(num_blocks=64, budget=8, max_model_len=128)
    scheduler.add(request("long", prompt_len=70))
    assert scheduler.schedule().scheduled[0][1] == 8
