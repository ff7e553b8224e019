"""The OpenAI frontend for the tests: `Serve` is `tritonllm serve` as users run it (tritonserver
with the llm and embeddings models, and the frontend, in a subprocess), `ServedApp` the frontend
alone in this process, on uvicorn as `python -m openai_frontend` runs it; and their clients' helpers."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import psutil
import uvicorn

from openai_frontend import Settings, build_app
from openai_frontend.main import server_config
from tests.utils import ROOT
from tools.serve import ADMIN_KEY_FILE, ADMIN_KEY_HEADER, API_KEY_ENV
from tools.triton_server import free_port

MAX_MODEL_LEN = 2048
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
EMBEDDINGS = "all-MiniLM-L6-v2"
BANNER_END = "Ctrl-C stops everything"  # serve prints it once every server answers


class Serve:
    """`python -m tools.cli serve` in `work` on free ports, with `flags` added, once it is up (its
    banner printed: Triton ready and, unless --no-frontend, the frontend's /health answering). The
    API key goes through the environment, as users are told to pass it, never the command line.
    Stopped by `stop()` or on leaving a `with` block, with SIGTERM (serve takes Ctrl-C's road)."""

    def __init__(self, model: str, work: Path, *flags: str, kv_cache_bytes: int = 256 << 20,
                 max_model_len: int = MAX_MODEL_LEN, api_key: str | None = API_KEY, env: dict | None = None,
                 start_timeout: float = 600, stop_timeout: float = 90) -> None:
        from tools.prepare_embeddings import prepare_embeddings
        prepare_embeddings()  # fetched here, not by the Triton model while it loads
        self.work, self.stop_timeout = Path(work), stop_timeout
        self.work.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in ("port", "http-port", "grpc-port", "metrics-port")}
        command = [sys.executable, "-m", "tools.cli", "serve", "--model", model, "--dtype", "float32",
                   "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-model-len", str(max_model_len),
                   "--workdir", str(self.work), *flags]
        command += [f"--{name}={port}" for name, port in self.ports.items()]
        self.url = f"http://127.0.0.1:{self.ports['port']}"  # the OpenAI frontend
        self.grpc_url = f"127.0.0.1:{self.ports['grpc-port']}"  # Triton's
        self.metrics_url = f"http://127.0.0.1:{self.ports['metrics-port']}/metrics"  # the engine's, from Triton
        self.output = open(self.work / "serve.log", "wb")
        env = {name: value for name, value in (env or os.environ).items() if name != API_KEY_ENV}
        if api_key is not None:  # None: the frontend asks for no key
            env[API_KEY_ENV] = api_key
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while BANNER_END not in self.log():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"tritonllm serve did not come up:\n{self.log()[-3000:]}")
            time.sleep(0.5)

    def __enter__(self) -> "Serve":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return (self.work / "serve.log").read_text(errors="replace")

    @property
    def admin_key(self) -> str:
        return (self.work / ADMIN_KEY_FILE).read_text().strip()

    def triton(self, path: str, body: dict | None = None, admin: bool = False) -> tuple[int, str]:
        """A request to Triton's HTTP port: (status, body). A connection reset before any answer is
        tried again, twice: CI saw one once on a loaded host (2,000 requests here never did), and a
        server that is down fails all three."""
        headers = {ADMIN_KEY_HEADER: self.admin_key} if admin else {}
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports['http-port']}{path}", data, headers,
                                         method="POST" if data is not None or "repository" in path else "GET")
        for attempt in range(3):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as error:
                return error.code, error.read().decode()
            except (ConnectionResetError, http.client.RemoteDisconnected):
                if attempt == 2:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.output.close()


class ServedApp:
    """The frontend app on a uvicorn server in a thread, with `python -m openai_frontend`'s settings
    (server_config: the address, the request-reading deadlines) on a free port."""

    def __init__(self, settings: Settings) -> None:
        settings = Settings(**{**settings.__dict__, "port": free_port()})
        self.app = build_app(settings)
        self.server = uvicorn.Server(server_config(self.app, settings, "warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port, self.url = settings.port, f"http://127.0.0.1:{settings.port}"

    def __enter__(self) -> "ServedApp":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def engine_load(serve: Serve) -> tuple[float, float]:
    """(requests running, KV-cache usage) as the llm model exports them on Triton's metrics port."""
    text = urllib.request.urlopen(serve.metrics_url, timeout=5).read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("vllm:num_requests_running{", "vllm:kv_cache_usage_perc{"))}
    return values["vllm:num_requests_running"], values["vllm:kv_cache_usage_perc"]


def wait_engine_idle(serve: Serve, timeout: float = 15.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while (load := engine_load(serve)) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    return load


def frontend_metrics(url: str) -> dict[tuple[str, str], float]:
    """(metric, replica) -> value for the frontend's per-replica metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.match(r'(tritonllm_frontend_replica_\w+)\{replica="([^"]+)"\} (\S+)', line)
        if match:
            values[match.group(1), match.group(2)] = float(match.group(3))
    return values


# Tools for chat requests (the tool-call and Responses tests).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now, in UTC."}}
TOOLS = [WEATHER, TIME]
