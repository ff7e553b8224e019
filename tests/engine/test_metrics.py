"""The engine's vLLM metrics on Triton's metrics port equal what a scripted set of requests did.

A fresh tritonserver gets four requests through tritonclient, one after the other: prompts of
different lengths (text and token ids), different max_tokens, n = 3, a stop string, and a stream
cancelled after three responses. Every vllm:* series is then checked against them: counters and
token histograms exactly (sum and every bucket), latency histograms by their counts and by how
their phases add up (prefill + decode = inference, queue + inference <= e2e).
"""

from __future__ import annotations

import math
import re
import time
import urllib.request

import pytest
from transformers import AutoTokenizer

from backend.engine.metrics import (ITERATION_TOKENS_BUCKETS, N_BUCKETS, REQUEST_LATENCY_BUCKETS, MetricsRegistry,
                             buckets_1_2_5)
from tests.utils.triton import Stream, generate, is_final, llm_server, make_inputs
from tools.triton_server import TritonServer

MAX_MODEL_LEN = 512
SERIES = re.compile(r'^((?:vllm|tritonllm):[^{ ]+)\{([^}]*)\} (\S+)$')
LATENCIES = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
             "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
             "vllm:request_inference_time_seconds")


def test_registry_histograms_count_cumulatively_as_prometheus_does():
    registry = MetricsRegistry()
    histogram = registry.histogram("vllm:x_seconds", "x", (0.1, 1.0))
    for value in (0.05, 0.3, 1.0):
        registry.observe(histogram, value)
    registry.observe(histogram, 7.0, times=2)
    [reading] = registry.snapshot()
    assert (reading.count, reading.sum, reading.bucket_counts) == (5, 0.05 + 0.3 + 1.0 + 14.0, [1, 3, 5])
    registry.observe(histogram, 0.2)
    assert reading.bucket_counts == [1, 3, 5]  # a snapshot is a copy
    assert registry.snapshot()[0].bucket_counts == [1, 4, 6]


def test_buckets_1_2_5_stop_at_the_limit():
    assert buckets_1_2_5(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert buckets_1_2_5(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    engine_args = {"model": model_path, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                   "max_model_len": MAX_MODEL_LEN}
    with llm_server(tmp_path_factory.mktemp("metrics"), engine_args, exit_timeout_s=60) as server:
        yield server


def scrape(server: TritonServer) -> dict[tuple, float]:
    """The llm model's vllm:* series: (name, other labels) -> value; `le` is kept among the labels."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    series = {}
    for line in lines:
        match = SERIES.match(line)
        if match and 'model="llm"' in match[2]:
            labels = tuple(sorted(p for p in match[2].split(",") if not p.startswith(("model=", "version="))))
            series[(match[1], labels)] = float(match[3])
    return series


def value(series: dict, name: str, *labels: str) -> float:
    return series[(name, tuple(sorted(labels)))]


def histogram(series: dict, name: str) -> tuple[float, float, dict[float, float]]:
    """count, sum and the cumulative bucket counts by their bound (+Inf: math.inf)."""
    buckets = {float(labels[0][4:-1].replace("+Inf", "inf")): v
               for (n, labels), v in series.items() if n == f"{name}_bucket"}
    return value(series, f"{name}_count"), value(series, f"{name}_sum"), buckets


def check_exact(series: dict, name: str, values: list[float], bounds) -> None:
    """count, sum and every bucket as observing `values` gives them."""
    expected = {float(b): float(sum(v <= b for v in values)) for b in bounds}
    expected[math.inf] = float(len(values))
    assert histogram(series, name) == (len(values), sum(values), expected), name


def settled(server: TritonServer, num_samples: int) -> dict:
    """The series once every sample is counted and two scrapes 0.6 s apart agree."""
    deadline, previous = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        current = scrape(server)
        done = sum(v for (n, _), v in current.items() if n == "vllm:request_success_total") == num_samples
        if done and current == previous and value(current, "vllm:num_requests_running") == 0:
            return current
        previous = current
        time.sleep(0.6)
    raise AssertionError(f"metrics did not settle at {num_samples} samples: {previous}")


def test_every_series_equals_what_the_requests_did(server, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    before = scrape(server)
    assert sum(v for (n, _), v in before.items() if n == "vllm:request_success_total") == 0
    for reason in ("stop", "length", "abort"):  # every reason's series exists from the start
        assert value(before, "vllm:request_success_total", f'finished_reason="{reason}"') == 0

    short = "Hello, my name is"
    generate(server, short, {"temperature": 0, "max_tokens": 5, "ignore_eos": True})
    ids = tokenizer("The quick brown fox jumps over the lazy dog and keeps running through the dark "
                    "forest, past the river and the old mill, until night falls over the hills").input_ids[:20]
    assert len(ids) == 20
    generate(server, ids, {"temperature": 1.0, "seed": 3, "n": 3, "max_tokens": 7, "ignore_eos": True})
    counting = "1, 2, 3, 4, 5,"
    [stopped] = generate(server, counting, {"temperature": 0, "max_tokens": 20, "stop": [" 8"]},
                    return_finish_reason=True, return_num_output_tokens=True)
    assert stopped.as_numpy("finish_reason")[0].decode() == "stop"
    stop_tokens = int(stopped.as_numpy("num_output_tokens")[0])
    cancelled = "Once upon a time, in a land far away,"
    stream = Stream(server.grpc_url)
    stream.send(make_inputs(cancelled, {"temperature": 0, "max_tokens": 400, "ignore_eos": True}, stream=True))
    for _ in range(3):
        result, error = stream.next()
        assert error is None and not is_final(result)
    stream.close(cancel=True)

    after = settled(server, num_samples=6)
    a, c, d = (len(tokenizer(p).input_ids) for p in (short, counting, cancelled))
    prompt_lengths = [a, 20, 20, 20, c, d]  # per sample
    generated = value(after, "vllm:generation_tokens_total")
    cancelled_tokens = generated - (5 + 3 * 7 + stop_tokens)
    assert 3 <= cancelled_tokens < 400
    generation_lengths = [5, 7, 7, 7, stop_tokens, cancelled_tokens]

    # counters
    assert value(after, "vllm:prompt_tokens_total") == sum(prompt_lengths)
    assert value(after, "vllm:request_success_total", 'finished_reason="length"') == 4
    assert value(after, "vllm:request_success_total", 'finished_reason="stop"') == 1
    assert value(after, "vllm:request_success_total", 'finished_reason="abort"') == 1
    assert value(after, "vllm:num_preemptions_total") == 0
    assert value(after, "vllm:prefix_cache_queries_total") == sum(prompt_lengths)
    assert 0 <= value(after, "vllm:prefix_cache_hits_total") <= 2 * 16  # B's samples may share a block
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert value(after, f"vllm:spec_decode_num_{name}_total") == 0
    assert value(after, "tritonllm:stream_outputs_coalesced_total") >= 0  # the model's own (see model.py)
    # gauges
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(after, name) == 0, name

    # token histograms: exact, bucket by bucket
    token_bounds = buckets_1_2_5(MAX_MODEL_LEN)
    check_exact(after, "vllm:request_prompt_tokens", prompt_lengths, token_bounds)
    check_exact(after, "vllm:request_generation_tokens", generation_lengths, token_bounds)
    check_exact(after, "vllm:request_params_max_tokens", [5, 7, 7, 7, 20, 400], token_bounds)
    check_exact(after, "vllm:request_params_n", [1, 3, 1, 1], N_BUCKETS)
    # one step per token of each request (they ran one after the other); B's samples side by side,
    # though the scheduler may start one a step later (then its prompt rides with the others' tokens)
    steps, step_tokens, step_buckets = histogram(after, "vllm:iteration_tokens_total")
    assert step_tokens == sum(prompt_lengths) + generated
    assert 5 + 7 + stop_tokens + cancelled_tokens <= steps <= 5 + 9 + stop_tokens + cancelled_tokens
    assert step_buckets[1.0] >= 4 + (stop_tokens - 1) + (cancelled_tokens - 1)  # one-token steps
    assert step_buckets[math.inf] == steps
    assert sorted(step_buckets) == [*map(float, ITERATION_TOKENS_BUCKETS), math.inf]

    # latency histograms: counted once per sample (ttft) or per token after a sample's first
    ttft_count, ttft_sum, ttft_buckets = histogram(after, "vllm:time_to_first_token_seconds")
    assert ttft_count == 6 and ttft_sum > 0 and ttft_buckets[math.inf] == 6
    itl = histogram(after, "vllm:inter_token_latency_seconds")
    assert itl[0] == sum(generation_lengths) - 6 and itl[1] > 0
    assert histogram(after, "vllm:time_per_output_token_seconds") == itl  # the same values
    readings = {name: histogram(after, name) for name in LATENCIES}
    for name, (count, total, buckets) in readings.items():
        assert count == 6 and buckets[math.inf] == 6 and total >= 0, name
        assert sorted(buckets) == [*REQUEST_LATENCY_BUCKETS, math.inf], name
        cumulative = [buckets[bound] for bound in sorted(buckets)]
        assert cumulative == sorted(cumulative), name
    sums = {name.split(":")[1].removesuffix("_seconds"): reading[1] for name, reading in readings.items()}
    assert sums["request_prefill_time"] + sums["request_decode_time"] == pytest.approx(sums["request_inference_time"])
    assert sums["request_queue_time"] + sums["request_inference_time"] <= sums["e2e_request_latency"] + 1e-6
    assert sums["request_decode_time"] > 0
