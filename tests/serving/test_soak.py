"""A soak with faults: mixed traffic (completions, streamed chats, n > 1, grammars, a LoRA adapter,
streams the client cancels, bad input) through the frontend, in its own process, over two Triton
replicas with a tiny random model (the serving stack is under test, not the weights), while the
frontend is paused and resumed, a replica is killed and restarted, and the other replica's llm stub
is killed (and that replica restarted, as `tritonllm serve`'s supervisor would). No request
outlives its timeout, no 5xx but 503s during a fault, every KV block free at the end, the
frontend's memory flat.

The length is TRITONLLM_SOAK_SECONDS (default SOAK_SECONDS, short enough for CI); the faults fall
at fixed fractions of it. Figures go to stdout (`pytest -s`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.utils import wait_for
from tests.utils.frontend import FrontendProcess, HostPauses
from tests.utils.triton import metrics, shm_regions, start_triton
from tools.triton_server import TritonServer, write_model_repository

SOAK_SECONDS = float(os.environ.get("TRITONLLM_SOAK_SECONDS", 150))
MAX_MODEL_LEN = 512
ADAPTER = "soak-lora"
WORKERS = 8
REQUEST_TIMEOUT_S = 30.0  # the frontend's --request-timeout
PAUSE_S = 5.0  # the frontend stopped (SIGSTOP) this long
# A request may take its timeout plus the pause it may have sat through, and some room for a
# loaded machine; past that it hung.
HANG_S = REQUEST_TIMEOUT_S + PAUSE_S + 10
# A 503 counts as the fault's when its request overlaps the fault or the seconds after it that the
# frontend needs to notice recovery (the health check's interval, the probe's deadline, the stall
# allowance), with room.
RECOVERY_GRACE_S = 15.0
RSS_GROWTH_BOUND = 64 << 20
# The kinds of request and how often each comes (weights).
KINDS = {"completion": 3, "chat stream": 3, "n>1": 2, "grammar": 2, "lora": 2, "cancelled stream": 2, "bad input": 1}


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    """A random LoRA adapter (peft's format) over the tiny model: B is not zero, so it matters."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("soak_adapter")
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(str(folder))
    return str(folder)


@dataclass
class Outcome:
    kind: str
    started: float
    ended: float
    status: int | str  # the HTTP status, an error event's (503 for service_unavailable), or what went wrong


@dataclass
class Fault:
    name: str
    started: float
    ended: float = float("inf")


class Soak:
    """The traffic, the faults and what came of them."""

    def __init__(self, model: str, seed: int = 0) -> None:
        self.model, self.rng = model, random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.faults: list[Fault] = []
        self.host_pauses: list[Fault] = []  # a shared host's pauses of every process (HostPauses)
        self.errors: list[dict] = []  # the error events of streams
        self.started = 0.0  # when the measured traffic began (after a warm-up request of each kind)
        self.kinds = {"completion": self.completion, "chat stream": self.chat_stream, "n>1": self.n_samples,
                      "grammar": self.grammar, "lora": self.lora, "cancelled stream": self.cancelled_stream,
                      "bad input": self.bad_input}

    def during_fault(self, outcome: Outcome) -> bool:
        return any(outcome.started <= fault.ended + RECOVERY_GRACE_S and outcome.ended >= fault.started
                   for fault in self.faults + self.host_pauses)

    def latency(self, outcome: Outcome) -> float:
        """The request's seconds, less those the host had every process stopped."""
        paused = sum(min(outcome.ended, pause.ended) - max(outcome.started, pause.started)
                     for pause in self.host_pauses if pause.started < outcome.ended and pause.ended > outcome.started)
        return outcome.ended - outcome.started - paused

    # -- the requests ------------------------------------------------------------------------------
    async def request(self, http: httpx.AsyncClient, kind: str) -> Outcome:
        started = time.monotonic()
        try:
            status = await self.kinds[kind](http)
        except httpx.TimeoutException:
            status = "client timeout"
        except httpx.TransportError as error:
            status = f"transport error: {type(error).__name__}"
        outcome = Outcome(kind, started, time.monotonic(), status)
        self.outcomes.append(outcome)
        return outcome

    def prompt(self) -> str:
        return f"Soak {self.rng.random():.6f}: tell me a story."

    async def post(self, http: httpx.AsyncClient, path: str, body: dict) -> int:
        response = await http.post(path, json=body)
        if response.status_code == 200 and "error" in response.json():
            return 500
        return response.status_code

    async def stream(self, http: httpx.AsyncClient, path: str, body: dict, cut_after: int | None = None) -> int:
        """A streamed request read to [DONE] (or cut after `cut_after` events): its status, or its
        error event's (503 for service_unavailable, 504 for request_timeout, 500 else)."""
        events = 0
        async with http.stream("POST", path, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                return response.status_code
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return 200
                if line.startswith("data: "):
                    error = json.loads(line[6:]).get("error")
                    if error is not None:
                        self.errors.append(error)
                        return (503 if error["type"] == "service_unavailable" else 504
                                if error["code"] == "request_timeout" else 400 if error["type"] == "invalid_request_error"
                                else 500)
                    events += 1
                    if events == cut_after:
                        return 200  # the client left: the frontend cancels the rest
        return 599 if cut_after is None else 200  # no [DONE] nor error: cut off

    async def completion(self, http):
        return await self.post(http, "/v1/completions", {"model": self.model, "prompt": self.prompt(), "max_tokens": 16})

    async def chat_stream(self, http):
        return await self.stream(http, "/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": self.prompt()}],
            "max_tokens": self.rng.randint(8, 48), "ignore_eos": True})

    async def n_samples(self, http):
        if self.rng.random() < 0.5:
            return await self.post(http, "/v1/completions", {"model": self.model, "prompt": self.prompt(),
                                                             "max_tokens": 12, "n": 3, "temperature": 1.0})
        return await self.stream(http, "/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": self.prompt()}], "max_tokens": 12,
            "n": 2, "temperature": 1.0})

    async def grammar(self, http):
        if self.rng.random() < 0.5:
            constraint = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}}}}
        else:
            constraint = {"structured_outputs": {"regex": "(red|green|blue) [0-9]{1,3}"}}
        return await self.post(http, "/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": self.prompt()}], "max_tokens": 24,
            **constraint})

    async def lora(self, http):
        return await self.stream(http, "/v1/completions", {"model": ADAPTER, "prompt": self.prompt(),
                                                           "max_tokens": 16})

    async def cancelled_stream(self, http):
        body = {"model": self.model, "messages": [{"role": "user", "content": self.prompt()}], "max_tokens": 64,
                "ignore_eos": True}
        cut_after = self.rng.randint(0, 4)
        if cut_after:
            return await self.stream(http, "/v1/chat/completions", body, cut_after)
        task = asyncio.ensure_future(self.stream(http, "/v1/chat/completions", body))
        await asyncio.sleep(self.rng.uniform(0, 0.2))  # gone before the first token, or while queued
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return 200

    async def bad_input(self, http):
        """One of four mistakes; the status is 200 when the frontend answered as it should."""
        choice = self.rng.randrange(4)
        if choice == 0:
            response = await http.post("/v1/completions", json={"model": self.model, "prompt": "x", "max_tokens": -1})
            expected = 400
        elif choice == 1:
            response = await http.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"})
            expected = 404
        elif choice == 2:
            response = await http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                                       headers={"content-type": "application/json"})
            expected = 400
        else:
            response = await http.post("/v1/chat/completions", json={"model": self.model, "messages": "hello"})
            expected = 400
        return 200 if response.status_code == expected else response.status_code

    async def worker(self, http: httpx.AsyncClient, deadline: float) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())  # the same order as self.kinds
        while time.monotonic() < deadline:
            await self.request(http, self.rng.choices(kinds, weights)[0])


def kill_replica(server: TritonServer, regions: list[Path]) -> None:
    """SIGKILL, as a crash: no graceful stop; its model's shared memory (`regions`) is left behind."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    for region in regions:
        region.unlink(missing_ok=True)


def restart_replica(server: TritonServer) -> None:
    server.start()  # the same ports
    server.wait_ready(600)


def engine_idle(server: TritonServer) -> tuple[float, float, float] | None:
    """(running, waiting, KV-cache usage) of the replica's llm model; None if its metrics port did
    not answer (a replica restarted from a worker thread used to die when the thread ended:
    tools.triton_server.popen_with_parent)."""
    try:
        values = metrics(server)
    except OSError:
        return None
    return (values["vllm:num_requests_running"], values["vllm:num_requests_waiting"],
            values["vllm:kv_cache_usage_perc"])


@pytest.mark.slow
def test_soak_with_faults(tmp_path, tiny_llama, adapter):
    engine = {"model": tiny_llama, "dtype": "float32", "kv_cache_memory_bytes": 32 << 20,
              "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 16, "enable_lora": True,
              "lora_modules": {ADAPTER: adapter}}
    replicas = []
    for name in ("a", "b"):
        write_model_repository(tmp_path / name / "repository", engine)
        replicas.append(start_triton(tmp_path / name, ("llm",)))
    first, second = replicas
    model = Path(tiny_llama).name
    try:
        with FrontendProcess([r.grpc_url for r in replicas], tiny_llama, tmp_path / "frontend.log",
                             f"--max-model-len={MAX_MODEL_LEN}", f"--request-timeout={REQUEST_TIMEOUT_S}",
                             f"--lora-modules={ADAPTER}={adapter}") as frontend:
            wait_for(lambda: httpx.get(f"{frontend.url}/health").status_code == 200, 60, "/health to turn 200")
            soak = Soak(model)
            rss: list[tuple[float, int]] = []

            async def faults() -> None:
                async def at(fraction: float) -> None:
                    await asyncio.sleep(max(0.0, soak.started + fraction * SOAK_SECONDS - time.monotonic()))

                await at(0.15)
                fault = Fault("frontend paused", time.monotonic())
                soak.faults.append(fault)
                frontend.pause()
                await asyncio.sleep(PAUSE_S)
                frontend.resume()
                fault.ended = time.monotonic()

                await at(0.35)
                fault = Fault("replica killed and restarted", time.monotonic())
                soak.faults.append(fault)
                await asyncio.to_thread(kill_replica, second, shm_regions(second))
                await asyncio.sleep(2)
                await asyncio.to_thread(restart_replica, second)
                fault.ended = time.monotonic()

                await at(0.6)
                fault = Fault("llm stub killed, its replica restarted", time.monotonic())
                soak.faults.append(fault)
                [stub], regions = first.stub_pids("llm"), shm_regions(first)
                os.kill(stub, signal.SIGKILL)
                await asyncio.sleep(8)  # the frontend finds it broken and routes around it
                await asyncio.to_thread(kill_replica, first, regions)  # a supervisor's restart: it cannot unload
                await asyncio.to_thread(restart_replica, first)
                fault.ended = time.monotonic()

            async def sample_rss(deadline: float) -> None:
                while time.monotonic() < deadline:
                    if frontend.process.poll() is None:
                        rss.append((time.monotonic(), frontend.rss_bytes()))
                    await asyncio.sleep(5)

            async def run() -> None:
                limits = httpx.Limits(max_connections=WORKERS * 2)
                async with httpx.AsyncClient(base_url=frontend.url, timeout=HANG_S + 5, limits=limits) as http:
                    for kind in KINDS:  # warm: the first grammar compiles, the adapter loads
                        await soak.request(http, kind)
                    soak.outcomes.clear()
                    rss.append((time.monotonic(), frontend.rss_bytes()))
                    soak.started = time.monotonic()
                    deadline = soak.started + SOAK_SECONDS
                    await asyncio.gather(faults(), sample_rss(deadline),
                                         *(soak.worker(http, deadline) for _ in range(WORKERS)))

            with HostPauses() as pauses:
                asyncio.run(run())
            soak.host_pauses = [Fault("the host paused every process", *pause) for pause in pauses.pauses]
            elapsed = time.monotonic() - soak.started
            deadline = time.monotonic() + 30  # both replicas idle, every KV block free (asserted below)
            while True:
                final = {replica.grpc_url: engine_idle(replica) for replica in replicas}
                if all(value == (0, 0, 0) for value in final.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            rss.append((time.monotonic(), frontend.rss_bytes()))
            healthy = httpx.get(f"{frontend.url}/health").status_code
    finally:
        for replica in replicas:
            if replica.process is not None and replica.process.poll() is None:
                replica.stop(30)

    outcomes = soak.outcomes
    by_kind = Counter(o.kind for o in outcomes)
    by_status = Counter(str(o.status) for o in outcomes)
    unavailable = [o for o in outcomes if o.status == 503]
    outside = [o for o in unavailable if not soak.during_fault(o)]
    wrong = [o for o in outcomes if o.status not in (200, 503)]
    max_latency = max(map(soak.latency, outcomes))
    baseline_rss = rss[0][1]
    quarter = next(value for at, value in rss if at - rss[0][0] >= SOAK_SECONDS / 4)
    print(f"\nsoak: {len(outcomes)} requests over {elapsed:.0f} s ({WORKERS} clients), by kind {dict(by_kind)}; "
          f"by outcome {dict(by_status)} (200: answered as expected, a bad input's 4xx included); "
          f"503s: {len(unavailable)}, {len(outside)} outside a fault; "
          f"max latency {max_latency:.1f} s (hang bound {HANG_S:.0f} s: timeout {REQUEST_TIMEOUT_S:.0f} s "
          f"+ pause {PAUSE_S:.0f} s + 10)")
    print("faults: " + "; ".join(f"{f.name} at {f.started - soak.started:.0f} s for {f.ended - f.started:.1f} s"
                                 for f in soak.faults)
          + (f"; and the host paused everything {len(soak.host_pauses)} times, "
             f"{sum(f.ended - f.started for f in soak.host_pauses):.0f} s in all" if soak.host_pauses else ""))
    print(f"end: (running, waiting, KV usage) per replica {final}; frontend RSS {baseline_rss / 2**20:.0f} MiB "
          f"after warm-up, {quarter / 2**20:.0f} at a quarter, {rss[-1][1] / 2**20:.0f} at the end "
          f"(peak {max(v for _, v in rss) / 2**20:.0f}); /health {healthy}")
    assert all(value == (0, 0, 0) for value in final.values()), final
    assert len(soak.faults) == 3 and all(f.ended < float("inf") for f in soak.faults)
    assert not wrong, (Counter((o.kind, o.status) for o in wrong), soak.errors[-5:])
    assert not outside, [(o.kind, round(o.started - soak.started), round(o.ended - soak.started)) for o in outside]
    assert max_latency < HANG_S
    assert all(Counter(o.kind for o in outcomes if o.status == 200)[kind] > 0 for kind in KINDS)
    assert healthy == 200
    assert rss[-1][1] - baseline_rss < RSS_GROWTH_BOUND
