"""Reliability and security, end to end: a real tritonserver with the `llm` model, the OpenAI
frontend in front of it, Triton's and OpenAI's clients. Bad input at both edges, streams cut at
any point, overload, a failing engine step, Triton going away, the API key on every route,
pickle-free loading, cache salts and what the logs hold. Figures go to stdout (`pytest -s`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from backend import AsyncLLMEngine, EngineConfig, SamplingParams
from backend.engine.async_engine import EngineOverloadedError
from openai_frontend import Settings
from tests.utils.serve import ServedApp
from tests.utils.triton import (Stream, is_final, make_inputs, metrics, settled, shm_regions, start_triton,
                                stub_processes, texts, thread_count)
from tools.triton_server import TritonServer, write_model_repository

MAX_MODEL_LEN = 256
ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": MAX_MODEL_LEN,
          "max_num_seqs": 16, "max_waiting_requests": 64}
API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The quick brown fox"
TIMEOUT_S = 60


# -- servers ---------------------------------------------------------------------------------------
# A copy of the llm model whose runner raises once, in its FAILING_CALL-th forward pass.
FLAKY_MODEL = "llm_flaky"
FAILING_CALL = 20
ENGINE_CREATED = "        self.engine = AsyncLLMEngine(engine_config)\n"
INJECTED_FAULT = f"""
        runner, calls = self.engine.engine.runner, iter(range(1, 1 << 30))
        original_execute = runner.execute

        def execute_failing_once(*args, **kwargs):
            if next(calls) == {FAILING_CALL}:
                raise RuntimeError("injected step failure")
            return original_execute(*args, **kwargs)
        runner.execute = execute_failing_once
"""


def add_flaky_model(repository: Path) -> None:
    shutil.copytree(repository / "llm", repository / FLAKY_MODEL)
    config = repository / FLAKY_MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "llm"', f'name: "{FLAKY_MODEL}"'))
    model = repository / FLAKY_MODEL / "1" / "model.py"
    assert ENGINE_CREATED in model.read_text()
    model.write_text(model.read_text().replace(ENGINE_CREATED, ENGINE_CREATED + INJECTED_FAULT))
    engine_json = repository / FLAKY_MODEL / "1" / "model.json"
    engine_json.write_text(json.dumps({**json.loads(engine_json.read_text()), "max_num_seqs": 2}))


@pytest.fixture(scope="module")
def triton(tmp_path_factory, model_path):
    """Roomy: 16 running, 64 waiting. Bad inputs, the soak, faults, logs, salts, fuzzing."""
    from tools.prepare_embeddings import prepare_embeddings
    prepare_embeddings()  # fetched here, not by the Triton model while it loads
    work = tmp_path_factory.mktemp("reliability")
    add_flaky_model(write_model_repository(work / "repository", {"model": model_path, **ENGINE}))
    server = start_triton(work, ("llm", "embeddings"))
    try:
        yield server
    finally:
        code = server.stop()
        # The soak cuts streams on purpose; Triton 2.51 sometimes loses track of a stream cut right
        # after its final response and then cannot unload the model, so it exits through its exit
        # timeout. That (and only that) is tolerated here: the server must still stop by itself.
        log = (work / "triton.log").read_text(errors="replace")
        assert code == 0 or "Exit timeout expired" in log, "tritonserver did not exit cleanly"


@pytest.fixture(scope="module")
def frontend(triton, model_path):
    with ServedApp(Settings(grpc_url=triton.grpc_url, model=model_path, api_key=API_KEY,
                            max_model_len=MAX_MODEL_LEN)) as app:
        @app.app.get("/test/tasks")  # the test's window on the frontend's event loop
        async def tasks():
            return {"tasks": len(asyncio.all_tasks())}
        yield app


def wait_idle(server: TritonServer, model: str = "llm", timeout: float = 20.0) -> dict[str, float]:
    """Metrics once nothing runs, waits or holds a KV block (or the last reading at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        current = metrics(server, model)
        idle = (current["vllm:num_requests_running"], current["vllm:num_requests_waiting"],
                current["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return current
        time.sleep(0.2)


ENGINE_COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")


def table(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}")
    for row in rows:
        print(" | ".join(str(cell) for cell in row))


# -- the engine alone: queue bound and a failing step ----------------------------------------------
@pytest.fixture(scope="module")
def small_engine(model_path):
    engine = AsyncLLMEngine(EngineConfig(model=model_path, dtype="float32", kv_cache_memory_bytes=32 << 20,
                                         max_num_seqs=2, max_waiting_requests=3))
    yield engine
    engine.shutdown()


class Finals:
    """Collects each request's final output."""

    def __init__(self) -> None:
        self.outputs, self.lock = {}, threading.Condition()

    def __call__(self, output) -> None:
        if output.finished:
            with self.lock:
                self.outputs[output.request_id] = output
                self.lock.notify_all()

    def wait(self, count: int, timeout: float = TIMEOUT_S) -> dict:
        with self.lock:
            assert self.lock.wait_for(lambda: len(self.outputs) >= count, timeout), self.outputs.keys()
            return dict(self.outputs)


def assert_engine_idle(engine: AsyncLLMEngine) -> None:
    deadline = time.monotonic() + 10
    while engine.num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    kv_cache = engine.engine.kv_cache
    assert engine.num_unfinished_requests() == 0 and kv_cache.num_free_blocks == kv_cache.num_blocks
    assert engine.num_waiting_requests() == 0


def wait_queue_empty(engine: AsyncLLMEngine) -> None:
    deadline = time.monotonic() + 10
    while engine.num_waiting_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_waiting_requests() == 0


def test_waiting_queue_is_bounded_and_refuses_before_tokenizing(small_engine):
    finals = Finals()
    for i in range(2):  # fill both running slots for the whole test
        small_engine.add_request(f"long{i}", "Hello", SamplingParams(max_tokens=200, ignore_eos=True), finals)
    wait_queue_empty(small_engine)
    accepted, refused = [], []
    for i in range(12):
        try:
            small_engine.add_request(f"q{i}", "Hello there", SamplingParams(max_tokens=12, ignore_eos=True), finals)
            accepted.append(f"q{i}")
        except EngineOverloadedError as error:
            refused.append(str(error))
    assert accepted == ["q0", "q1", "q2"] and len(refused) == 9
    assert "max_waiting_requests=3" in refused[0] and "retry later" in refused[0]
    # Refused before tokenizing: a prompt the engine would reject is refused as overload, cheaply.
    with pytest.raises(EngineOverloadedError):
        small_engine.add_request("bad", "x" * 10**6, SamplingParams(max_tokens=10**9), finals)
    for request_id in accepted:
        small_engine.abort(request_id)
    wait_queue_empty(small_engine)
    # n samples count n: one request of n=3 fills the queue.
    small_engine.add_request("n3", "Hello there", SamplingParams(n=3, max_tokens=4), finals)
    with pytest.raises(EngineOverloadedError):
        small_engine.add_request("one-more", "Hello there", SamplingParams(max_tokens=4), finals)
    for request_id in ("long0", "long1"):
        small_engine.abort(request_id)
    outputs = finals.wait(6)
    assert [len(c.token_ids) for c in outputs["n3"].outputs] == [4, 4, 4], "an accepted request did not complete"
    assert all(outputs[r].outputs[0].finish_reason == "abort" for r in accepted + ["long0", "long1"])
    assert_engine_idle(small_engine)


def test_failed_step_fails_only_the_requests_it_touched(small_engine):
    runner = small_engine.engine.runner
    original, calls = runner.execute, iter(range(1, 1 << 30))

    def failing_once(*args, **kwargs):
        if next(calls) == 6:
            raise RuntimeError("injected step failure")
        return original(*args, **kwargs)

    runner.execute = failing_once
    try:
        finals = Finals()
        for i in range(3):  # two run (max_num_seqs=2), one waits
            small_engine.add_request(f"s{i}", "Once upon a time", SamplingParams(max_tokens=10, ignore_eos=True),
                                     finals)
        outputs = finals.wait(3)
    finally:
        runner.execute = original
    failed = sorted(r for r, o in outputs.items() if o.error)
    assert failed == ["s0", "s1"], outputs
    assert all("injected step failure" in outputs[r].error for r in failed)
    assert len(outputs["s2"].outputs[0].token_ids) == 10, "the queued request did not survive"
    assert not small_engine.errored and small_engine.num_failed_steps == 1
    assert_engine_idle(small_engine)
    finals = Finals()
    small_engine.add_request("after", "Hello", SamplingParams(max_tokens=4), finals)
    assert finals.wait(1)["after"].error is None


# -- bad input at the Triton model -----------------------------------------------------------------
def tensor(name: str, values, datatype: str):
    array = np.array(values, dtype=np.object_ if datatype == "BYTES" else None)
    if datatype == "INT64":
        array = array.astype(np.int64)
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def params_input(raw: bytes):
    return tensor("sampling_parameters", [raw], "BYTES")


def text_input(raw: bytes):
    return tensor("text_input", [raw], "BYTES")


def with_params(raw: bytes) -> list:
    return [text_input(b"Hi"), params_input(raw)]


GRPC_BAD_INPUTS = [
    # (case, inputs, fragment of the error message)
    ("sampling_parameters not JSON", with_params(b'{"temperature": 0,'),
     "sampling_parameters: not valid JSON"),
    ("sampling_parameters a list", with_params(b"[1]"), "sampling_parameters: must be a JSON object"),
    ("sampling_parameters not UTF-8", with_params(b'{"stop": "\xff"}'),
     "sampling_parameters: not valid UTF-8"),
    ("unknown parameter", with_params(b'{"temprature": 1}'), "unknown sampling parameter(s): temprature"),
    ("NaN literal", with_params(b'{"temperature": NaN}'), "NaN is not a number JSON allows"),
    ("Infinity literal", with_params(b'{"top_p": Infinity}'), "Infinity is not a number"),
    ('temperature "inf"', with_params(b'{"temperature": "inf"}'), "temperature: must be a finite number"),
    ('temperature "nan"', with_params(b'{"temperature": "nan"}'), "temperature: must be a finite number"),
    ('repetition_penalty "inf"', with_params(b'{"repetition_penalty": "inf"}'),
     "repetition_penalty: must be a finite number"),
    ("temperature -1", with_params(b'{"temperature": -1}'), "temperature: must be non-negative"),
    ('temperature "hot"', with_params(b'{"temperature": "hot"}'), "temperature: cannot read 'hot'"),
    ("top_p 0", with_params(b'{"top_p": 0}'), "top_p: must be in (0, 1]"),
    ("top_p 1.5", with_params(b'{"top_p": 1.5}'), "top_p: must be in (0, 1]"),
    ("top_k -3", with_params(b'{"top_k": -3}'), "top_k: must be 0 or -1"),
    ("min_p 1.5", with_params(b'{"min_p": 1.5}'), "min_p: must be in [0, 1]"),
    ("presence_penalty 5", with_params(b'{"presence_penalty": 5}'), "presence_penalty: must be in [-2, 2]"),
    ("frequency_penalty -3", with_params(b'{"frequency_penalty": -3}'),
     "frequency_penalty: must be in [-2, 2]"),
    ("repetition_penalty 0", with_params(b'{"repetition_penalty": 0}'),
     "repetition_penalty: must be greater than zero"),
    ("n 10^6", with_params(b'{"n": 1000000}'), "n: must be at most 128"),
    ("n 0", with_params(b'{"n": 0}'), "n: must be at least 1"),
    ("n true", with_params(b'{"n": true}'), "n: must be an integer"),
    ("max_tokens 10^12", with_params(b'{"max_tokens": 1000000000000}'),
     f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("max_tokens 0", with_params(b'{"max_tokens": 0}'), "max_tokens: must be at least 1"),
    ("max_tokens an object", with_params(b'{"max_tokens": {"a": 1}}'), "max_tokens: must be an integer"),
    ("logprobs 21", with_params(b'{"logprobs": 21}'), "logprobs: must be in [0, 20]"),
    ("seed 2^70", with_params(b'{"seed": 1180591620717411303424}'), "seed: must fit in 64 bits"),
    ("stop a number", with_params(b'{"stop": 5}'), "stop: must be a string or a list of strings (got 5)"),
    ("stop_token_ids garbage", with_params(b'{"stop_token_ids": "abc"}'), "stop_token_ids: invalid value"),
    ("stop_token_ids outside the vocabulary", with_params(b'{"stop_token_ids": [10000000]}'),
     "stop_token_ids: token ids must be in [0, "),
    ("logit_bias a list", with_params(b'{"logit_bias": [1, 2]}'), "logit_bias: must be an object of token id -> bias"),
    ("logit_bias 1e9", with_params(b'{"logit_bias": {"5": 1e9}}'), "logit_bias: biases must be in"),
    ("logit_bias outside the vocabulary", with_params(b'{"logit_bias": {"9999999": 1}}'),
     "logit_bias: token ids must be in [0, "),
    ("min_tokens > max_tokens", with_params(b'{"min_tokens": 50, "max_tokens": 4}'),
     "min_tokens: must be at most max_tokens"),
    ("cache_salt a number", with_params(b'{"cache_salt": 5}'), "cache_salt: must be a string"),
    ("no prompt", [params_input(b"{}")], "text_input: required"),
    ("empty text_input", [text_input(b""), params_input(b"{}")], "prompt: must not be empty"),
    ("text_input not UTF-8", [text_input(b"\xff\xfe abc")], "text_input: not valid UTF-8"),
    ("text_input a lone surrogate (CESU-8)", [text_input(b"\xed\xa0\x80")], "text_input: not valid UTF-8"),
    ("empty input_ids", [tensor("input_ids", np.zeros([0], np.int32), "INT32")], "prompt: must not be empty"),
    ("input_ids outside the vocabulary", [tensor("input_ids", np.array([1, 10**7], np.int32), "INT32")],
     "prompt: token ids must be integers in [0, "),
    ("input_ids negative", [tensor("input_ids", np.array([-5], np.int32), "INT32")],
     "prompt: token ids must be integers"),
    ("input_ids INT64", [tensor("input_ids", [1, 2], "INT64")],
     "data-type is 'INT64', but model 'llm' expects 'INT32'"),
    ("prompt over the context", [text_input(b"hello " * 300)], f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("text_input of shape [2]", [tensor("text_input", [b"a", b"b"], "BYTES")],
     "unexpected shape for input 'text_input'"),
    ("text_input as INT32", [tensor("text_input", np.array([1], np.int32), "INT32")], "data-type is 'INT32'"),
    ("an unknown input", [text_input(b"Hi"), tensor("bogus", np.array([1], np.int32), "INT32")],
     "unexpected inference input 'bogus'"),
    ("stream echoing the prompt", [text_input(b"Hi"), tensor("stream", np.array([True]), "BOOL"),
                                   tensor("exclude_input_in_output", np.array([False]), "BOOL")],
     "When streaming, `exclude_input_in_output` = False is not allowed."),
]

# Over HTTP the error code shows: INVALID_ARG is a 400.
HTTP_BAD_INPUTS = [
    ("parameters: NaN temperature", {"text_input": "Hi", "parameters": {"temperature": "nan"}},
     "temperature: must be a finite number"),
    ("parameters: n 10^6", {"text_input": "Hi", "parameters": {"n": 1000000}}, "n: must be at most 128"),
    ("parameters: logprobs 21", {"text_input": "Hi", "parameters": {"logprobs": 21}}, "logprobs: must be in [0, 20]"),
    ("sampling_parameters not JSON", {"text_input": "Hi", "sampling_parameters": "{"},
     "sampling_parameters: not valid JSON"),
    ("sampling_parameters Infinity", {"text_input": "Hi", "sampling_parameters": '{"top_k": Infinity}'},
     "Infinity is not a number"),
    ("prompt over the context", {"text_input": "hello " * 300}, f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("empty text_input", {"text_input": ""}, "prompt: must not be empty"),
]


def grpc_error(server: TritonServer, inputs: list) -> str | None:
    stream = Stream(server.grpc_url)
    try:
        stream.send(inputs)
        while True:
            result, error = stream.next()
            if error is not None:
                return error.message()
            if is_final(result):
                return None
    finally:
        stream.close()


def test_bad_input_at_the_triton_model(triton):
    before = settled(triton)
    rows, wrong = [], []
    for case, inputs, fragment in GRPC_BAD_INPUTS:
        message = grpc_error(triton, inputs)
        rows.append(("gRPC", case, message))
        if message is None or fragment not in message:
            wrong.append((case, fragment, message))
    for case, body, fragment in HTTP_BAD_INPUTS:
        request = urllib.request.Request(f"http://{triton.http_url}/v2/models/llm/generate", json.dumps(body).encode())
        try:
            urllib.request.urlopen(request, timeout=TIMEOUT_S)
            status, message = 200, None
        except urllib.error.HTTPError as error:
            status, message = error.code, json.loads(error.read())["error"]
        rows.append((f"HTTP {status}", case, message))
        if status != 400 or fragment not in message:
            wrong.append((case, fragment, status, message))
    table(f"Triton model: {len(rows)} bad inputs", rows)
    assert not wrong, wrong
    assert len(rows) >= 30
    after = settled(triton)
    assert [after[c] for c in ENGINE_COUNTERS] == [before[c] for c in ENGINE_COUNTERS], "a bad input reached the engine"
    [result] = run_to_end(triton, make_inputs(PROMPT, {"temperature": 0, "max_tokens": 2}))
    assert texts(result)[0].startswith(PROMPT)  # still serving


def run_to_end(server: TritonServer, inputs: list, model: str = "llm") -> list:
    """One request's responses, up to and including its final one; an error raises."""
    stream = Stream(server.grpc_url)
    try:
        stream.send(inputs, model=model)
        return stream.collect()
    finally:
        stream.close()


# -- bad input at the frontend ---------------------------------------------------------------------
def completion(**changes) -> dict:
    return {"model": "{model}", "prompt": "Hi", "max_tokens": 2, **changes}


def chat(**changes) -> dict:
    return {"model": "{model}", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **changes}


RAW = b'{"model": "{model}", '  # the start of a hand-written body
FRONTEND_BAD_INPUTS = [
    # (case, endpoint, body (bytes: sent as is), status, param, fragment of the message)
    ("malformed JSON", "completions", RAW + b'"prompt": ', 400, None, "not valid JSON"),
    ("a JSON array", "completions", b"[1, 2]", 400, None, "valid dictionary"),
    ("an empty body", "completions", b"", 400, None, "Field required"),
    ("invalid UTF-8", "completions", RAW + b'"prompt": "\xff\xfe"}', 400, None, "not valid UTF-8"),
    ("JSON nested 100000 deep", "completions", RAW + b'"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None,
     "could not be parsed"),
    ("a lone surrogate in the prompt", "completions", RAW + b'"prompt": "a\\ud800b"}', 400, "prompt", "lone surrogate"),
    ("a lone surrogate in a message", "chat/completions",
     RAW + b'"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages", "lone surrogate"),
    ("a lone surrogate in stop", "completions", RAW + b'"prompt": "hi", "stop": ["\\ud800"]}', 400, "stop",
     "lone surrogate"),
    ("a lone surrogate to embed", "embeddings", b'{"model": "all-MiniLM-L6-v2", "input": "\\ud800"}', 400, "input",
     "lone surrogate"),
    ("NaN temperature", "completions", RAW + b'"prompt": "hi", "temperature": NaN}', 400, "temperature",
     "finite number"),
    ("Infinity top_p", "completions", RAW + b'"prompt": "hi", "top_p": Infinity}', 400, "top_p", "finite number"),
    ("-Infinity presence_penalty", "chat/completions",
     RAW + b'"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}', 400,
     "presence_penalty", "finite number"),
    ("temperature a string", "completions", completion(temperature="0.5"), 400, "temperature", "valid number"),
    ("n a string", "completions", completion(n="2"), 400, "n", "valid integer"),
    ("n true", "completions", completion(n=True), 400, "n", "valid integer"),
    ("stream 1", "completions", completion(stream=1), 400, "stream", "valid boolean"),
    ("temperature -0.5", "chat/completions", chat(temperature=-0.5), 400, "temperature", "greater than or equal to 0"),
    ("top_p 1.5", "completions", completion(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    ("top_p 0", "chat/completions", chat(top_p=0), 400, "top_p", "greater than 0"),
    ("top_k -2", "completions", completion(top_k=-2), 400, "top_k", "greater than or equal to -1"),
    ("min_p 2", "completions", completion(min_p=2), 400, "min_p", "less than or equal to 1"),
    ("frequency_penalty 3", "completions", completion(frequency_penalty=3), 400, "frequency_penalty",
     "less than or equal to 2"),
    ("repetition_penalty 0", "completions", completion(repetition_penalty=0), 400, "repetition_penalty",
     "greater than 0"),
    ("n 10^9", "completions", completion(n=10**9), 400, "n", "less than or equal to 128"),
    ("max_tokens 10^12", "completions", completion(max_tokens=10**12), 400, "prompt", "maximum context length"),
    ("max_tokens 2^70", "chat/completions", chat(max_tokens=2**70), 400, "messages", "maximum context length"),
    ("max_tokens -1", "completions", completion(max_tokens=-1), 400, "max_tokens", "greater than or equal to 0"),
    ("logprobs 6", "completions", completion(logprobs=6), 400, "logprobs", "less than or equal to 5"),
    ("top_logprobs 21", "chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "less than or equal to 20"),
    ("an empty prompt", "completions", completion(prompt=""), 400, "prompt", "must not be empty"),
    ("an empty prompt list", "completions", completion(prompt=[]), 400, "prompt", "must not be empty"),
    ("an empty token list", "completions", completion(prompt=[[]]), 400, "prompt", "must not be empty"),
    ("no messages", "chat/completions", chat(messages=[]), 400, "messages", "at least 1 item"),
    ("an unknown role", "chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role", "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("a message without a role", "chat/completions", chat(messages=[{"content": "hi"}]), 400, "messages[0].role",
     "Field required"),
    ("messages a string", "chat/completions", chat(messages="hi"), 400, "messages", "valid list"),
    ("content a number", "chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "valid string"),
    ("an image part", "chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]), 400,
     "messages[0].content[0]", "does not accept images"),
    ("an image part without its URL", "chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url"}]}]), 400, "messages[0].content[0]", "needs image_url.url"),
    ("an audio part", "chat/completions", chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
     400, "messages[0].content[0]", "text and image_url parts are supported"),
    ("a token id outside the vocabulary", "completions", completion(prompt=[1, 10**6]), 400, "prompt",
     "token ids must be integers in [0, "),
    ("a negative token id", "completions", completion(prompt=[-1]), 400, "prompt[0]", "greater than or equal to 0"),
    ("a token id of 2^40", "completions", completion(prompt=[2**40]), 400, "prompt[0]", "less than 2147483648"),
    ("a prompt over the context", "completions", completion(prompt="hello " * 300), 400, "prompt",
     "maximum context length"),
    ("messages over the context", "chat/completions", chat(messages=[{"role": "user", "content": "hi " * 300}]), 400,
     "messages", "maximum context length"),
    ("the prompt a dict", "completions", completion(prompt={"a": 1}), 400, "prompt", "valid string"),
    ("stop numbers", "completions", completion(stop=[1, 2]), 400, "stop", "valid string"),
    ("seed 2^64", "completions", completion(seed=2**64), 400, "seed", "less than or equal to"),
    ("stop_token_ids outside the vocabulary", "completions", completion(stop_token_ids=[10**6]), 400,
     "stop_token_ids", "token ids must be in [0, "),
    ("logit_bias 1000", "completions", completion(logit_bias={"5": 1000}), 400, "logit_bias",
     "less than or equal to 100"),
    ("logit_bias key not a token id", "completions", completion(logit_bias={"x": 1}), 400, "logit_bias",
     "keys must be"),
    ("min_tokens > max_tokens", "completions", completion(min_tokens=5), 400, "min_tokens", "at most max_tokens"),
    ("cache_salt a number", "completions", completion(cache_salt=5), 400, "cache_salt", "valid string"),
    ("cache_salt empty", "completions", completion(cache_salt=""), 400, "cache_salt", "at least 1 character"),
    ("no model", "completions", {"prompt": "hi"}, 400, "model", "Field required"),
    ("model a number", "completions", completion(model=5), 400, "model", "valid string"),
    ("an unknown model", "completions", completion(model="no-such-model"), 404, "model", "does not exist"),
    ("stream_options without stream", "completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options", "only allowed when stream"),
    ("response_format xml", "chat/completions", chat(response_format={"type": "xml"}), 400, "response_format.type",
     "'text', 'json_object' or 'json_schema'"),
    ("continue_final_message without one", "chat/completions",
     chat(continue_final_message=True, add_generation_prompt=False), 400, "continue_final_message", "final assistant"),
    ("nothing to embed", "embeddings", {"model": "all-MiniLM-L6-v2", "input": []}, 400, "input", "must not be empty"),
    ("2049 texts to embed", "embeddings", {"model": "all-MiniLM-L6-v2", "input": ["a"] * 2049}, 400, "input",
     "at most 2048"),
    ("a 2 MiB body", "completions", completion(prompt="x" * (2 << 20)), 413, None, "exceeds 1048576 bytes"),
]


def post_frontend(url: str, endpoint: str, body, model: str, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    content = content.replace(b"{model}", model.encode())
    return httpx.post(f"{url}/v1/{endpoint}", content=content, timeout=TIMEOUT_S,
                      headers={**headers, "Content-Type": "application/json"})


def test_bad_input_at_the_frontend(triton, frontend, model_name):
    before = settled(triton)
    rows, wrong = [], []
    for case, endpoint, body, status, param, fragment in FRONTEND_BAD_INPUTS:
        response = post_frontend(frontend.url, endpoint, body, model_name)
        error = response.json().get("error", {}) if response.headers.get("content-type") == "application/json" else {}
        rows.append((response.status_code, case, error.get("param"), error.get("message")))
        if (response.status_code, error.get("param")) != (status, param) or fragment not in error.get("message", "") \
                or set(error) != {"message", "type", "param", "code"}:
            wrong.append((case, response.status_code, response.text[:200]))
    table(f"OpenAI frontend: {len(rows)} bad inputs", rows)
    assert not wrong, wrong
    after = settled(triton)
    assert [after[c] for c in ENGINE_COUNTERS] == [before[c] for c in ENGINE_COUNTERS], "a bad input reached the engine"
    assert post_frontend(frontend.url, "completions", completion(), model_name).status_code == 200  # still serving


# -- streams cut at any point ----------------------------------------------------------------------
SOAK_STREAMS = 48
SOAK_SECONDS = 20


# gRPC core's timer manager ("grpc_global_timer") starts a thread when all of its timers are busy
# and retires idle ones on its own schedule: a pool of bounded size, not a leak. It is counted apart.
GRPC_TIMER_THREAD = "grpc_global_tim"
GRPC_TIMER_SLACK = 2


def resource_counts(triton: TritonServer, frontend: ServedApp) -> dict[str, int]:
    stubs = stub_processes(triton)
    names = thread_names(triton.process.pid)
    timers = names.count(GRPC_TIMER_THREAD)
    return {"triton threads": len(names) - timers, "triton gRPC timer threads": timers, "model processes": len(stubs),
            "model threads": sum(thread_count(pid) for pid in stubs),
            "test-process threads": thread_count(os.getpid()),
            "frontend tasks": httpx.get(f"{frontend.url}/test/tasks", headers=AUTH).json()["tasks"]}


async def grpc_stream(client, max_tokens: int, cut_after: int | None, delay: float) -> tuple[str, int]:
    """One gRPC stream: cut after `cut_after` tokens (0: `delay` seconds after sending, before any
    token: queued or prefilling), or read to the end (None). Returns (outcome, tokens received)."""
    inputs = make_inputs(f"{PROMPT} {random.random()}", {"max_tokens": max_tokens, "ignore_eos": True}, stream=True)

    async def requests():
        yield {"model_name": "llm", "inputs": inputs, "parameters": {"enable_empty_final_response": True}}

    responses, received = client.stream_infer(requests()), 0
    if cut_after == 0:
        await asyncio.sleep(delay)
        responses.cancel()
        return "cut", 0
    async for result, error in responses:
        assert error is None, error.message()
        received += bool(result.get_response().outputs)
        if is_final(result):
            async for _ in responses:  # Triton ends the stream by itself once it answered all
                pass
            return "completed", received
        if received == cut_after:
            responses.cancel()
            return "cut", received
    raise AssertionError("the stream ended without a final response")


async def sse_stream(http: httpx.AsyncClient, url: str, model: str, max_tokens: int, cut_after: int | None,
                     delay: float) -> tuple[str, int]:
    """The same over the frontend's SSE: cut = the HTTP connection closed."""
    body = {"model": model, "prompt": f"{PROMPT} {random.random()}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}

    async def read() -> tuple[str, int]:
        received = 0
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return "completed", received
                if line.startswith("data: "):
                    assert "error" not in json.loads(line[6:]), line
                    received += 1
                    if received == cut_after:
                        return "cut", received
        raise AssertionError("the SSE stream ended without [DONE]")

    if cut_after != 0:
        return await read()
    reading = asyncio.ensure_future(read())  # headers wait for Triton's first response
    await asyncio.sleep(delay)
    if reading.done():
        return reading.result()
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    return "cut", 0


def warm_up(triton: TritonServer, frontend: ServedApp, model_name: str) -> None:
    """One round at the soak's concurrency, completed and cut streams alike: thread pools that grow
    with concurrent streams (Triton's among them) reach their size before the baseline is taken."""
    async def streams():
        client = grpcaio.InferenceServerClient(triton.grpc_url)
        async with httpx.AsyncClient(headers=AUTH, timeout=TIMEOUT_S) as http:
            cuts = [(None, 0, 3)[i % 3] for i in range(SOAK_STREAMS // 2)]
            await asyncio.gather(*(grpc_stream(client, 8, cut, 0.05) for cut in cuts),
                                 *(sse_stream(http, frontend.url, model_name, 8, cut, 0.05) for cut in cuts))
        await client.close()

    asyncio.run(streams())
    wait_idle(triton)


def thread_names(pid: int) -> list[str]:
    return sorted(Path(f"/proc/{pid}/task/{task}/comm").read_text(encoding="utf-8").strip() for task in os.listdir(f"/proc/{pid}/task"))


@pytest.mark.slow
def test_soak_streams_cut_anywhere_leave_nothing_behind(triton, frontend, model_name):
    """48 concurrent streams at a time, half gRPC, half SSE through the frontend, each cut at a
    random point (before its first token: queued or prefilling; or while decoding) or completed."""
    rng = random.Random(9)
    warm_up(triton, frontend, model_name)  # thread pools grow on first use: count after that
    baseline = resource_counts(triton, frontend)
    outcomes = {"gRPC": {"cut": 0, "completed": 0}, "SSE": {"cut": 0, "completed": 0}}
    cut_before_first_token = rounds = 0

    async def run_round(client, http):
        plans = []
        for i in range(SOAK_STREAMS):
            max_tokens, fate = rng.randint(4, 32), rng.random()
            # a quarter complete, a quarter are cut before their first token, the rest mid-way
            cut_after = None if fate < 0.25 else 0 if fate < 0.5 else rng.randint(1, max_tokens)
            kind, delay = ("gRPC" if i % 2 else "SSE"), rng.uniform(0, 0.3)
            plans.append((kind, cut_after, grpc_stream(client, max_tokens, cut_after, delay) if kind == "gRPC"
                          else sse_stream(http, frontend.url, model_name, max_tokens, cut_after, delay)))
        results = await asyncio.gather(*(coroutine for _, _, coroutine in plans))
        return [(kind, cut_after, result) for (kind, cut_after, _), result in zip(plans, results)]

    async def soak():
        nonlocal cut_before_first_token, rounds
        client = grpcaio.InferenceServerClient(triton.grpc_url)
        async with httpx.AsyncClient(headers=AUTH, timeout=TIMEOUT_S) as http:
            deadline = time.monotonic() + SOAK_SECONDS
            while rounds == 0 or time.monotonic() < deadline:
                for kind, cut_after, (outcome, _) in await run_round(client, http):
                    outcomes[kind][outcome] += 1
                    cut_before_first_token += outcome == "cut" and cut_after == 0
                rounds += 1
        await client.close()

    names_before = {pid: thread_names(pid) for pid in stub_processes(triton)}
    triton_names_before = thread_names(triton.process.pid)
    started = time.monotonic()
    asyncio.run(soak())
    elapsed = time.monotonic() - started
    after = wait_idle(triton)
    # Let gRPC, uvicorn and the model's threads wind down: poll (bounded) until back at baseline.
    deadline = time.monotonic() + 20
    while True:
        final = resource_counts(triton, frontend)
        settled = (final["model processes"] == baseline["model processes"]
                   and final["model threads"] == baseline["model threads"]
                   and final["triton threads"] <= baseline["triton threads"]
                   and final["triton gRPC timer threads"] <= baseline["triton gRPC timer threads"]
                   and final["test-process threads"] <= baseline["test-process threads"] + 2
                   and final["frontend tasks"] == baseline["frontend tasks"])
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    streams = sum(sum(o.values()) for o in outcomes.values())
    print(f"\nsoak: {streams} streams in {rounds} rounds of {SOAK_STREAMS} over {elapsed:.1f} s: {outcomes}; "
          f"{cut_before_first_token} cut before their first token")
    print(f"after: running {after['vllm:num_requests_running']:.0f}, waiting {after['vllm:num_requests_waiting']:.0f}, "
          f"KV usage {after['vllm:kv_cache_usage_perc']:.3f}; resources {baseline} -> {final}")
    assert (after["vllm:num_requests_running"], after["vllm:num_requests_waiting"],
            after["vllm:kv_cache_usage_perc"]) == (0, 0, 0), "a cut stream kept its request or its KV blocks"
    assert outcomes["gRPC"]["cut"] > 0 and outcomes["SSE"]["cut"] > 0 and cut_before_first_token > 0
    assert final["model processes"] == baseline["model processes"]
    assert final["model threads"] == baseline["model threads"], \
        {pid: (names, thread_names(pid)) for pid, names in names_before.items()}
    assert final["triton threads"] <= baseline["triton threads"], (triton_names_before, thread_names(triton.process.pid))
    assert final["triton gRPC timer threads"] <= baseline["triton gRPC timer threads"] + GRPC_TIMER_SLACK
    assert final["test-process threads"] <= baseline["test-process threads"] + 2  # gRPC's own pollers
    assert final["frontend tasks"] == baseline["frontend tasks"]


# -- a failing engine step -------------------------------------------------------------------------
def test_a_failing_step_fails_only_its_requests_and_the_model_stays_ready(triton):
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.load_model(FLAKY_MODEL)
    try:
        stream = Stream(triton.grpc_url)
        try:
            for i in range(4):  # two run (max_num_seqs=2), two wait
                stream.send(make_inputs(PROMPT, {"temperature": 0, "max_tokens": 30, "ignore_eos": True}, stream=True,
                                        return_num_output_tokens=True), request_id=str(i), model=FLAKY_MODEL)
            tokens, errors, completed = {str(i): 0 for i in range(4)}, [], []
            while len(errors) + len(completed) < 4:
                result, error = stream.next()
                if error is not None:
                    errors.append(error.message())
                    continue
                request_id = result.get_response().id
                if result.as_numpy("num_output_tokens") is not None:
                    tokens[request_id] += int(result.as_numpy("num_output_tokens")[0])
                if is_final(result):
                    completed.append(request_id)
        finally:
            stream.close()
        print(f"\nfailing step: {len(errors)} requests failed ({errors[:1]}), "
              f"{len(completed)} completed with {[tokens[r] for r in completed]} tokens")
        assert len(errors) == 2 and all("injected step failure" in m for m in errors)
        assert len(completed) == 2 and all(tokens[r] == 30 for r in completed)
        assert client.is_model_ready(FLAKY_MODEL)
        [result] = run_to_end(triton, make_inputs(PROMPT, {"temperature": 0, "max_tokens": 3}), model=FLAKY_MODEL)
        assert texts(result)[0].startswith(PROMPT)
        after = wait_idle(triton, FLAKY_MODEL)
        assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:num_requests_running"] == 0
    finally:
        client.unload_model(FLAKY_MODEL)
        client.close()


# -- security --------------------------------------------------------------------------------------
def test_api_key_guards_every_route_but_the_public_ones(frontend, model_name):
    from openai_frontend.app import PUBLIC_PATHS
    paths = [*frontend.app.openapi()["paths"], "/docs/oauth2-redirect"]
    guarded = sorted({path.replace("{model}", model_name) for path in paths
                      if path not in PUBLIC_PATHS and not path.startswith("/test/")})
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings"} <= set(guarded)
    wrong_keys = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                  {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
                  {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": "Bearer"}]
    for path in guarded + ["/v1/no-such-route", "/admin"]:
        for headers in wrong_keys:
            response = httpx.post(f"{frontend.url}{path}", headers=headers, json={})
            assert response.status_code == 401, (path, headers, response.status_code)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{frontend.url}/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{frontend.url}{path}").status_code == 200


def test_pickled_weights_are_never_loaded(tmp_path, model_path):
    """A folder with only a pickle checkpoint: loading refuses it, and the pickle's code never runs."""
    import pickle

    from backend import LLM
    marker = tmp_path / "pickle-ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_path) / name, folder / name)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ValueError, match="pickle checkpoints are never loaded"):
        LLM(str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert not marker.exists()


def test_cache_salt_isolates_prefix_caches(triton, frontend, model_name):
    prompt = "Tenant data: " + " ".join(f"item{i}" for i in range(60))  # several full KV blocks

    def hits_after(salt: str | None) -> float:
        body = completion(prompt=prompt, max_tokens=1, **({"cache_salt": salt} if salt else {}))
        assert post_frontend(frontend.url, "completions", body, model_name).status_code == 200
        return settled(triton)["vllm:prefix_cache_hits_total"]

    start = settled(triton)["vllm:prefix_cache_hits_total"]
    first = hits_after("tenant-a")
    other_tenant = hits_after("tenant-b")
    unsalted = hits_after(None)
    same_tenant = hits_after("tenant-a")
    assert other_tenant == first and unsalted == other_tenant, "a salted prefix was shared across tenants"
    assert same_tenant > unsalted, "the same tenant's prefix was not reused"
    print(f"\ncache_salt: hits {start} -> a {first} -> b {other_tenant} -> none {unsalted} -> a {same_tenant}")


MARKER = "zebra-marker-5f1c"


def test_logs_hold_no_prompt_or_completion_unless_asked(triton, frontend, model_path, model_name, caplog):
    caplog.set_level(logging.DEBUG)  # every logger in this process: the frontend, uvicorn, gRPC
    prompt = f"Repeat after me: {MARKER} {MARKER} {MARKER}"
    for endpoint, body in [("completions", completion(prompt=prompt, max_tokens=16, temperature=0)),
                           ("chat/completions", chat(messages=[{"role": "user", "content": prompt}], max_tokens=16)),
                           ("completions", completion(prompt=prompt, stream=True, max_tokens=4)),
                           ("completions", completion(prompt=prompt, top_p=7)),  # refused by the frontend
                           ("completions", completion(prompt=prompt * 40))]:  # over the context
        post_frontend(frontend.url, endpoint, body, model_name)
    assert caplog.records and MARKER not in caplog.text, "a prompt reached the frontend's logs"
    # The model's stub writes its Python logging (the engine's too) into Triton's log.
    assert MARKER not in Path(triton.log_file).read_text(encoding="utf-8", errors="replace"), "a prompt reached Triton's log"

    with ServedApp(Settings(grpc_url=triton.grpc_url, model=model_path, log_requests=True,
                            max_model_len=MAX_MODEL_LEN)) as logging_frontend:
        post_frontend(logging_frontend.url, "completions", completion(prompt=prompt, max_tokens=4), model_name, {})
    logged = [r.getMessage() for r in caplog.records if r.name == "openai_frontend.requests"]
    assert any(MARKER in m and "prompt 0" in m for m in logged), "--log-requests did not log the prompt"
    assert any("choice 0" in m for m in logged), "--log-requests did not log the completion"


# -- overload, and Triton going away under the frontend --------------------------------------------
TIGHT = {**ENGINE, "max_num_seqs": 2, "max_waiting_requests": 4}
OVERLOAD_SECONDS = 10


@pytest.fixture(scope="module")
def tight_triton(tmp_path_factory, model_path):
    """2 running, 4 waiting: easy to overload. Restarted on the same ports by the restart test."""
    work = tmp_path_factory.mktemp("tight")
    write_model_repository(work / "repository", {"model": model_path, **TIGHT})
    server = start_triton(work, ("llm",))
    try:
        yield server
    finally:
        assert server.stop() == 0, "tritonserver did not exit cleanly"


@pytest.fixture(scope="module")
def tight_frontend(tight_triton, model_path):
    with ServedApp(Settings(grpc_url=tight_triton.grpc_url, model=model_path, max_model_len=MAX_MODEL_LEN)) as app:
        yield app


@pytest.mark.slow
def test_overload_is_refused_fast_and_every_accepted_request_completes(tight_triton, tight_frontend, model_name):
    clients = 4 * TIGHT["max_waiting_requests"]
    accepted, refused, refusal_latency, other = [], [], [], []

    async def client(http: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            body = {"model": model_name, "prompt": f"{PROMPT} {random.random()}", "max_tokens": 8, "ignore_eos": True}
            started = time.monotonic()
            response = await http.post(f"{tight_frontend.url}/v1/completions", json=body)
            if response.status_code == 200:
                accepted.append(response.json()["usage"]["completion_tokens"])
            elif response.status_code == 503:
                refusal_latency.append(time.monotonic() - started)
                refused.append(response)
                await asyncio.sleep(float(response.headers["retry-after"]))
            else:
                other.append((response.status_code, response.text))

    async def overload():
        async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=clients)) as http:
            deadline = time.monotonic() + OVERLOAD_SECONDS
            await asyncio.gather(*(client(http, deadline) for _ in range(clients)))

    asyncio.run(overload())
    latencies = sorted(refusal_latency)
    print(f"\noverload: {clients} clients for {OVERLOAD_SECONDS} s against 2 running + 4 waiting: "
          f"{len(accepted)} accepted (all completed: {set(accepted) == {8}}), {len(refused)} refused with 503; "
          f"refusal latency median {statistics.median(latencies) * 1000:.0f} ms, "
          f"p95 {latencies[int(len(latencies) * 0.95)] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms")
    assert not other, other[:3]
    assert accepted and set(accepted) == {8}, "an accepted request did not complete"
    assert len(refused) >= 10
    error = refused[0].json()["error"]
    assert error["code"] == "engine_overloaded" and "max_waiting_requests=4" in error["message"]
    assert refused[0].headers["retry-after"] == "1"
    assert statistics.median(latencies) < 0.25 and latencies[-1] < 2.0
    idle = wait_idle(tight_triton)
    assert (idle["vllm:num_requests_running"], idle["vllm:num_requests_waiting"], idle["vllm:kv_cache_usage_perc"]) \
        == (0, 0, 0)
    assert httpx.get(f"{tight_frontend.url}/health").status_code == 200


def test_overload_over_grpc_is_an_unavailable_error(tight_triton):
    streams = [Stream(tight_triton.grpc_url) for _ in range(10)]
    try:
        for stream in streams:
            stream.send(make_inputs(PROMPT, {"max_tokens": 40, "ignore_eos": True}))
        outcomes = []
        for stream in streams:
            result, error = stream.next()
            outcomes.append(None if error is None else error.message())
    finally:
        for stream in streams:
            stream.close()
    refused = [m for m in outcomes if m is not None]
    assert len(refused) >= 4 and all("overloaded" in m and "max_waiting_requests=4" in m for m in refused), outcomes
    wait_idle(tight_triton)


@pytest.mark.slow
def test_triton_killed_and_restarted_under_the_frontend(tight_triton, tight_frontend, model_name):
    url = tight_frontend.url
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 4}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).status_code == 200

    # A stream in flight when Triton dies gets an error event and [DONE], not a hang.
    events: list = []

    def stream_until_done():
        long = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=TIMEOUT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    reader = threading.Thread(target=stream_until_done)
    reader.start()
    while len(events) < 3:
        time.sleep(0.05)
    regions = shm_regions(tight_triton)
    killed = time.monotonic()
    os.killpg(tight_triton.process.pid, signal.SIGKILL)  # a crash: no graceful shutdown
    tight_triton.process.wait()
    reader.join(TIMEOUT_S)
    assert not reader.is_alive() and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable", events[-2]
    stream_ended_after = time.monotonic() - killed
    for region in regions:
        region.unlink(missing_ok=True)

    started = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{url}/health").status_code == 503
    assert time.monotonic() - started < 2.0, "the frontend hung while Triton was down"

    tight_triton.start()  # same ports
    tight_triton.wait_ready(300)
    back = time.monotonic()
    while httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).status_code != 200:
        assert time.monotonic() - back < 15, "the frontend did not recover by itself"
        time.sleep(0.2)
    recovered_after = time.monotonic() - back
    assert httpx.get(f"{url}/health").status_code == 200
    print(f"\nTriton killed: the open stream ended {stream_ended_after:.2f} s later with an error event; "
          f"503 while down; served again {recovered_after:.2f} s after Triton was ready")


# -- schemathesis ----------------------------------------------------------------------------------
FUZZ_EXAMPLES = 100  # per operation and mode
FUZZ_SECONDS = 25  # a time box per operation and mode: examples past it are skipped


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(triton, model_path, model_name):
    """At least 500 schema-driven requests, valid and invalid, against every operation: never a
    5xx. Bodies name a served model (a random name only tests the 404); valid ones get max_tokens
    <= 4 and n <= 2, and the frontend claims a 64-token context, so that they stay cheap on CPU."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    def cheap(case, mode):
        if isinstance(case.body, dict):
            case.body["model"] = "all-MiniLM-L6-v2" if case.path == "/v1/embeddings" else model_name
            if mode == GenerationMode.POSITIVE and case.path != "/v1/embeddings":
                case.body["max_tokens"] = min(case.body.get("max_tokens") or 4, 4)
                case.body["max_completion_tokens"] = min(case.body.get("max_completion_tokens") or 4, 4)
                case.body["n"] = min(case.body.get("n", 1), 2)
        return case

    with ServedApp(Settings(grpc_url=triton.grpc_url, model=model_path, max_model_len=64)) as fuzzed:
        schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
        server_errors, answered = [], []
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                deadline = time.monotonic() + FUZZ_SECONDS

                @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def call(case):
                    if time.monotonic() > deadline:  # noqa: B023 - call() runs within this iteration
                        return
                    case = cheap(case, mode)  # noqa: B023
                    response = case.call(base_url=fuzzed.url, timeout=TIMEOUT_S)
                    answered.append((case.path, response.status_code))
                    if response.status_code >= 500:
                        server_errors.append((case.path, case.body, response.status_code, response.text))

                try:
                    call()
                except Unsatisfiable:  # nothing invalid to send (an operation without inputs)
                    assert mode == GenerationMode.NEGATIVE
    statuses: dict = {}
    for path, status in answered:
        statuses.setdefault(path, {}).setdefault(status, 0)
        statuses[path][status] += 1
    print(f"\nschemathesis: {len(answered)} requests, by path and status: {statuses}")
    assert not server_errors, server_errors[:3]
    assert len(answered) >= 500
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        assert (path, 200) in answered, path  # the run reached the engine
