"""Prefix routing by the replicas' KV events: two real tritonservers publishing their engines' events
(kv_events_config in model.json), one frontend following them. A system prompt cached on one replica
(through a frontend of its own) draws its later requests there, though first-block hashing sends
them to the other one; its prefix-cache hits show they found it."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from openai_frontend import Settings
from openai_frontend.replicas import Replica, prefix_key, rendezvous_order
from tests.utils.serve import ServedApp, frontend_metrics
from tests.utils.triton import settled
from tools.triton_server import TritonServer, free_port, write_model_repository

ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024, "max_num_seqs": 8}
RULES = (" Answer briefly and politely, in plain English, and say when you are not sure. "
         "Prefer concrete suggestions over general advice. ") * 5
REQUESTS = "tritonllm_frontend_replica_requests_total"


@pytest.fixture(scope="module")
def tritons(tmp_path_factory, model_path):
    """Two tritonservers with the llm model only, each publishing KV events on a loopback port:
    (server, its event endpoint) pairs."""
    servers = []
    for name in ("a", "b"):
        work = tmp_path_factory.mktemp(f"replica_{name}")
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        events = {"kv_events_config": {"enable_kv_cache_events": True, "endpoint": endpoint}}
        repository = write_model_repository(work / "repository", {"model": model_path, **ENGINE, **events})
        server = TritonServer(repository, work, http_port=free_port(), grpc_port=free_port(),
                              metrics_port=free_port(), log_file=work / "triton.log",
                              extra_args=["--exit-timeout-secs=10", "--model-control-mode=explicit",
                                          "--load-model=llm"]).start()
        servers.append((server, endpoint))
    try:
        for server, _ in servers:
            server.wait_ready(300)
        yield servers
    finally:
        for server, _ in servers:
            server.stop()


def complete(app: ServedApp, model: str, prompt: str) -> None:
    response = httpx.post(f"{app.url}/v1/completions", timeout=120,
                          json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


def tokens(app: ServedApp, model: str, prompt: str) -> list[int]:
    response = httpx.post(f"{app.url}/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.slow
def test_requests_follow_the_replica_that_holds_their_prefix(tritons, model_path):
    model = os.path.basename(model_path)
    pairs = [f"{server.grpc_url}={endpoint}" for server, endpoint in tritons]
    servers = [server for server, _ in tritons]
    a, b = servers
    following = Settings(triton_url=[a.grpc_url, b.grpc_url], routing="prefix", kv_events_endpoint=pairs,
                         model=model_path)
    with ServedApp(following) as app, ServedApp(Settings(triton_url=[b.grpc_url], model=model_path)) as only_b:
        index = app.app.state.frontend.triton.kv_index
        turn = 0

        def both_heard() -> bool:  # a subscription takes a moment: new prompts until both replicas' events come
            nonlocal turn
            turn += 1
            complete(app, model, f"Warm-up {turn}: the quick brown fox jumps over the lazy dog. " * 3)
            return all(index.caches.get(server.grpc_url) and index.caches[server.grpc_url].batches
                       for server in servers)

        wait_for(both_heard, "no KV events reached the frontend from both replicas")
        # A system prompt that first-block hashing sends to replica a ...
        pool = [Replica(a.grpc_url), Replica(b.grpc_url)]
        system = next(text for text in (f"You are tenant {k}'s assistant.{RULES}" for k in range(100))
                      if rendezvous_order(pool, prefix_key(tokens(app, model, text)))[0].url == a.grpc_url)
        # ... is cached on replica b alone.
        complete(only_b, model, f"{system}\nQuestion 0: where do I start?")
        hashes = index.prompt_hashes(tokens(app, model, f"{system}\nQuestion 0: where do I start?"), 16)
        wait_for(lambda: index.cached_blocks(b.grpc_url, hashes) == len(hashes), "b's stored blocks never came")
        assert index.cached_blocks(a.grpc_url, hashes) == 0

        before, hits_before = frontend_metrics(app.url), [settled(server) for server in servers]
        for question in range(1, 5):
            complete(app, model, f"{system}\nQuestion {question}: what next?")
        after, hits_after = frontend_metrics(app.url), [settled(server) for server in servers]
    sent = [after[REQUESTS, server.grpc_url] - before[REQUESTS, server.grpc_url] for server in servers]
    assert sent == [0, 4], sent
    hits = [after_["vllm:prefix_cache_hits_total"] - before_["vllm:prefix_cache_hits_total"]
            for before_, after_ in zip(hits_before, hits_after)]
    assert hits[0] == 0 and hits[1] >= 4 * (len(hashes) - 2) * 16, hits  # the system prompt's blocks, each time
