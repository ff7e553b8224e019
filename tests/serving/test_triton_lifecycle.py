"""The `llm` model's lifecycle on a real tritonserver: unloaded and reloaded ten times, idle and
under streaming gRPC load, the server alive and answering after each (issue 31); a load of an
unchanged model is a no-op; a metrics scrape right after a final response counts that request.

A tiny random Llama with SmolLM2's tokenizer keeps each load to seconds: what is under test is
Triton's and the model's lifecycle, not the weights.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.utils import wait_for
from tests.utils.triton import TIMEOUT_S, start_triton
from tools.triton_server import TritonServer, write_model_repository


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    work = tmp_path_factory.mktemp("lifecycle")
    repository = write_model_repository(work / "repository", {
        "model": tiny_llama, "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_model_len": 256,
        "max_num_seqs": 8})
    shutil.rmtree(repository / "embeddings", ignore_errors=True)
    server = start_triton(work)
    try:
        yield server
    finally:
        assert server.stop() == 0, "tritonserver did not exit cleanly"
        assert_no_crash(server)


def assert_no_crash(server: TritonServer) -> None:
    log = Path(server.log_file).read_text(encoding="utf-8", errors="replace")
    for sign in ("malloc", "corrupted", "Signal (11)", "Signal (6)", "double free", "Segmentation"):
        assert sign not in log, f"{sign!r} in tritonserver's log"


def inputs(prompt: str, max_tokens: int, stream: bool = True) -> list:
    tensors = []
    for name, array, datatype in (
            ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            ("sampling_parameters", np.array([json.dumps({"max_tokens": max_tokens, "ignore_eos": True,
                                                          "temperature": 0}).encode()], dtype=np.object_), "BYTES"),
            ("stream", np.array([stream]), "BOOL")):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def generate(server: TritonServer, max_tokens: int = 4) -> tuple[list, str | None]:
    """One streamed request to its final response: (responses, error message or None)."""
    done, responses, errors = threading.Event(), [], []

    def on_response(result, error):
        if done.is_set():  # e.g. "Locally cancelled" when the stream closes
            return
        if error is not None:
            errors.append(error.message())
            done.set()
            return
        responses.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=on_response)
        client.async_stream_infer("llm", inputs("Hello, my name is", max_tokens),
                                  enable_empty_final_response=True)
        assert done.wait(TIMEOUT_S), "no final response"
    finally:
        # Not cancel_requests=True after the final response: Triton 2.51 then loses track of the
        # stream and can never release the model it refers to (docs/triton.md).
        client.stop_stream(cancel_requests=not done.is_set())
        client.close()
    return responses, (errors[0] if errors else None)


class StreamingLoad:
    """Four clients streaming 40-token requests back to back until stopped. Errors are expected
    while the model is away; every request must still end (final response or error)."""

    def __init__(self, server: TritonServer, clients: int = 4) -> None:
        self.server, self.stop, self.completed, self.failed = server, threading.Event(), 0, 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                _, error = generate(self.server, max_tokens=40)
            except Exception:  # the server refused the stream while the model was away
                error = "refused"
            if error is None:
                self.completed += 1
            else:
                self.failed += 1
                time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(TIMEOUT_S)
            assert not thread.is_alive(), "a streaming client hung"


def answers(server: TritonServer) -> None:
    assert server.process.poll() is None, "tritonserver died"
    responses, error = generate(server)
    assert error is None, error
    assert sum(len(r.as_numpy("text_output")) for r in responses if r.as_numpy("text_output") is not None) > 0


def scrape(server: TritonServer) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    values: dict[str, float] = {}  # summed over labels (request_success_total's finished_reason)
    for line in lines:
        if line.startswith("vllm:") and 'model="llm"' in line and "_bucket" not in line:
            name = line.split("{")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def test_a_load_of_the_unchanged_model_is_a_no_op(server):
    """The first explicit load after start used to reload the whole LLM (its __pycache__ made the
    version folder look changed)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    log = Path(server.log_file)
    loads_before = log.read_text(encoding="utf-8", errors="replace").count("loading: llm:1")
    started = time.monotonic()
    client.load_model("llm")
    took = time.monotonic() - started
    assert log.read_text(encoding="utf-8", errors="replace").count("loading: llm:1") == loads_before, "the model was reloaded"
    assert took < 5, f"a no-op load took {took:.1f} s"
    client.close()


def test_a_scrape_right_after_the_final_response_counts_the_request(server):
    for _ in range(3):
        before = scrape(server)
        responses, error = generate(server, max_tokens=5)
        after = scrape(server)  # at once: no wait for a poll
        assert error is None, error
        assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1
        assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 5


def test_ten_unloads_and_reloads_idle_and_under_streaming_load(server):
    """Unload then load (idle, then with streams in flight, when the unload waits for them while
    the load starts a new instance), and reloads of a loaded model with a changed config (Triton
    starts the new instance before it finalizes the old one). Before the fix, the old instance's
    metrics freed Prometheus series that the new one still wrote to: heap corruption."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for round_number in range(10):
        under_load = round_number % 2 == 1
        load = StreamingLoad(server) if under_load else None
        try:
            if under_load:
                time.sleep(1.0)  # streams in flight
            if round_number % 4 in (2, 3):  # a reload: the new instance starts before the old one goes
                model_config = client.get_model_config("llm", as_json=True)["config"]
                # A changed config, else Triton keeps the running instance.
                model_config["parameters"]["lifecycle_round"] = {"string_value": str(round_number)}
                client.load_model("llm", config=json.dumps(model_config))
            else:
                client.unload_model("llm")
                client.load_model("llm")
            assert client.is_model_ready("llm")
        finally:
            if load is not None:
                load.close()
        # Once the old instance is finalized (its stub gone), the new one's metrics still export:
        # before the fix the old one's deletion took the series the new one wrote to.
        wait_for(lambda: len(server.stub_pids()) == 1, TIMEOUT_S, "the old instance's stub to exit")
        before = scrape(server).get("vllm:request_success_total", 0.0)
        answers(server)
        after = scrape(server).get("vllm:request_success_total")
        assert after == before + 1, f"round {round_number}: request_success_total {before} -> {after}"
        assert_no_crash(server)
    client.close()
