"""Shared fixtures: the prepared SmolLM2, one float32 engine reused across tests, and Hugging Face
transformers on the same weights as the reference. And the tiers: every test is marked `unit`,
`engine` or `serving` here, from the fixtures it uses and what its body starts (README, "Tests")."""

from __future__ import annotations

import functools
import inspect
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which Triton reads once, when it is
# first imported (transformers may import it early): set it before anything else can.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The tiers, first match wins: `serving` talks to a real server (tritonserver, the OpenAI frontend),
# `engine` runs a model (the prepared SmolLM2 or a tiny random one), `kernels` checks a Triton kernel
# (through the interpreter on a CPU) or a C++ op against its torch reference, `unit` is the rest.
SERVING_FIXTURES = {"server", "serve", "triton", "frontend", "tight_triton", "tight_frontend", "tritons"}
ENGINE_FIXTURES = {"model_path", "llm", "tiny_model", "tiny", "tiny_single"}
STARTS_A_SERVER = ("llm_server(", "TritonServer(", "ServedApp(")
RUNS_A_MODEL = ("LLM(", "LLMEngine(", "ForCausalLM(", "tiny_model(", "greedy_tokens(")
KERNEL_FILES = {"test_kernels.py", "test_cpu_ops.py"}
TIERS = ("unit", "kernels", "engine", "serving")


def tier(item: pytest.Item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        source = ""
    if fixtures & SERVING_FIXTURES or any(call in source for call in STARTS_A_SERVER):
        return "serving"
    if fixtures & ENGINE_FIXTURES or any(call in source for call in RUNS_A_MODEL):
        return "engine"
    if item.path.name in KERNEL_FILES or "kernel" in item.name:
        return "kernels"
    return "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier(item))


@pytest.fixture(scope="session")
def model_path() -> str:
    from tools.prepare_model import prepare_model
    return str(prepare_model())


@pytest.fixture(scope="session")
def llm(model_path):
    """A float32 engine with ample KV; tests must leave it with every block free."""
    from backend import LLM
    return LLM(model_path, dtype="float32", kv_cache_memory_bytes=512 << 20, seed=0)


@pytest.fixture(autouse=True)
def _blocks_are_free_after_each_test(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").llm_engine
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "KV blocks leaked"


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """Greedy continuation of one prompt by HF `generate` (one prompt at a time, no padding),
    past EOS like `ignore_eos=True`."""
    @functools.lru_cache(maxsize=None)
    def generate(prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=2)
        return out[0, len(prompt_ids):].tolist()
    return generate
