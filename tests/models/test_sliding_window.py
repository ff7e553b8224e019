"""Sliding-window attention end to end: a tiny random MistralForCausalLM (a window on every layer,
shorter than the prompts) greedy in float32 through the offline `LLM`, token for token against
Hugging Face's `generate`, on the C++ path and on the Triton kernels, with chunked prefill, prefix
caching and preemption; and the KV blocks behind the window freed while a request runs."""

from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams, ops
from backend.config import EngineConfig, all_layers_window, resolve_limits
from backend.core.kv_cache import NULL_BLOCK
from tests.utils.models import tiny_model

WINDOW = 16
BLOCK_SIZE = 8
PROMPTS = [[(11 * j) % 250 + 3 for j in range(40)], [(7 * j) % 250 + 3 for j in range(75)], [5, 9, 13]]
SHARED = PROMPTS[0][:32] + [17, 18, 19, 20, 21]  # a prefix-cache hit on the first prompt's blocks


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(path, reference model): head_dim 64, so the C++ attention takes it; every parameter, norms
    included, moved away from its init."""
    from transformers import MistralConfig

    path = tmp_path_factory.mktemp("mistral")
    config = MistralConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
                           max_position_embeddings=512, initializer_range=0.3)
    return str(path), tiny_model(path, config, perturb="all", attn_implementation="eager")


def hf_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_llm(path: str, **options) -> LLM:
    settings = dict(dtype="float32", skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_num_seqs=4,
                    kv_cache_memory_bytes=2 << 20)
    return LLM(path, **{**settings, **options})


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_all_layers_window_only_where_every_layer_slides():
    assert all_layers_window({"model_type": "mistral", "sliding_window": 4096, "use_sliding_window": None}) == 4096
    assert all_layers_window({"model_type": "mistral", "sliding_window": None}) is None
    assert all_layers_window({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}) is None
    gemma2 = {"model_type": "gemma2", "sliding_window": 4096}
    assert all_layers_window(gemma2) is None  # every other layer is global
    assert all_layers_window({**gemma2, "layer_types": ["sliding_attention", "full_attention"]}) is None
    assert all_layers_window({**gemma2, "layer_types": ["sliding_attention"] * 2}) == 4096
    # The context is no longer capped at the window.
    limits = resolve_limits(EngineConfig(), {"model_type": "mistral", "sliding_window": 64,
                                             "max_position_embeddings": 1024}, "cpu")
    assert (limits.max_model_len, limits.sliding_window) == (1024, 64)
    # A vision-language model's limits are its decoder's (LLaVA over Mistral).
    llava = {"model_type": "llava", "text_config": {"model_type": "mistral", "sliding_window": 64,
                                                     "max_position_embeddings": 4096}}
    limits = resolve_limits(EngineConfig(max_model_len=3000), llava, "cpu")
    assert (limits.max_model_len, limits.sliding_window) == (3000, 64)


@pytest.mark.parametrize("budget", [None, 8], ids=["whole-prompts", "chunks-of-8"])
def test_mistral_window_exact_on_the_cpu_path(mistral, budget):
    """Prompts of 40 and 75 tokens over a window of 16 (and a 3-token one), then a prompt sharing
    the first one's 32-token prefix (a prefix-cache hit on blocks the first freed behind its window),
    all identical to transformers."""
    path, model = mistral
    options = {} if budget is None else dict(max_num_batched_tokens=budget)
    llm = make_llm(path, **options)
    engine = llm.llm_engine
    assert engine.kv_cache.sliding_window == WINDOW
    tokens = run(llm, PROMPTS, 24) + run(llm, [SHARED], 24)
    for prompt, got in zip(PROMPTS + [SHARED], tokens):
        assert got == hf_tokens(model, prompt, 24)
    assert engine.kv_cache.num_window_freed_blocks > 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_usable_blocks  # nothing leaked


def test_mistral_window_exact_on_triton_kernels(mistral):
    """The same through the Triton kernels (the interpreter on the CPU), in chunks of 16."""
    path, model = mistral
    with ops.triton_kernels():
        tokens = run(make_llm(path, max_num_batched_tokens=16), PROMPTS[:2], 12)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == hf_tokens(model, prompt, 12)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mistral_window_exact_under_preemption(mistral, mode):
    """Four long requests in chunks of up to 32 tokens over a cache of 11 usable blocks (a chunk
    holds up to 7, with its window): requests are preempted and resumed, tokens unchanged, no block
    leaked."""
    path, model = mistral
    block_bytes = 2 * 2 * 2 * BLOCK_SIZE * 64 * 4  # K and V, 2 layers, 2 KV heads, float32
    llm = make_llm(path, kv_cache_memory_bytes=12 * block_bytes, max_num_batched_tokens=32,
                   preemption_mode=mode, swap_space=0.01, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1][5:], PROMPTS[0][3:]]
    tokens = run(llm, prompts, 40)
    assert {m.name: m.value for m in engine.get_metrics()}["vllm:num_preemptions"] > 0
    for prompt, got in zip(prompts, tokens):
        assert got == hf_tokens(model, prompt, 40)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_usable_blocks


def test_blocks_behind_the_window_are_freed_during_a_long_generation(mistral):
    """One request of 40 + 200 tokens: without freeing it would hold 30 blocks of 8 at the end; with
    a window of 16 it never holds more than the window's blocks, the step's and one partial. The
    freed table entries point at the null block, which is never handed out."""
    path, model = mistral
    llm = make_llm(path)
    engine = llm.llm_engine
    kv = engine.kv_cache
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    in_use, tokens = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
        in_use.append(kv.num_usable_blocks - kv.num_free_blocks)
        request = engine.scheduler.running[0] if engine.scheduler.running else None
        if request is not None:
            freed = [b for b in request.block_table if b == NULL_BLOCK]
            assert request.block_table[:len(freed)] == freed  # a prefix of the table
    assert in_use[0] == 5  # the whole 40-token prompt
    assert max(in_use[1:]) <= -(-(WINDOW + 1) // BLOCK_SIZE) + 1 + 1  # window + this step, unaligned
    assert kv.num_window_freed_blocks >= 240 // BLOCK_SIZE - 4
    assert tokens == hf_tokens(model, PROMPTS[0], 200)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_block_manager_frees_behind_the_window_and_keeps_prefix_hashes():
    """Blocks of 4, window 6: after 14 computed tokens the next token (position 14) sees 9-14, so
    blocks 0 and 1 (positions 0-7) are freed, their entries the null block, which is never handed
    out; the hash chain goes on, a later prompt with the same prefix still hits the freed blocks,
    and freeing the request releases each real block once."""
    from backend.core.kv_cache import KVCacheManager
    from backend.core.request import Request

    kv = KVCacheManager(num_blocks=12, block_size=4, sliding_window=6)
    assert kv.num_usable_blocks == 11 and NULL_BLOCK not in kv.free_blocks
    tokens = list(range(100, 120))
    request = Request("a", None, tokens, SamplingParams())
    assert kv.allocate_slots(request, 14)
    request.num_computed_tokens = 14
    kv.cache_full_blocks(request)
    assert kv.free_behind_window(request) == 2
    assert request.block_table[:2] == [NULL_BLOCK, NULL_BLOCK] and kv.num_free_blocks == 11 - 2
    assert kv.free_behind_window(request) == 0  # nothing more until it moves on
    assert kv.allocate_slots(request, 2)
    request.num_computed_tokens = 16
    kv.cache_full_blocks(request)
    assert len(request.block_hashes) == 4  # the chain continued over the freed entries
    later = Request("b", None, tokens[:13], SamplingParams())
    assert len(kv.find_cached_prefix(later)) == 3  # blocks 0-2, two of them freed but intact
    kv.free(request)
    assert kv.num_free_blocks == 11 and sorted(kv.free_blocks) == list(range(1, 12))
    # A request holds at most the window's and a step's blocks (+1), or all of them without chunks.
    assert kv.most_blocks_held(400, 8) == kv.blocks_needed(6 + 8) + 1
    assert kv.most_blocks_held(400, None) == 100
