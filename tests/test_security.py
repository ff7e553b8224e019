"""`tritonllm serve` as an attacker and an operator meet it (issue 26): Triton's model control is
closed (no unload, no load with a `file:` override), its repository, logging and trace APIs need
the admin key, the API key sits on no command line, a dead llm stub makes serve exit non-zero,
and `kill -9` of serve leaves no process and no listening port behind.

Each test runs the real `serve` (tritonserver, both stubs, the frontend) on a tiny random Llama.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.test_triton_lifecycle import tiny_model
from tools.serve import ADMIN_KEY_FILE, ADMIN_KEY_HEADER, API_KEY_ENV
from tools.triton_server import SHM_REGION_PREFIX, free_port, remove_stale_shm_regions

API_KEY = "sk-security-test-0123456789"
ROOT = Path(__file__).resolve().parent.parent


class Serve:
    """One `python -m tools.serve` in a workdir, with its ports."""

    def __init__(self, work: Path, model: str, *flags: str) -> None:
        self.work = work
        work.mkdir(parents=True)
        self.ports = {name: free_port() for name in ("port", "http-port", "grpc-port", "metrics-port")}
        command = [sys.executable, "-m", "tools.serve", "--model", model, "--dtype", "float32",
                   "--kv-cache-memory-bytes", str(8 << 20), "--max-model-len", "256", "--max-num-seqs", "4",
                   "--workdir", str(work), *flags]
        for name, port in self.ports.items():
            command += [f"--{name}", str(port)]
        env = {**os.environ, API_KEY_ENV: API_KEY}
        self.output = open(work / "serve.out", "wb")
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not self.log().count("Ctrl-C stops everything"):
            assert self.process.poll() is None, f"serve exited early:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(1)

    def log(self) -> str:
        return (self.work / "serve.out").read_text(errors="replace")

    @property
    def admin_key(self) -> str:
        return (self.work / ADMIN_KEY_FILE).read_text().strip()

    def triton(self, path: str, body: dict | None = None, admin: bool = False) -> tuple[int, str]:
        """A request to Triton's HTTP port: (status, body)."""
        headers = {ADMIN_KEY_HEADER: self.admin_key} if admin else {}
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports['http-port']}{path}", data, headers,
                                         method="POST" if data is not None or "repository" in path else "GET")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.output.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    return tiny_model(tmp_path_factory.mktemp("tiny"), model_path)


@pytest.fixture
def serve(tmp_path, tiny):
    """Starts `serve` with the given flags (one per test), stopped at the end of the test."""
    started = []

    def start(*flags: str) -> Serve:
        started.append(Serve(tmp_path / f"serve{len(started)}", tiny, *flags))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_model_control_is_closed_and_a_dead_stub_stops_serve(serve):
    serve = serve()
    # Without the admin key: Triton's repository API is refused before it looks at the request.
    malicious = {"parameters": {"config": json.dumps({"backend": "python"}),
                                "file:1/model.py": "aW1wb3J0IG9zOyBvcy5zeXN0ZW0oJ3RvdWNoIC90bXAvcHduZWQnKQ=="}}
    for path, body in (("/v2/repository/models/llm/unload", None),
                       ("/v2/repository/models/evil/load", malicious),
                       ("/v2/repository/index", None)):
        status, text = serve.triton(path, body)
        assert status == 403 and ADMIN_KEY_HEADER in text, (path, status, text)
    # With it: model control is off, so no model can be unloaded or loaded all the same.
    for path, body in (("/v2/repository/models/llm/unload", None),
                       ("/v2/repository/models/evil/load", malicious)):
        status, text = serve.triton(path, body, admin=True)
        assert status >= 400 and "not allowed" in text, (path, status, text)
    assert serve.triton("/v2/repository/index", admin=True)[0] == 200
    assert serve.triton("/v2/models/llm/ready")[0] == 200
    assert not (serve.work / "model_repository" / "evil").exists()

    # The key is on no command line (`ps` shows those to every user); Triton listens on loopback.
    for process in [psutil.Process(serve.process.pid), *serve.descendants()]:
        assert API_KEY not in " ".join(process.cmdline()), process.cmdline()
    triton = next(p for p in serve.descendants() if p.name() == "tritonserver")
    addresses = {ipaddress.ip_address(c.laddr.ip) for c in triton.net_connections("tcp") if c.status == "LISTEN"}
    assert addresses and all((getattr(a, "ipv4_mapped", None) or a).is_loopback for a in addresses), addresses

    # The llm stub dies: serve notices, kills the rest and exits non-zero for its supervisor.
    [stub] = [p for p in serve.descendants() if "triton_python_backend_stub" in " ".join(p.cmdline()[:1])
              and "/llm/" in " ".join(p.cmdline())]
    others = serve.descendants()
    stub.kill()
    assert serve.process.wait(60) == 1
    assert "stub died" in serve.log()
    gone, alive = psutil.wait_procs(others, timeout=10)
    assert not alive, alive


def test_explicit_control_needs_the_admin_key_and_kill_9_of_serve_leaves_nothing(serve):
    serve = serve("--model-control", "explicit")
    status, text = serve.triton("/v2/repository/index")
    assert status == 403, (status, text)
    assert serve.triton("/v2/repository/index", admin=True)[0] == 200
    status, text = serve.triton("/v2/logging", {"log_verbose_level": 1})
    assert status == 403, (status, text)

    processes = serve.descendants()
    assert len(processes) >= 4, processes  # tritonserver, two stubs, the frontend
    serve.process.kill()
    serve.process.wait()
    gone, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not [port for port in serve.ports.values() if listening(port)]


def test_stale_shm_regions_are_removed_but_not_live_ones(tmp_path):
    stale = tmp_path / f"{SHM_REGION_PREFIX}stale"
    live = tmp_path / f"{SHM_REGION_PREFIX}live"
    other = tmp_path / "not-ours"
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 16)
    with open(live, "rb"):  # held by a live process: this one
        assert remove_stale_shm_regions(tmp_path) == [stale]
    assert live.exists() and other.exists() and not stale.exists()
