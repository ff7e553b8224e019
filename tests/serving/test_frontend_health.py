"""The frontend when Triton breaks under it, and against clients that never finish: a real
tritonserver with the `llm` model and the OpenAI frontend in front of it. The model's Python stub
SIGKILLed with streams in flight (Triton keeps the model READY: only a probe tells), the embeddings
model's stub SIGKILLed (its requests and /health fail fast, naming it; the LLM serves on),
tritonserver frozen by SIGSTOP, and connections that send half a request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from openai_frontend import Settings
from tests.utils import wait_for
from tests.utils.frontend import FrontendProcess
from tests.utils.serve import EMBEDDINGS, ServedApp, frontend_metrics
from tests.utils.triton import shm_regions, start_triton, stub_processes
from tools.triton_server import TritonServer, free_port, write_model_repository

MAX_MODEL_LEN = 256
ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 16 << 20, "max_model_len": MAX_MODEL_LEN,
          "max_num_seqs": 8}
PROMPT = "The quick brown fox"
STREAMS = 8
# How long a request may outlive the death of what serves it: the health check's interval (2 s),
# the probe's deadline (5 s) and the stall allowance (5 s), with room for a loaded machine.
FAILS_WITHIN_S = 25
REQUEST_TIMEOUT_S = 3.0


@contextlib.contextmanager
def breakable_triton(work: Path, model_path: str, models: tuple[str, ...]) -> Iterator[TritonServer]:
    write_model_repository(work / "repository", {"model": model_path, **ENGINE})
    server = start_triton(work, models)
    regions = shm_regions(server)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGCONT)
        server.stop(30)  # a model with a dead stub never unloads: the exit timeout ends it
        for region in regions:
            Path(region).unlink(missing_ok=True)


@pytest.fixture
def triton(tmp_path, model_path):
    """A fresh server per test: each test breaks its own."""
    with breakable_triton(tmp_path, model_path, ("llm",)) as server:
        yield server


@pytest.fixture
def triton_with_embeddings(tmp_path, model_path):
    from tools.prepare_embeddings import prepare_embeddings
    prepare_embeddings()
    with breakable_triton(tmp_path, model_path, ("llm", "embeddings")) as server:
        yield server


def completion(model: str, **changes) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 4, **changes}


async def read_stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list:
    """The stream's events (parsed JSON, or the string "[DONE]")."""
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


def test_dead_stub_fails_every_stream_and_turns_health_503(triton, model_path):
    model = os.path.basename(model_path)
    with ServedApp(Settings(grpc_url=triton.grpc_url, model=model_path, max_model_len=MAX_MODEL_LEN)) as app:
        assert httpx.get(f"{app.url}/health/ready").status_code == 200
        assert httpx.get(f"{app.url}/health").status_code == 200

        async def run() -> tuple[list, float]:
            async with httpx.AsyncClient(base_url=app.url, timeout=120) as http:
                started = [asyncio.Event() for _ in range(STREAMS)]
                body = completion(model, max_tokens=200, ignore_eos=True, stream=True)
                streams = [asyncio.create_task(read_stream(http, body, started[i])) for i in range(STREAMS)]
                await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
                [stub] = stub_processes(triton)
                os.kill(stub, signal.SIGKILL)
                killed = time.monotonic()
                _, pending = await asyncio.wait(streams, timeout=FAILS_WITHIN_S)
                for task in pending:
                    task.cancel()
                assert not pending, f"{len(pending)} of {STREAMS} streams still open {FAILS_WITHIN_S} s after the stub died"
                return [task.result() for task in streams], time.monotonic() - killed

        outcomes, ended_after = asyncio.run(run())
        for events in outcomes:
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
            assert events[-2]["error"]["type"] == "service_unavailable", events[-2]
        print(f"\nstub SIGKILLed: all {STREAMS} streams ended with an error event within {ended_after:.1f} s; "
              f"the error: {outcomes[0][-2]['error']['message']}")

        # Health follows the model's process, not only Triton's READY (which stays true).
        wait_for(lambda: httpx.get(f"{app.url}/health").status_code == 503, 10, "/health to turn 503")
        assert httpx.get(f"{app.url}/health/ready").status_code == 503
        assert httpx.get(f"{app.url}/health/live").status_code == 200
        shown = frontend_metrics(app.url)
        assert shown["tritonllm_frontend_replica_ready", triton.grpc_url] == 0
        assert shown["tritonllm_frontend_replica_broken", triton.grpc_url] == 1
        started = time.monotonic()
        response = httpx.post(f"{app.url}/v1/completions", json=completion(model), timeout=30)
        assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
        assert time.monotonic() - started < 2.0


def test_dead_embeddings_stub_fails_its_requests_fast_and_health_names_it(triton_with_embeddings, model_path):
    triton = triton_with_embeddings
    model = os.path.basename(model_path)
    with ServedApp(Settings(grpc_url=triton.grpc_url, model=model_path, max_model_len=MAX_MODEL_LEN)) as app:
        embed = {"model": EMBEDDINGS, "input": ["one text", "another"]}
        assert httpx.post(f"{app.url}/v1/embeddings", json=embed, timeout=60).status_code == 200
        assert httpx.get(f"{app.url}/health").status_code == 200
        [stub] = triton.stub_pids("embeddings")
        os.kill(stub, signal.SIGKILL)

        # Health names the model that is down; the check finds it within its interval and probe deadline.
        down_after = wait_for(lambda: httpx.get(f"{app.url}/health").status_code == 503, FAILS_WITHIN_S,
                              "/health to turn 503")
        health = httpx.get(f"{app.url}/health").json()["error"]
        assert "`embeddings` model is down" in health["message"] and "not healthy" in health["message"], health
        assert health["code"] == "model_unavailable"
        assert httpx.get(f"{app.url}/health/ready").status_code == 503
        assert httpx.get(f"{app.url}/health/live").status_code == 200
        # Its requests fail at once with a 503 that names it, and never reach the dead stub.
        for _ in range(3):
            started = time.monotonic()
            response = httpx.post(f"{app.url}/v1/embeddings", json=embed, timeout=60)
            assert time.monotonic() - started < 1.0
            assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
            error = response.json()["error"]
            assert error["code"] == "model_unavailable" and "`embeddings` model" in error["message"], error
        # The LLM serves on, and the replica stays ready for it.
        for _ in range(3):
            response = httpx.post(f"{app.url}/v1/completions", json=completion(model), timeout=60)
            assert response.status_code == 200, response.text
        shown = frontend_metrics(app.url)
        assert shown["tritonllm_frontend_replica_ready", triton.grpc_url] == 1
        print(f"\nembeddings stub SIGKILLed: /health 503 naming it after {down_after:.1f} s; "
              f"/v1/embeddings 503 at once; completions still 200")


def test_frozen_triton_fails_new_requests_within_the_deadline(triton, model_path):
    model = os.path.basename(model_path)
    settings = Settings(grpc_url=triton.grpc_url, model=model_path, max_model_len=MAX_MODEL_LEN,
                        request_timeout=REQUEST_TIMEOUT_S)
    with ServedApp(settings) as app:
        assert httpx.get(f"{app.url}/health").status_code == 200
        os.killpg(triton.process.pid, signal.SIGSTOP)  # the server and its stub, frozen
        try:
            started = time.monotonic()
            response = httpx.post(f"{app.url}/v1/completions", json=completion(model), timeout=30)
            failed_after = time.monotonic() - started
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "request_timeout"
            assert failed_after < REQUEST_TIMEOUT_S + 2, failed_after

            events = []
            with httpx.stream("POST", f"{app.url}/v1/completions", json=completion(model, stream=True),
                              timeout=30) as streamed:
                for line in streamed.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            assert streamed.status_code in (503, 504) or (events[-1] == "[DONE]" and "error" in events[-2]), events

            # The health check's calls have deadlines too: readiness turns 503 while Triton is frozen.
            unready_after = wait_for(lambda: httpx.get(f"{app.url}/health", timeout=5).status_code == 503,
                                     FAILS_WITHIN_S, "/health to turn 503 with Triton frozen")
        finally:
            os.killpg(triton.process.pid, signal.SIGCONT)
        back_after = wait_for(lambda: httpx.get(f"{app.url}/health").status_code == 200, FAILS_WITHIN_S,
                              "/health to recover after SIGCONT")
        print(f"\nTriton frozen: a request failed after {failed_after:.1f} s (timeout {REQUEST_TIMEOUT_S} s), "
              f"/health 503 after {unready_after:.1f} s; ready again {back_after:.1f} s after SIGCONT")


# -- slow clients ---------------------------------------------------------------------------------
READ_TIMEOUT_S = 1.0
SLOW_CLIENTS = 32


def closed_within(sock: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it is still open."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


def test_half_sent_requests_are_closed_after_the_timeouts(model_path):
    nobody = f"127.0.0.1:{free_port()}"  # no Triton needed: the request never gets that far
    settings = Settings(grpc_url=nobody, model=model_path, header_timeout=READ_TIMEOUT_S,
                        body_timeout=READ_TIMEOUT_S)
    with ServedApp(settings) as app:
        body = json.dumps(completion("m", max_tokens=1)).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        half_bodies = [socket.create_connection(("127.0.0.1", app.port)) for _ in range(SLOW_CLIENTS)]
        for sock in half_bodies:
            sock.sendall(head + body[:len(body) // 2])
        half_headers = socket.create_connection(("127.0.0.1", app.port))
        half_headers.sendall(head[:20])
        silent = socket.create_connection(("127.0.0.1", app.port))
        started = time.monotonic()
        try:
            deadline = started + READ_TIMEOUT_S + 10
            answers = [closed_within(sock, max(0.1, deadline - time.monotonic()))
                       for sock in [*half_bodies, half_headers, silent]]
            closed_after = time.monotonic() - started
            assert None not in answers, f"{answers.count(None)} slow connections still open"
            assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), set(answers)
            assert closed_after < READ_TIMEOUT_S + 5
            # A whole request on a fresh connection is still served.
            assert httpx.get(f"{app.url}/health/live").status_code == 200
        finally:
            for sock in [*half_bodies, half_headers, silent]:
                sock.close()
        print(f"\n{SLOW_CLIENTS} half-sent bodies, half-sent headers and a silent connection: "
              f"all answered 408 and closed within {closed_after:.1f} s (timeouts {READ_TIMEOUT_S} s)")


def test_a_slow_but_steady_body_within_the_timeout_is_served(model_path):
    """The body deadline bounds the whole body, and a body sent in pieces inside it is read whole."""
    settings = Settings(grpc_url=f"127.0.0.1:{free_port()}", model=model_path, body_timeout=3.0)
    with ServedApp(settings) as app:
        body = json.dumps(completion(os.path.basename(model_path), max_tokens=1)).encode()
        with socket.create_connection(("127.0.0.1", app.port)) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n\r\n").encode())
            for piece in (body[:10], body[10:30], body[30:]):
                time.sleep(0.3)
                sock.sendall(piece)
            sock.settimeout(10)
            answer = sock.recv(4096)
        # No Triton behind it: the whole body was read and the request reached the routing (503).
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]


PAUSE_PAST_UVICORNS_KEEP_ALIVE_S = 6.5  # uvicorn's own idle timeout is 5 s


def test_a_request_sent_while_the_frontend_is_paused_is_answered(tmp_path, model_path):
    """A client reuses an idle connection while the frontend is stopped (a stalled host, a long GC):
    on waking, the frontend must read the request, not close the connection as idle for too long
    (the client got a reset: the soak's frontend pause lost two requests this way)."""
    with FrontendProcess([f"127.0.0.1:{free_port()}"], model_path, tmp_path / "frontend.log") as frontend, \
            httpx.Client(base_url=frontend.url, limits=httpx.Limits(keepalive_expiry=120), timeout=30) as client:
        assert client.get("/health/live").status_code == 200
        frontend.pause()
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(client.get, "/health/live")  # on the same, idle connection
                time.sleep(PAUSE_PAST_UVICORNS_KEEP_ALIVE_S)
                frontend.resume()
                assert answer.result().status_code == 200
        finally:
            frontend.resume()
        assert client.get("/health/live").status_code == 200
