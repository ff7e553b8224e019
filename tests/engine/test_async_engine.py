"""The engine on its own thread: concurrent streams, aborts, shutdown, failure and admission."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from backend import AsyncLLMEngine, EngineConfig, RequestOutputKind, SamplingParams
from backend.engine.async_engine import EngineDeadError, EngineOverloadedError
from backend.errors import EngineError
from backend.outputs import coalesce

PROMPTS = ["The capital of France is", "def fibonacci(n):", "北京是中国的首都，它有很多名胜古迹，比如",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


@pytest.fixture(scope="module")
def engine(model_path):
    engine = AsyncLLMEngine(EngineConfig(model=model_path, dtype="float32", kv_cache_memory_bytes=128 << 20))
    yield engine
    engine.shutdown()


def wait_idle(engine, timeout=10.0):
    deadline = time.time() + timeout
    while engine.num_unfinished_requests() and time.time() < deadline:
        time.sleep(0.01)
    kv = engine.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_concurrent_streams_match_offline(engine, llm):
    params = SamplingParams(temperature=0, max_tokens=24, output_kind=RequestOutputKind.DELTA)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]

    async def stream(i, prompt):
        text, finished = "", 0
        async for output in engine.generate(prompt, params, f"req-{i}"):
            text += output.outputs[0].text
            finished += output.finished
        assert finished == 1
        return text

    async def main():
        return await asyncio.gather(*(stream(i, p) for i, p in enumerate(PROMPTS * 4)))

    texts = asyncio.run(main())
    assert texts == expected * 4
    wait_idle(engine)


def collect(engine, request_id, prompt, params) -> list:
    outputs, done = [], threading.Event()

    def on_output(output):
        outputs.append(output)
        if output.finished:
            done.set()

    engine.add_request(request_id, prompt, params, on_output)
    assert done.wait(60)
    return outputs


def test_coalesced_stream_outputs_equal_the_final_output(engine):
    """What a sender that fell behind sends (a DELTA stream's outputs folded together, two streams
    interleaved, an error between them kept) is what the request's final output says: every
    sample's text, tokens, logprobs, cumulative logprob, finish and stop reason, the prompt's logprobs."""
    def params(kind):
        return SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=12, logprobs=2, prompt_logprobs=1,
                              stop=[" the"], output_kind=kind)
    [final] = collect(engine, "final", PROMPTS[3], params(RequestOutputKind.FINAL_ONLY))
    first = collect(engine, "a", PROMPTS[3], params(RequestOutputKind.DELTA))
    second = collect(engine, "b", PROMPTS[3], params(RequestOutputKind.DELTA))
    assert len(first) > 3 and len(second) > 3
    error = object()
    items = [("b", second[0]), ("a", first[0]), ("b", second[1]), ("b", error),
             *(("a", output) for output in first[1:]), *(("b", output) for output in second[2:])]
    owners = {"a": ["a"], "b": ["b"]}  # coalesce tells owners apart by identity
    merged, folded = coalesce([(owners[name], item) for name, item in items])
    assert [(owner[0], item is error) for owner, item in merged] == [("b", False), ("a", False), ("b", True),
                                                                     ("b", False)]
    assert folded == len(items) - 4
    expected = sorted(final.outputs, key=lambda c: c.index)
    for output in (merged[1][1], merged[3][1]):
        assert output.finished
        if output is merged[3][1]:  # the second stream restarted after the error: its tail only
            continue
        assert output.prompt_logprobs == final.prompt_logprobs
        got = sorted(output.outputs, key=lambda c: c.index)
        assert [(c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
                for c in got] == [(c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason,
                                   c.stop_reason) for c in expected]
    wait_idle(engine)


def test_abort_mid_stream_frees_blocks_and_sends_final(engine):
    outputs, done = [], threading.Event()

    def on_output(output):
        outputs.append(output)
        if output.finished:
            done.set()

    engine.add_request("long", "Tell me a very long story.", SamplingParams(max_tokens=500, ignore_eos=True,
                       output_kind=RequestOutputKind.DELTA), on_output)
    while len(outputs) < 3:
        time.sleep(0.01)
    engine.abort("long")
    assert done.wait(5)
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert sum(o.finished for o in outputs) == 1
    wait_idle(engine)


def test_leaving_a_generate_loop_aborts(engine):
    async def main():
        async for _ in engine.generate("Count to one hundred:", SamplingParams(max_tokens=300, ignore_eos=True,
                                       output_kind=RequestOutputKind.DELTA), "early"):
            break
    asyncio.run(main())
    wait_idle(engine)


def test_validation_errors_raise_in_the_caller(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("too-long", "hi", SamplingParams(max_tokens=10**6), lambda o: None)
    assert engine.num_unfinished_requests() == 0


def test_engine_failure_fails_requests_and_marks_errored(model_path):
    engine = AsyncLLMEngine(EngineConfig(model=model_path, dtype="float32", kv_cache_memory_bytes=32 << 20))
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("simulated device fault")
        engine.engine.runner.execute = broken
        finals = []
        done = threading.Event()
        engine.add_request("x", "hello", SamplingParams(max_tokens=4), lambda o: (finals.append(o), done.set()))
        assert done.wait(10)
        assert finals[0].finished and "simulated device fault" in finals[0].error
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.add_request("y", "hello", SamplingParams(max_tokens=4), lambda o: None)
    finally:
        engine.shutdown()


def test_model_is_loaded_on_the_engine_thread(engine):
    """The thread that steps is the one that loaded the model: one OpenMP team in the process.
    A second team (the model loaded by the caller's thread) makes libgomp stop spinning at its
    barriers; decode steps measured 20% slower that way (docs/benchmarks.md)."""
    assert engine.engine.built_on is engine._thread


def test_a_model_that_fails_to_load_raises_in_the_caller(tmp_path):
    with pytest.raises(ValueError, match="is not a Hugging Face model folder"):
        AsyncLLMEngine(EngineConfig(model=str(tmp_path), dtype="float32"))


# -- admission: max_num_seqs run, max_waiting_requests more samples wait ----------------------------
@pytest.fixture(scope="module")
def tight_engine(model_path):
    engine = AsyncLLMEngine(EngineConfig(model=model_path, dtype="float32", kv_cache_memory_bytes=64 << 20,
                                         max_num_seqs=4, max_waiting_requests=4))
    yield engine
    engine.shutdown()


def test_a_burst_into_an_idle_engine_fills_the_run_slots_before_the_queue(tight_engine):
    accepted, refused = [], []
    for i in range(32):
        try:
            tight_engine.add_request(f"burst{i}", "Hello there", SamplingParams(max_tokens=200, ignore_eos=True),
                                     lambda output: None)
            accepted.append(f"burst{i}")
        except EngineOverloadedError as error:
            refused.append(error)
    assert accepted == [f"burst{i}" for i in range(8)], "4 run slots and 4 queue places"
    assert len(refused) == 24 and refused[0].code == "engine_overloaded"
    assert "max_waiting_requests=4" in str(refused[0]) and "retry later" in str(refused[0])
    for request_id in accepted:
        tight_engine.abort(request_id)
    wait_idle(tight_engine)


def test_n_counts_its_samples_and_an_n_that_can_never_fit_is_invalid(tight_engine):
    with pytest.raises(EngineError, match="n: at most 8 samples can run or wait at once") as error:
        tight_engine.add_request("n9", "Hello there", SamplingParams(n=9, max_tokens=4), lambda output: None)
    assert (error.value.code, error.value.param) == ("invalid_parameter", "n")
    finals, done = [], threading.Event()

    def on_output(output):
        if output.finished:
            finals.append(output)
            done.set()

    tight_engine.add_request("n8", "Hello there", SamplingParams(n=8, max_tokens=30, ignore_eos=True), on_output)
    with pytest.raises(EngineOverloadedError):  # 4 samples run, 4 wait: full
        tight_engine.add_request("one-more", "Hello there", SamplingParams(max_tokens=4), lambda output: None)
    assert done.wait(60)
    assert [len(c.token_ids) for c in finals[0].outputs] == [30] * 8
    wait_idle(tight_engine)
