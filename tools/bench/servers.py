"""The servers a served mode runs against, each in a process group of its own: `tritonllm serve`
(Triton and the OpenAI frontend) and `vllm serve` from the vLLM venv."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from tools.bench.workloads import resolved_model


def wait_http(url: str, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever of it is left (a child that
    outlived its leader: vLLM's engine process, a Python stub, the frontend started beside Triton)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_tritonllm(args) -> tuple[subprocess.Popen, dict]:
    from tools.triton_server import free_port

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    command = [sys.executable, "-m", "tools.cli", "serve", "--http-port", str(ports["http"]),
               "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
               "--port", str(ports["openai"]), "--dtype", args.dtype]
    if args.model:
        command += ["--model", args.model]
    for name, value in json.loads(args.engine_args).items():
        command += ["--" + name.replace("_", "-"), str(value)]
    if args.stream_interval != 1:
        command += ["--stream-interval", str(args.stream_interval)]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{ports['openai']}/health", 900, process)
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['openai']}/v1/models") as response:
        model = json.loads(response.read())["data"][0]["id"]
    return process, {"grpc": f"127.0.0.1:{ports['grpc']}", "openai": f"http://127.0.0.1:{ports['openai']}",
                     "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics", "model": model}


def vllm_environment(args) -> dict:
    """The environment of every vLLM process: its KV space, and with `--vllm-cores all` every core bound."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_cores == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    return env


def start_vllm_serve(args) -> tuple[subprocess.Popen, dict]:
    from tools.triton_server import free_port

    port = free_port()
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", resolved_model(args),
               "--dtype", args.dtype, "--port", str(port), "--seed", "0"]
    if args.stream_interval != 1:
        command += ["--stream-interval", str(args.stream_interval)]
    process = subprocess.Popen(command, start_new_session=True, env=vllm_environment(args),
                               stdout=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health", 900, process)
    return process, {"openai": f"http://127.0.0.1:{port}", "metrics": f"http://127.0.0.1:{port}/metrics",
                     "model": resolved_model(args)}
