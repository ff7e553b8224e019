"""The OpenAI frontend in its own process, as `python -m openai_frontend` runs it, for the tests
that watch it from outside: its memory (RSS from /proc), or the process paused and resumed.
(`serve.ServedApp` runs it in the test's own process instead.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.utils import ROOT, wait_for
from tools.serve import API_KEY_ENV
from tools.triton_server import free_port


class FrontendProcess:
    """`python -m openai_frontend` on a free port in front of `triton_urls`, with `flags` added,
    once /health/live answers (whether some Triton is ready is /health's business). The API key,
    if any, goes through the environment. Its output goes to `log`."""

    def __init__(self, triton_urls: list[str], model: str, log: Path, *flags: str, api_key: str | None = None,
                 start_timeout: float = 120) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "openai_frontend", "--port", str(self.port), "--model", model,
                   *(f"--triton-url={url}" for url in triton_urls), *flags]
        env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
        if api_key is not None:
            env[API_KEY_ENV] = api_key
        self.log_path = log
        self.output = open(log, "wb")
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.output, stderr=subprocess.STDOUT)
        try:
            wait_for(self.live, start_timeout, f"the frontend to start (log: {log})")
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "FrontendProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def live(self) -> bool:
        assert self.process.poll() is None, f"the frontend exited:\n{self.log()[-3000:]}"
        try:
            return httpx.get(f"{self.url}/health/live", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 30) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.output.close()


class HostPauses:
    """Notices this process being stopped, as a shared host stops its neighbours while it times a
    benchmark (SIGSTOP to every process at nice 19: the servers too, not all at one instant): a
    thread that wakes every 0.1 s records each longer gap as (start, end) on time.monotonic()'s
    clock. Wall-clock timings across a pause say nothing about the code; the tests set them aside."""

    def __init__(self, gap_s: float = 1.0) -> None:
        self.gap_s = gap_s
        self.pauses: list[tuple[float, float]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def __enter__(self) -> "HostPauses":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()

    def watch(self) -> None:
        last = time.monotonic()
        while not self.stopping.wait(0.1):
            now = time.monotonic()
            if now - last > self.gap_s:
                self.pauses.append((last, now))
            last = now

    def within(self, start: float, end: float) -> list[tuple[float, float]]:
        """The pauses that overlap [start, end]."""
        return [(a, b) for a, b in self.pauses if a <= end and b >= start]
