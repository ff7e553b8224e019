"""Tensor and pipeline parallelism over gloo on the CPU: the same greedy tokens as one process,
start-up errors for shapes that do not split, a multi-node rendezvous, and a dead worker failing
requests (never hanging) — offline and through a real tritonserver."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.async_engine import AsyncLLMEngine, EngineDeadError
from backend.config import EngineConfig
from backend.worker.distributed import free_port
from tests.utils import ROOT, wait_for
from tests.utils.models import tiny_model
from tests.utils.triton import generate, llm_server, texts

KV_BYTES = 16 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40, 130, 17])]


def tiny_split_model(path: Path, architecture: str = "llama", num_kv_heads: int = 2) -> str:
    """A random model whose 8 heads split over 2 ranks; vocab 511 so the vocabulary split pads."""
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(vocab_size=511, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
                 tie_word_embeddings=architecture == "qwen2", initializer_range=0.3)
    if architecture == "qwen2":
        tiny_model(path, Qwen2Config(**shape), perturb="qkv_bias")
    else:
        tiny_model(path, LlamaConfig(**shape))
    return str(path)


def greedy_tokens(model: str, prompts=PROMPTS, params=GREEDY, **parallel) -> list[list[int]]:
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=KV_BYTES, **parallel)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def worker_processes() -> list[psutil.Process]:
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if "backend.worker.rank" in " ".join(p.cmdline())]


@pytest.fixture(autouse=True)
def _no_orphan_workers():
    yield
    deadline = time.monotonic() + 10
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not worker_processes(), "worker processes outlived their engine"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_split_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_single(tiny):
    return greedy_tokens(tiny)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_tiny_model_split_matches_one_process(tiny, tiny_single, parallel):
    threads = torch.get_num_threads()
    assert greedy_tokens(tiny, **parallel) == tiny_single
    assert torch.get_num_threads() == threads  # the engine's share of the host's cores is given back


@pytest.mark.slow
def test_tensor_and_pipeline_together(tiny, tiny_single):
    assert greedy_tokens(tiny, tensor_parallel_size=2, pipeline_parallel_size=2) == tiny_single


@pytest.mark.parametrize("architecture,num_kv_heads", [("llama", 1), ("qwen2", 2)],
                         ids=["replicated-kv-head", "qwen2-biases-tied"])
def test_tensor_parallel_shapes(tmp_path, architecture, num_kv_heads):
    """One KV head for two ranks (replicated); Qwen2's sharded QKV biases and a tied vocab-split head."""
    model = tiny_split_model(tmp_path, architecture, num_kv_heads)
    assert greedy_tokens(model, tensor_parallel_size=2) == greedy_tokens(model)


def test_smollm2_tensor_parallel_3_matches_one_process(model_path, llm):
    """SmolLM2-135M: 9 query heads and 3 KV heads, one KV head per rank."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    parallel = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, tensor_parallel_size=3)
    try:
        outputs = parallel.generate(prompts, params)
    finally:
        parallel.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].outputs[0].text == llm.generate(prompts[:1], params)[0].outputs[0].text


def test_indivisible_heads_fail_at_start_with_a_clear_message(model_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide num_attention_heads \(9\)"):
        LLM(model_path, dtype="float32", kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="nnodes"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)


def test_two_hosts_meet_at_the_rendezvous(tiny, tiny_single):
    """Host 1 is `tritonllm worker` in another process; host 0 is the engine (rank 0)."""
    port = free_port()
    flags = ["--model", tiny, "--dtype", "float32", "--kv-cache-memory-bytes", str(KV_BYTES),
             "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port)]
    host1 = subprocess.Popen([sys.executable, "-m", "tools.cli", "worker", *flags, "--node-rank", "1"],
                             cwd=ROOT)
    try:
        tokens = greedy_tokens(tiny, tensor_parallel_size=2, nnodes=2, node_rank=0,
                               master_addr="127.0.0.1", master_port=port)
        assert tokens == tiny_single
        assert host1.wait(timeout=30) == 0  # rank 0's stop ends the other host's ranks too
    finally:
        if host1.poll() is None:
            host1.kill()


def test_killed_worker_fails_requests_instead_of_hanging(tiny):
    engine = AsyncLLMEngine(EngineConfig(model=tiny, dtype="float32", skip_tokenizer_init=True,
                                         kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2))

    async def run() -> tuple[int, BaseException | None]:
        received = 0
        try:
            async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True), "long"):
                received += 1
                if received == 3:
                    os.kill(engine.engine.runner.workers.processes[1].pid, signal.SIGKILL)
        except EngineDeadError as error:
            return received, error
        return received, None

    try:
        started = time.monotonic()
        received, error = asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert error is not None and received < 400, "the generation finished although a rank died"
        assert "rank 1" in str(error) or "Connection" in str(error) or "closed" in str(error), error
        assert time.monotonic() - started < 30
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=2), lambda output: None)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_triton_serves_tensor_parallel_3_and_a_dead_worker_unloads_the_model(tmp_path, model_path, llm):
    import tritonclient.grpc as grpcclient

    engine_args = {"model": model_path, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                   "max_model_len": 512, "tensor_parallel_size": 3}
    # The model unloads itself once a worker dies, so the server's exit code is not checked.
    with llm_server(tmp_path, engine_args, clean_exit=False) as server:
        prompt = "Triton Inference Server is"
        [result] = generate(server, prompt, {"temperature": 0, "max_tokens": 12})
        expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
        assert texts(result)[0] == prompt + expected
        workers = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                   if "backend.worker.rank" in " ".join(p.cmdline())]
        assert len(workers) == 2
        workers[0].kill()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        wait_for(lambda: not client.is_model_ready("llm"), timeout=20, message="the model to report not ready")
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers),
                 timeout=20, message="the other worker to exit")
        client.close()
