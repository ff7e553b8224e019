"""tritonserver for the tests and Triton's clients on it: `start_triton` starts one on free ports
(`llm_server` writes the repository and stops it too), `Stream` is one gRPC bidirectional stream,
`make_inputs` the vLLM backend's tensors; the model's Python stub processes and its metrics."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tools.triton_server import TritonServer, free_port, write_model_repository

TIMEOUT_S = 120


def start_triton(work: Path, models: tuple[str, ...] = ("llm",), exit_timeout_s: int = 10) -> TritonServer:
    """tritonserver on `work/repository` (written already), on free ports, with only `models`
    loaded (explicit model control), once they are ready."""
    ports = {name: free_port() for name in ("http_port", "grpc_port", "metrics_port")}
    server = TritonServer(work / "repository", work, log_file=work / "triton.log", **ports,
                          extra_args=[f"--exit-timeout-secs={exit_timeout_s}", "--model-control-mode=explicit",
                                      *(f"--load-model={model}" for model in models)])
    server.start()
    server.wait_ready(300)
    return server


@contextlib.contextmanager
def llm_server(work: Path, engine_args: dict, clean_exit: bool = True, exit_timeout_s: int = 5) -> Iterator[TritonServer]:
    """A tritonserver serving only `llm` with these engine arguments, stopped on leaving (and
    required to exit cleanly unless clean_exit is False)."""
    write_model_repository(work / "repository", engine_args)
    server = start_triton(work, exit_timeout_s=exit_timeout_s)
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0 or not clean_exit, "tritonserver did not exit cleanly"


def make_inputs(prompt: str | list[int] | None, params: dict | str | None = None, **flags) -> list:
    """The vLLM backend's tensors: text_input (or input_ids), sampling_parameters, BOOL flags."""
    inputs = []

    def add(name, array, datatype):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)

    if isinstance(prompt, str):
        add("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")
    elif prompt is not None:
        add("input_ids", np.array(prompt, dtype=np.int32), "INT32")
    if params is not None:
        text = params if isinstance(params, str) else json.dumps(params)
        add("sampling_parameters", np.array([text.encode()], dtype=np.object_), "BYTES")
    for name, value in flags.items():
        add(name, np.array([value]), "BOOL")
    return inputs


class Stream:
    """One gRPC bidirectional stream; responses collected per request id, final flags counted."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def send(self, inputs: list, request_id: str = "", model: str = "llm") -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id,
                                       enable_empty_final_response=True)

    def next(self):
        return self.events.get(timeout=TIMEOUT_S)

    def collect(self, request_id: str = "") -> list:
        """Responses of one request up to and including its final one; errors raise."""
        responses = []
        while True:
            result, error = self.next()
            if error is not None:
                raise error
            assert result.get_response().id == request_id
            responses.append(result)
            if is_final(result):
                return responses

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def texts(result) -> list[str]:
    array = result.as_numpy("text_output")
    return [] if array is None else [t.decode() for t in array]


def generate(server: TritonServer, prompt: str | list[int] | None, params: dict | str | None = None,
             **flags) -> list:
    """One request's responses over its own stream."""
    stream = Stream(server.grpc_url)
    try:
        stream.send(make_inputs(prompt, params, **flags))
        return stream.collect()
    finally:
        stream.close()


def stub_processes(server: TritonServer) -> list[int]:
    """The pids of this server's Python-backend stubs (one per loaded model instance)."""
    out = subprocess.run(["ps", "--ppid", str(server.process.pid), "-o", "pid=,comm="],
                         capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "triton_python" in line]


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def shm_regions(server: TritonServer) -> list[Path]:
    """The Python backend's shared-memory regions of this server's models (a killed server leaves them)."""
    regions = []
    for pid in stub_processes(server):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        regions += [Path("/dev/shm") / a.decode() for a in args if a.startswith(b"triton_python_backend_shm")]
    return regions


def metrics(server: TritonServer, model: str = "llm") -> dict[str, float]:
    """The model's vllm:* series but histogram buckets, each summed over its labels."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    values: dict[str, float] = {}  # summed over labels (request_success_total's finished_reason)
    for line in lines:
        if line.startswith("vllm:") and f'model="{model}"' in line and "_bucket" not in line:
            name = line.split("{")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def settled(server: TritonServer, model: str = "llm") -> dict[str, float]:
    """Metrics once the exporter (it polls the engine every 0.5 s) has caught up."""
    previous = metrics(server, model)
    while True:
        time.sleep(0.6)
        current = metrics(server, model)
        if current == previous:
            return current
        previous = current
