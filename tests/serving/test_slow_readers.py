"""Clients that stop reading: streaming clients that never read their answer, or read one byte a
second, beside normal ones, against the frontend in its own process over a real tritonserver with a
tiny random model (the frontend is under test, not the weights). Past --write-timeout their
requests are cancelled (the engine counts them as `abort` and frees their KV blocks) and their
connections closed; the normal clients keep their speed; the frontend's memory stays bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from tests.utils import wait_for
from tests.utils.frontend import FrontendProcess, HostPauses
from tests.utils.triton import start_triton
from tools.triton_server import write_model_repository

MAX_MODEL_LEN = 4096
ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 128 << 20, "max_model_len": MAX_MODEL_LEN,
          "max_num_seqs": 48}
WRITE_TIMEOUT_S = 10.0
SILENT_CLIENTS = TRICKLING_CLIENTS = 16  # never read; read one byte a second
NORMAL_CLIENTS = 8
# A slow client's answer: tokens with 20 alternatives each (about 1.5 KB an event), far more than
# the buffers between it and the frontend hold. The engine does not wait for a stream's reader
# (Triton queues its responses), so the generation must outlast the write timeout for the cut to
# cancel it: 32 of them at once took ~11 s for 448 tokens on a 2-core Zen 5, ~100 s for these.
SLOW_MAX_TOKENS = MAX_MODEL_LEN - 64  # the chat template adds some 30 tokens to the prompt
NORMAL_MAX_TOKENS = 48
RSS_GROWTH_BOUND = 100 << 20


@pytest.fixture(scope="module")
def tiny_long_llama(tmp_path_factory, model_path) -> str:
    """conftest's tiny Llama with room for answers that outlast the write timeout."""
    from transformers import LlamaConfig

    from tests.utils.models import copy_tokenizer, tiny_model
    folder = tmp_path_factory.mktemp("tiny_long_llama")
    tiny_model(folder, LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    return copy_tokenizer(model_path, folder)


@pytest.fixture(scope="module")
def triton(tmp_path_factory, tiny_long_llama):
    work = tmp_path_factory.mktemp("slow_readers")
    write_model_repository(work / "repository", {"model": tiny_long_llama, **ENGINE})
    server = start_triton(work, ("llm",))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def frontend(triton, tiny_long_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("slow_readers_frontend") / "frontend.log"
    with FrontendProcess([triton.grpc_url], tiny_long_llama, log, f"--max-model-len={MAX_MODEL_LEN}",
                         f"--write-timeout={WRITE_TIMEOUT_S}") as process:
        wait_for(lambda: httpx.get(f"{process.url}/health").status_code == 200, 60, "/health to turn 200")
        yield process


def engine_metric(triton, name: str, label: str = "") -> float:
    """One vllm:* series of the llm model, summed over the series that hold `label`."""
    text = urllib.request.urlopen(triton.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and 'model="llm"' in line and label in line)


def slow_client(port: int, model: str) -> socket.socket:
    """A streaming chat request on a raw socket, which the caller then (mostly) does not read. The
    socket is set up as a remote client's would be: loopback's 64 KiB segments would let the kernel
    buffer megabytes for it (the send buffer grows with them), a real network's about 50 KB."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Tell me everything."}],
                       "max_tokens": SLOW_MAX_TOKENS, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_rest(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What is left to read, and whether the server closed the connection (else: still open)."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except TimeoutError:
        return received, False
    except ConnectionResetError:  # aborted with data unsent: a reset
        pass
    return received, True


async def normal_stream(http: httpx.AsyncClient, model: str) -> int:
    """One streamed chat read as it comes; the content events it held."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": NORMAL_MAX_TOKENS, "ignore_eos": True, "stream": True}
    events, done = 0, False
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            done |= line == "data: [DONE]"
            events += line.startswith("data: {") and '"content"' in line
    assert done, "a normal stream ended without [DONE]"
    return events


def normal_clients(url: str, model: str) -> float:
    """NORMAL_CLIENTS streams at once, each read whole; the seconds they took."""
    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            events = await asyncio.gather(*(normal_stream(http, model) for _ in range(NORMAL_CLIENTS)))
        assert all(events), events  # (a token that ends inside a character adds no content event)

    started = time.monotonic()
    asyncio.run(run())
    return time.monotonic() - started


def test_clients_that_stop_reading_are_cut_and_freed(triton, frontend, tiny_long_llama):
    model = Path(tiny_long_llama).name
    normal_clients(frontend.url, model)  # warm: the first requests pay for imports and allocations
    alone = normal_clients(frontend.url, model)
    rss_before = frontend.rss_bytes()
    aborted_before = engine_metric(triton, "vllm:request_success_total", 'finished_reason="abort"')

    slow = [slow_client(frontend.port, model) for _ in range(SILENT_CLIENTS + TRICKLING_CLIENTS)]
    started = time.monotonic()
    trickling, stop = slow[SILENT_CLIENTS:], threading.Event()
    rss_peak, cuts = [rss_before], []  # (when, slow requests cancelled so far)

    def trickle_and_watch() -> None:
        for sock in trickling:
            sock.setblocking(False)
        while not stop.wait(0.5):
            rss_peak[0] = max(rss_peak[0], frontend.rss_bytes())
            aborted = engine_metric(triton, "vllm:request_success_total", 'finished_reason="abort"') - aborted_before
            cuts.append((time.monotonic(), aborted))
            for sock in trickling:
                try:
                    sock.recv(1)
                except OSError:  # nothing to read yet (BlockingIOError), or closed
                    pass

    watcher = threading.Thread(target=trickle_and_watch, daemon=True)
    with HostPauses() as pauses:
        watcher.start()
        try:
            beside_slow = normal_clients(frontend.url, model)
            normal_done = time.monotonic()
            # Every slow request cancelled by the frontend, none finished by its engine.
            wait_for(lambda: cuts and cuts[-1][1] >= len(slow), WRITE_TIMEOUT_S + 90,
                     "the slow clients' requests to be cancelled")
            wait_for(lambda: engine_metric(triton, "vllm:kv_cache_usage_perc") == 0
                     and engine_metric(triton, "vllm:num_requests_running") == 0, 20, "the KV cache to empty")
        finally:
            stop.set()
            watcher.join()
            answers = [read_rest(sock, 5.0) for sock in slow]
            for sock in slow:
                sock.close()
    first_cut = next(at for at, aborted in cuts if aborted > 0)
    last_cut = next(at for at, aborted in cuts if aborted >= len(slow))
    rss_after = frontend.rss_bytes()
    paused = pauses.within(started, last_cut)
    print(f"\n{len(slow)} clients that stop reading ({SILENT_CLIENTS} silent, {TRICKLING_CLIENTS} at 1 byte/s): "
          f"cancelled and closed from {first_cut - started:.1f} s to {last_cut - started:.1f} s after they started "
          f"(write timeout {WRITE_TIMEOUT_S:g} s); {NORMAL_CLIENTS} normal streams took {beside_slow:.2f} s beside "
          f"them, {alone:.2f} s alone; frontend RSS {rss_before / 2**20:.0f} MiB before, peak "
          f"{rss_peak[0] / 2**20:.0f}, after {rss_after / 2**20:.0f}"
          + (f"; the host paused this test {len(paused)} times: timing not asserted" if paused else ""))
    for received, closed in answers:
        assert closed, "a slow client's connection is still open"
        assert b"data: [DONE]" not in received, "a slow client's stream ran to its end instead of being cut"
    assert all(received.startswith(b"HTTP/1.1 200 ") for received, _ in answers[:SILENT_CLIENTS])
    assert engine_metric(triton, "vllm:num_requests_waiting") == 0
    assert rss_peak[0] - rss_before < RSS_GROWTH_BOUND and rss_after - rss_before < RSS_GROWTH_BOUND
    if not paused:
        # The normal clients shared the engine with the slow ones' generations (compute, not a
        # stall), and none waited for the write timeout: all were done before the first cut.
        assert normal_done < first_cut, (beside_slow, first_cut - started)
        assert first_cut - started >= WRITE_TIMEOUT_S
    normal_clients(frontend.url, model)  # and it serves on: every stream to its [DONE]
