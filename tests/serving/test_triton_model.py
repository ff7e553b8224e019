"""The `llm` Triton model end to end: a real tritonserver (started like `tritonllm serve` starts it),
the real engine on SmolLM2, and Triton's own clients (tritonclient gRPC streaming, HTTP generate).
Texts are checked against the offline engine's greedy output on the same weights."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend import SamplingParams
from tests.utils import wait_for
from tests.utils.triton import (TIMEOUT_S, Stream, generate, is_final, make_inputs, start_triton,
                                stub_processes, texts, thread_count)
from tools.triton_server import TritonServer, write_model_repository

MAX_MODEL_LEN = 512
PROMPT = "Hello, my name is"


# For the health test: a copy of the model whose engine fails at every step after the 20th. The
# probe step after the first failure fails too, so the engine is dead, not just one request.
# (A single failing step is test_reliability.py's.)
FAULTY_MODEL = "llm_faulty"
ENGINE_CREATED = "        self.engine = AsyncLLMEngine(engine_config)\n"
INJECTED_FAILURE = """
        original_step, steps = self.engine.engine.step, iter(range(20))

        def failing_step():
            if next(steps, None) is None:
                raise RuntimeError("injected engine failure")
            return original_step()
        self.engine.engine.step = failing_step
"""


def add_faulty_model(repository: Path) -> None:
    shutil.copytree(repository / "llm", repository / FAULTY_MODEL)
    config = repository / FAULTY_MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "llm"', f'name: "{FAULTY_MODEL}"'))
    model = repository / FAULTY_MODEL / "1" / "model.py"
    source = model.read_text()
    assert ENGINE_CREATED in source
    model.write_text(source.replace(ENGINE_CREATED, ENGINE_CREATED + INJECTED_FAILURE))


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    work = tmp_path_factory.mktemp("triton_model")
    repository = write_model_repository(work / "repository", {
        "model": model_path, "dtype": "float32", "kv_cache_memory_bytes": 256 << 20,
        "max_model_len": MAX_MODEL_LEN})
    add_faulty_model(repository)
    server = start_triton(work, exit_timeout_s=5)
    try:
        yield server
    finally:
        assert server.stop() == 0, "tritonserver did not exit cleanly"


@pytest.fixture(scope="module")
def greedy(llm):
    """The offline engine's greedy completion of a prompt (same weights, float32)."""
    def complete(prompt: str, max_tokens: int):
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    return complete


# -- helpers ---------------------------------------------------------------------------------------
def metrics(server: TritonServer) -> dict[str, float]:
    """The model's vllm:* series from the metrics port, keyed by name (and `le` for buckets), summed
    over their other labels."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    values = {}
    for line in lines:
        if line.startswith("vllm:") and 'model="llm"' in line:
            name, labels = line.split("{", 1)
            le = [p for p in labels.split("}")[0].split(",") if p.startswith("le=")]
            key = name + (f"{{{le[0]}}}" if le else "")  # other labels (finished_reason) summed
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def settled_metrics(server: TritonServer) -> dict[str, float]:
    """Metrics once the model's exporter (it polls the engine every 0.5 s) has caught up."""
    previous = metrics(server)
    while True:
        time.sleep(0.6)
        current = metrics(server)
        if current == previous:
            return current
        previous = current


def post_json(url: str, body: dict) -> str:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return response.read().decode()


# -- tests -----------------------------------------------------------------------------------------
def test_grpc_stream_concatenates_to_offline_greedy_text(server, greedy):
    expected = greedy(PROMPT, 24)
    completion = expected.outputs[0]
    stream = Stream(server.grpc_url)
    try:
        stream.send(make_inputs(PROMPT, {"temperature": 0, "max_tokens": "24"}, stream=True,
                                return_num_output_tokens=True, return_finish_reason=True,
                                return_num_input_tokens=True), request_id="s")
        responses = stream.collect("s")
        time.sleep(0.5)
        assert stream.events.empty(), "a response arrived after the final one"
    finally:
        stream.close()
    assert len(responses) > 5, "not streamed"
    assert [is_final(r) for r in responses].count(True) == 1
    assert "".join(texts(r)[0] for r in responses) == completion.text
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == len(completion.token_ids)
    assert all(int(r.as_numpy("num_output_tokens")[0]) == 1 for r in responses)
    assert responses[-1].as_numpy("finish_reason")[0].decode() == completion.finish_reason == "length"
    assert responses[0].as_numpy("finish_reason")[0].decode() == "None"
    assert int(responses[0].as_numpy("num_input_tokens")[0]) == len(expected.prompt_token_ids)

    # A stream interval of 8: the first token alone, then 8 at a time, the rest with the final response.
    sparse = generate(server, PROMPT, {"temperature": 0, "max_tokens": 24, "stream_interval": 8}, stream=True,
                      exclude_input_in_output=True, return_num_output_tokens=True)
    sparse = [r for r in sparse if texts(r)]  # the empty final response carries nothing
    assert [int(r.as_numpy("num_output_tokens")[0]) for r in sparse] == [1, 8, 8, 7]
    assert "".join(texts(r)[0] for r in sparse) == completion.text

    # Not streaming: one final response; the prompt is echoed unless excluded.
    [echoed] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 24})
    assert texts(echoed) == [PROMPT + completion.text]
    [bare] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 24}, exclude_input_in_output=True,
                      return_num_output_tokens=True)
    assert texts(bare) == [completion.text]
    assert int(bare.as_numpy("num_output_tokens")[0]) == len(completion.token_ids)


def test_token_ids_samples_and_logprobs(server, greedy, tokenizer):
    expected = greedy(PROMPT, 12).outputs[0]
    prompt_ids = tokenizer(PROMPT).input_ids
    [by_ids] = generate(server, prompt_ids, {"temperature": 0, "max_tokens": 12}, exclude_input_in_output=True)
    assert texts(by_ids) == [expected.text]

    [samples] = generate(server, PROMPT, {"n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 8},
                         exclude_input_in_output=True, return_num_output_tokens=True, return_finish_reason=True)
    assert len(texts(samples)) == 2
    assert samples.as_numpy("num_output_tokens").tolist() == [8, 8]
    assert [r.decode() for r in samples.as_numpy("finish_reason")] == ["length", "length"]

    # Greedy picks the rank-1 token, so the cumulative logprob is the sum of each position's best.
    [scored] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 6, "logprobs": 2},
                        return_logprobs=True, return_cumulative_logprob=True)
    positions = json.loads(scored.as_numpy("logprobs")[0])
    assert len(positions) == 6 and all(2 <= len(p) <= 3 for p in positions)
    best = sum(max(v["logprob"] for v in p.values()) for p in positions)
    assert scored.as_numpy("cumulative_logprob")[0] == pytest.approx(best, abs=1e-4)

    # Without sampling logprobs the cumulative logprob is still reported; the logprobs stay null.
    [plain] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 6}, return_cumulative_logprob=True,
                       return_logprobs=True)
    assert plain.as_numpy("cumulative_logprob")[0] == pytest.approx(best, abs=1e-4)
    assert plain.as_numpy("logprobs")[0] == b"null"


def test_http_generate_and_generate_stream(server, greedy):
    expected = greedy(PROMPT, 16).outputs[0].text
    base = f"http://{server.http_url}/v2/models/llm"
    body = {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 16}}
    assert json.loads(post_json(f"{base}/generate", body))["text_output"] == PROMPT + expected
    excluded = {**body, "exclude_input_in_output": True}
    assert json.loads(post_json(f"{base}/generate", excluded))["text_output"] == expected
    as_tensor = {"text_input": PROMPT, "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 16}),
                 "exclude_input_in_output": True}
    assert json.loads(post_json(f"{base}/generate", as_tensor))["text_output"] == expected

    sse = post_json(f"{base}/generate_stream", {**body, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in sse.splitlines() if line.startswith("data: ")]
    assert len(events) > 5
    assert "".join(e["text_output"] for e in events) == expected


def test_32_concurrent_streams_complete(server):
    streams = [Stream(server.grpc_url) for _ in range(32)]
    try:
        for i, stream in enumerate(streams):
            stream.send(make_inputs(f"Story number {i}:", {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
                                    stream=True, return_num_output_tokens=True), request_id=str(i))
        for i, stream in enumerate(streams):
            responses = stream.collect(str(i))
            assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == 8
            assert "".join(texts(r)[0] for r in responses).strip()
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0, message="no running requests")


def test_cancelled_stream_frees_its_blocks(server):
    before = settled_metrics(server)["vllm:generation_tokens_total"]
    stream = Stream(server.grpc_url)
    stream.send(make_inputs(PROMPT, {"temperature": 0, "max_tokens": 400, "ignore_eos": True}, stream=True))
    for _ in range(3):
        result, error = stream.next()
        assert error is None and not is_final(result)
    wait_for(lambda: metrics(server)["vllm:kv_cache_usage_perc"] > 0, message="KV blocks in use")
    stream.close(cancel=True)
    wait_for(lambda: metrics(server)["vllm:kv_cache_usage_perc"] == 0, timeout=15, message="KV blocks freed")
    after = metrics(server)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] - before < 400, "the cancelled request kept generating"
    [result] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 4})
    assert texts(result)[0].startswith(PROMPT)


@pytest.mark.parametrize("prompt, params, flags, message", [
    (PROMPT, '{"temperature": 0,', {}, "sampling_parameters: not valid JSON"),
    (PROMPT, '["temperature"]', {}, "sampling_parameters: must be a JSON object"),
    (PROMPT, {"temprature": 0.5}, {}, "unknown sampling parameter(s): temprature"),
    (PROMPT, {"temperature": -1}, {}, "temperature: must be non-negative"),
    (PROMPT, {"max_tokens": 0}, {}, "max_tokens: must be at least 1"),
    (PROMPT, {"max_tokens": "many"}, {}, "max_tokens: cannot read 'many'"),
    ("hello " * MAX_MODEL_LEN, {"max_tokens": 16}, {}, f"maximum context length is {MAX_MODEL_LEN} tokens"),
    (None, {"max_tokens": 4}, {}, "text_input: required"),
    (PROMPT, {}, {"stream": True, "exclude_input_in_output": False}, "exclude_input_in_output"),
])
def test_invalid_request_is_a_triton_error_naming_the_problem(server, prompt, params, flags, message):
    with pytest.raises(InferenceServerException) as error:
        generate(server, prompt, params, **flags)
    assert message in error.value.message()
    [result] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 2})  # still serving
    assert texts(result)[0].startswith(PROMPT)


def test_metrics_carry_vllm_names(server):
    before = settled_metrics(server)
    generate(server, PROMPT, {"temperature": 0, "max_tokens": 5, "ignore_eos": True})
    wait_for(lambda: metrics(server)["vllm:request_success_total"] == before["vllm:request_success_total"] + 1,
             message="request_success_total to count the request")
    after = metrics(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    for name in ("vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in after
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:e2e_request_latency_seconds"):
        count = after[f"{histogram}_count"]
        assert after[f'{histogram}_bucket{{le="+Inf"}}'] == count > 0
        assert after[f"{histogram}_sum"] > 0
    assert after["vllm:e2e_request_latency_seconds_count"] == after["vllm:request_success_total"]


def test_bench_runs_on_one_server_start_with_a_cold_prefix_cache(server, tokenizer, monkeypatch):
    # `tritonllm bench` sends the same prompts in every served run on one server (each mode and
    # concurrency): each run's own cache_salt keeps the next from finding them cached.
    from tools.bench import runners
    from tools.bench.workloads import make_workload

    workload = make_workload("fixed", tokenizer, 4, 0, 48, 2)
    urls = {"grpc": server.grpc_url, "metrics": server.metrics_url}
    args = argparse.Namespace(concurrency=[4, 4], client="builtin", request_rate=float("inf"), seed=0, goodput=None)
    results = runners.run_server_mode("triton", urls, args, workload)
    assert [(r["requests"], r["failed"], r["prefix_cache_hit_rate"]) for r in results] == [(4, 0, 0.0), (4, 0, 0.0)]
    # The same salt twice: the second run finds the first's full blocks, and the bench reports it.
    monkeypatch.setattr(runners.uuid, "uuid4", lambda: uuid.UUID(int=0))
    first, second = runners.run_server_mode("triton", urls, args, workload)
    assert first["prefix_cache_hit_rate"] == 0.0 and second["prefix_cache_hit_rate"] > 0.5


def test_engine_failure_fails_requests_and_unloads_the_model(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.load_model(FAULTY_MODEL)
    stream = Stream(server.grpc_url)
    try:
        stream.send(make_inputs(PROMPT, {"max_tokens": 100, "ignore_eos": True}, stream=True), model=FAULTY_MODEL)
        received = 0
        while True:
            result, error = stream.next()
            if error is not None:
                break
            assert not is_final(result), "finished although its engine failed"
            received += 1
        assert "injected engine failure" in error.message() and received < 100
    finally:
        stream.close()
    wait_for(lambda: not client.is_model_ready(FAULTY_MODEL), timeout=60, message="the failed model to unload")
    wait_for(lambda: len(stub_processes(server)) == 1, timeout=60, message="the failed model's stub to exit")
    stream = Stream(server.grpc_url)
    try:
        stream.send(make_inputs(PROMPT, {"max_tokens": 2}), model=FAULTY_MODEL)
        result, error = stream.next()
    finally:
        stream.close()
    assert result is None and FAULTY_MODEL in error.message(), error.message()
    [result] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 2})  # the healthy model serves
    assert texts(result)[0].startswith(PROMPT)
    client.close()


def test_unload_drains_and_reload_leaves_nothing_behind(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    [old_stub] = stub_processes(server)
    threads_loaded = thread_count(server.process.pid)

    # A request in flight when the unload arrives still completes, with exactly one final response.
    stream = Stream(server.grpc_url)
    stream.send(make_inputs(PROMPT, {"temperature": 0, "max_tokens": 40, "ignore_eos": True}, stream=True,
                            return_num_output_tokens=True))
    result, error = stream.next()
    assert error is None
    client.unload_model("llm")
    responses = [result] + ([] if is_final(result) else stream.collect())
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == 40
    stream.close()  # Triton releases the model once no gRPC stream holds its last request

    wait_for(lambda: not stub_processes(server), timeout=60, message="the model's stub process to exit")
    assert not client.is_model_ready("llm")
    assert not os.path.exists(f"/proc/{old_stub}") or open(f"/proc/{old_stub}/stat", encoding="utf-8").read().split()[2] == "Z"
    threads_unloaded = thread_count(server.process.pid)
    assert threads_unloaded < threads_loaded

    client.load_model("llm")
    assert client.is_model_ready("llm")
    assert len(stub_processes(server)) == 1
    assert thread_count(server.process.pid) <= threads_loaded + 2
    [result] = generate(server, PROMPT, {"temperature": 0, "max_tokens": 3})
    assert texts(result)[0].startswith(PROMPT)
    client.close()
