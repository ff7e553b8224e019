"""Shared fixtures: the prepared SmolLM2, one float32 engine reused across tests, and Hugging Face
transformers on the same weights as the reference."""

from __future__ import annotations

import functools
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which Triton reads once, when it is
# first imported (transformers may import it early): set it before anything else can.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
