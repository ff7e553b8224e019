"""Shared fixtures: the prepared SmolLM2, one float32 engine reused across tests, Hugging Face
transformers on the same weights as the reference, and `tritonllm serve` on it with an OpenAI client.
Shared helpers are in tests/utils/. And the tiers: every test is marked `unit`, `kernels`, `engine`
or `serving` here, from the fixtures it uses and what its body starts (README, "Tests")."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

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
ENGINE_FIXTURES = {"model_path", "llm", "tiny_model", "tiny", "tiny_single", "tiny_llama"}
STARTS_A_SERVER = ("llm_server(", "TritonServer(", "ServedApp(", "Serve(")
RUNS_A_MODEL = ("LLM(", "LLMEngine(", "ForCausalLM(", "tiny_model(", "greedy_tokens(", "_matches_hf(")
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
def tokenizer(model_path):
    """The prepared model's tokenizer, loaded as the engine loads it."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)


@pytest.fixture(scope="session")
def model_name(model_path):
    """The served model's id: its folder's name."""
    return Path(model_path).name


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, model_path) -> str:
    """A random Llama of two layers of width 64 over SmolLM2's vocabulary, with its tokenizer and chat
    template: loads in seconds where the weights are not under test."""
    from transformers import LlamaConfig

    from tests.utils.models import copy_tokenizer, tiny_model
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_model(folder, LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    return copy_tokenizer(model_path, folder)


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


# -- served: `tritonllm serve` on the prepared model (tests/utils/serve.py) ------------------------
@pytest.fixture(scope="module")
def serve(tmp_path_factory, model_path):
    """`tritonllm serve` (Triton with the llm and embeddings models, and the frontend), one per
    test module; a module that needs other flags defines its own `serve`."""
    from tests.utils.serve import Serve
    with Serve(model_path, tmp_path_factory.mktemp("serve"), start_timeout=300, stop_timeout=60) as served:
        yield served


@pytest.fixture(scope="module")
def client(serve):
    from openai import OpenAI

    from tests.utils.serve import API_KEY
    return OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def no_request_left_running(request):
    """After a test on `serve`: its engine runs nothing and holds no KV block. Opted into by module
    (`pytestmark = pytest.mark.usefixtures("no_request_left_running")`)."""
    yield
    if "serve" in request.fixturenames:
        from tests.utils.serve import wait_engine_idle
        assert wait_engine_idle(request.getfixturevalue("serve")) == (0, 0), "a request kept its KV blocks"
