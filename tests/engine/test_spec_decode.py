"""Speculative decoding: greedy outputs token for token as without it (ngram and draft-model drafts,
mixed with prefill chunks, with stops, min_tokens and logprobs), rejected drafts never reach the
prefix cache, sampling keeps the target distribution, and a bad speculative_config is refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.spec_decode import ngram_proposal
from tests.utils.prompts import LONG_DOC

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPETITIVE = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
]
PLAIN = ["The capital of France is", "Hello", "北京是中国的首都，它有很多名胜古迹，比如"]


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def spec_counters(llm: LLM) -> dict[str, float]:
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics() if "spec_decode" in m.name}


def assert_all_blocks_free(llm: LLM) -> None:
    """The engine's blocks, and the draft model's where there is one."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    draft = getattr(getattr(engine.spec, "proposer", None), "kv_cache", None)
    for kv_cache in filter(None, [engine.kv_cache, draft]):
        assert kv_cache.num_free_blocks == kv_cache.num_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def ngram_llm(model_path):
    """Ngram speculation with a small token budget, so that long prompts are chunked across the steps
    that verify drafts."""
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=64,
              speculative_config=NGRAM)
    yield llm
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("value,message", [
    ("{not json", "not valid JSON"),
    ([1], "must be a JSON object"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min \\(4\\) must not exceed prompt_lookup_max \\(2\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be a positive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model is for method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method draft_model needs model"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max is for method ngram"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key\\(s\\) typo"),
])
def test_invalid_speculative_config_is_refused(value, message):
    with pytest.raises(ValueError, match=f"^speculative_config: {message}"):
        EngineConfig(speculative_config=value)


def test_speculative_config_from_json_text_and_cli_defaults():
    from backend.config import SpeculativeConfig

    config = EngineConfig.from_dict({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, '
                                                          '"prompt_lookup_max": 4}'})
    parsed = SpeculativeConfig.parse(config.speculative_config)
    assert (parsed.prompt_lookup_min, parsed.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    with pytest.raises(ValueError, match="draft_model runs without tensor/pipeline parallelism"):
        EngineConfig(tensor_parallel_size=2, speculative_config={"model": "/m", "num_speculative_tokens": 2})


def test_ngram_proposal_copies_what_followed_the_latest_longest_match():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 1, 2, 3) == [4, 5, 1]  # the latest [1, 2]
    assert ngram_proposal([7, 1, 2, 3, 8, 5, 2, 3, 6, 1, 2, 3], 1, 3, 3) == [8, 5, 2]  # [1, 2, 3] before [2, 3]
    assert ngram_proposal([7, 1, 2, 3, 8, 5, 2, 3, 6, 1, 2, 3], 1, 2, 2) == [6, 1]
    assert ngram_proposal([1, 2, 3, 4], 1, 3, 4) == []
    assert ngram_proposal([5, 5], 1, 3, 4) == [5]  # what follows may run up to the end


def test_ngram_greedy_is_token_exact_and_accepts_drafts(llm, ngram_llm):
    before = spec_counters(ngram_llm)
    prompts = REPETITIVE + PLAIN
    expected = llm.generate(prompts, greedy())
    outputs = ngram_llm.generate(prompts, greedy())
    for want, got in zip(expected, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, got.prompt
        assert got.outputs[0].text == want.outputs[0].text
    after = spec_counters(ngram_llm)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert after["num_drafts"] > before["num_drafts"]
    assert 0 < accepted < drafted, (accepted, drafted)
    assert_all_blocks_free(ngram_llm)


def test_stops_min_tokens_and_logprobs_under_speculation(llm, ngram_llm):
    params = [greedy(stop=[" fig", "sub`", " 19"]), greedy(stop=["8"], include_stop_str_in_output=True),
              greedy(min_tokens=12, stop_token_ids=[28]),  # 28 is ","
              greedy(max_tokens=7), greedy(logprobs=3)]
    cases = list(itertools.product(REPETITIVE, params))
    expected = llm.generate([p for p, _ in cases], [s for _, s in cases])
    before = spec_counters(ngram_llm)
    outputs = ngram_llm.generate([p for p, _ in cases], [s for _, s in cases])
    assert spec_counters(ngram_llm)["num_accepted_tokens"] > before["num_accepted_tokens"]
    stopped = [w.outputs[0].finish_reason == "stop" for w in expected]
    assert sum(stopped) >= 5, f"the stops were meant to hit: {stopped}"
    for want, got in zip(expected, outputs):
        w, g = want.outputs[0], got.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason)
        if w.logprobs is not None:
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
            for want_entry, got_entry in zip(w.logprobs, g.logprobs):
                assert set(got_entry) == set(want_entry)
                for token, logprob in want_entry.items():
                    assert got_entry[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
                    assert got_entry[token].rank == logprob.rank
    assert_all_blocks_free(ngram_llm)


def test_seeded_sampling_gives_the_same_tokens_as_without_speculation(llm, ngram_llm):
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=seed, max_tokens=40, ignore_eos=True) for seed in range(3)]
    params.append(SamplingParams(temperature=0.5, top_k=20, repetition_penalty=1.1, seed=7, max_tokens=40, ignore_eos=True))
    prompts = REPETITIVE + REPETITIVE[:1]
    before = spec_counters(ngram_llm)
    outputs = ngram_llm.generate(prompts, params)
    assert spec_counters(ngram_llm)["num_accepted_tokens"] > before["num_accepted_tokens"]
    expected = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert_all_blocks_free(ngram_llm)


def test_drafts_verified_in_the_same_steps_as_prefill_chunks(llm, ngram_llm):
    engine = ngram_llm.llm_engine
    long_prompts = [LONG_DOC + "\nSummarize the text above:", "Count on: " + LONG_DOC]  # ~290 tokens: 5 chunks
    for i, prompt in enumerate(REPETITIVE):
        engine.add_request(f"short-{i}", prompt, greedy(48))
    for _ in range(4):
        engine.step()
    for i, prompt in enumerate(long_prompts):
        engine.add_request(f"long-{i}", prompt, greedy(16))
    outputs, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        drafted_before = spec_counters(ngram_llm)["num_drafts"]
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        running = engine.scheduler.running
        prefilling = [r for r in running if 0 < r.num_computed_tokens < r.num_prompt_tokens]
        # Slots taken for rejected drafts went back: no request holds blocks past its tokens.
        assert all(len(r.block_table) <= engine.kv_cache.blocks_needed(r.num_tokens) for r in running)
        mixed_steps += bool(prefilling) and spec_counters(ngram_llm)["num_drafts"] > drafted_before
    assert mixed_steps >= 2, "drafts were meant to be verified next to prefill chunks"
    expected = llm.generate(REPETITIVE + long_prompts, [greedy(48)] * 3 + [greedy(16)] * 2)
    for i, want in enumerate(expected):
        assert outputs[f"short-{i}" if i < 3 else f"long-{i - 3}"] == want.outputs[0].token_ids
    assert_all_blocks_free(ngram_llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_exact_when_blocks_run_short(model_path, llm, preemption_mode):
    """20 blocks for 6 requests of ~5 blocks each: drafts go without slots, requests are preempted."""
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2 in float32: 30 layers, 3 KV heads of 64
    small = LLM(model_path, dtype="float32", kv_cache_memory_bytes=20 * block_bytes, speculative_config=NGRAM,
                preemption_mode=preemption_mode, swap_space=0.1)
    prompts = REPETITIVE + PLAIN
    expected = llm.generate(prompts, greedy(48))
    outputs = small.generate(prompts, greedy(48))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    metrics = {m.name: m.value for m in small.get_metrics()}
    assert metrics["vllm:num_preemptions"] > 0 and metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(small)


def test_prefix_cache_holds_only_accepted_tokens(ngram_llm):
    """Blocks filled while verifying drafts are cached only with accepted tokens: a later request
    whose prompt is the first one's prompt and output hits them and continues exactly as it did."""
    engine = ngram_llm.llm_engine
    engine.kv_cache.reset_prefix_cache()
    before = spec_counters(ngram_llm)
    prompt = engine.tokenizer(REPETITIVE[1]).input_ids
    first = ngram_llm.generate([prompt], greedy(64))[0].outputs[0].token_ids
    after = spec_counters(ngram_llm)
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert 8 < accepted < after["num_draft_tokens"] - before["num_draft_tokens"], "some drafts were meant to be rejected"
    sequence = prompt + first
    size = engine.kv_cache.block_size
    aligned = {tuple(sequence[i:i + size]) for i in range(0, len(sequence) - size + 1, size)}
    cached = [b.token_ids for b in engine.kv_cache.blocks if b.hash is not None]
    assert len(cached) >= len(sequence) // size - 1 and all(t in aligned for t in cached)

    hits = {m.name: m.value for m in ngram_llm.get_metrics()}["vllm:prefix_cache_hits"]
    resumed = ngram_llm.generate([sequence[:len(prompt) + 40]], greedy(24))[0].outputs[0].token_ids
    hits = {m.name: m.value for m in ngram_llm.get_metrics()}["vllm:prefix_cache_hits"] - hits
    assert hits >= (len(prompt) + 40) // size * size - size, "the continuation was meant to hit the cache"
    assert resumed == first[40:64]
    assert_all_blocks_free(ngram_llm)


def test_draft_model_same_as_target_accepts_every_draft(model_path, llm):
    draft = LLM(model_path, dtype="float32", kv_cache_memory_bytes=32 << 20,
                speculative_config={"method": "draft_model", "model": model_path, "num_speculative_tokens": 3})
    prompts = REPETITIVE[:2] + PLAIN
    expected = llm.generate(prompts, greedy(24))
    outputs = draft.generate(prompts, greedy(24))
    for want, got in zip(expected, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    counters = spec_counters(draft)
    assert counters["num_draft_tokens"] > 40
    assert counters["num_accepted_tokens"] >= 0.95 * counters["num_draft_tokens"], counters
    # An aborted request gives its draft-model blocks back too.
    engine = draft.llm_engine
    engine.add_request("aborted", PLAIN[0], greedy(24))
    for _ in range(3):
        engine.step()
    assert engine.spec.proposer.kv_cache.num_free_blocks < engine.spec.proposer.kv_cache.num_blocks
    engine.abort_request("aborted")
    assert_all_blocks_free(draft)



def test_draft_model_exact_when_the_step_budget_leaves_proposed_requests_out(model_path, llm):
    """Eight tokens a step for four decodes of 1 + 3 drafts: each step verifies two and leaves the other
    two, already proposed for, to be proposed for again with nothing new, and some decodes verify fewer
    drafts than were proposed. Every shadow in a draft step still computes a token (a chunk of none
    crashed the CPU's flash attention with SIGFPE)."""
    draft = LLM(model_path, dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=8,
                speculative_config={"method": "draft_model", "model": model_path, "num_speculative_tokens": 3})
    runner = draft.llm_engine.spec.proposer.runner
    chunks: list[int] = []
    execute = runner.execute

    def counting(step):
        chunks.extend(n for _, n in step.scheduled)
        return execute(step)

    runner.execute = counting
    prompts = REPETITIVE[:2] + PLAIN[:2]
    expected = llm.generate(prompts, greedy(16))
    outputs = draft.generate(prompts, greedy(16))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert chunks and min(chunks) > 0, sorted(chunks)[:8]
    counters = spec_counters(draft)
    assert counters["num_accepted_tokens"] >= 0.95 * counters["num_draft_tokens"] > 0, counters
    assert_all_blocks_free(draft)

# -- sampling keeps the target distribution ------------------------------------------------------------
VOCAB = 8
TINY_PROMPT = [1, 5, 2, 7, 0, 3, 6, 4, 1, 5, 2, 7, 0, 3, 6, 4, 1, 5]  # every token: ngram always drafts
NUM_SAMPLES = 6000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random Llama with an 8-token vocabulary whose next-token distributions are far from one-hot
    (drafts are accepted 10-20% of the time)."""
    from transformers import LlamaConfig

    from tests.utils import models

    path = tmp_path_factory.mktemp("tiny")
    model = models.tiny_model(path, LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, tie_word_embeddings=False,
                                                initializer_range=0.1))
    return str(path), model


def exact_distribution(model, params: SamplingParams, length: int) -> torch.Tensor:
    """P(t1..t_length) over all VOCAB ** length continuations, with the Sampler's processing:
    presence penalty on the output so far, then temperature and top-k."""
    probs = torch.ones(1)
    for step in range(length):
        prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=step)), dtype=torch.long)
        prefixes = prefixes.view(VOCAB ** step, step)
        context = torch.cat([torch.tensor(TINY_PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
        with torch.inference_mode():
            logits = model(context).logits[:, -1].double()
        seen = torch.zeros_like(logits).scatter_(1, prefixes, 1.0) if step else torch.zeros_like(logits)
        logits = (logits - params.presence_penalty * seen) / params.temperature
        if params.top_k:
            logits = logits.masked_fill(logits < logits.topk(params.top_k).values[:, -1:], float("-inf"))
        probs = (probs.unsqueeze(1) * logits.softmax(-1)).reshape(-1)
    return probs


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled into one."""
    from scipy.stats import chi2

    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return float(chi2.sf(statistic, int(keep.sum()) - 1))


@pytest.mark.parametrize("speculative_config,params", [
    (None, SamplingParams(temperature=1.0)),  # the harness itself: no speculation
    (NGRAM, SamplingParams(temperature=1.0)),
    (NGRAM, SamplingParams(temperature=0.8, top_k=6, presence_penalty=1.0)),
    ({"method": "draft_model", "num_speculative_tokens": 3}, SamplingParams(temperature=1.0)),
], ids=["off", "ngram", "ngram-topk-penalty", "draft-model"])
def test_sampling_keeps_the_target_distribution(tiny_model, speculative_config, params):
    """Samples of the first 4 tokens (3 of them from verification rows) against the exact
    distribution: the joint of the first three and the marginal of the fourth. Unseeded, so the
    batch's noise is used (deterministic all the same: the engine's seed is fixed); a sampler that
    favoured drafts fails this by far (p < 1e-20)."""
    path, model = tiny_model
    if speculative_config and speculative_config["method"] == "draft_model":
        speculative_config = {**speculative_config, "model": path}  # the same model: the greedy guess
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20,
              speculative_config=speculative_config)
    sampling = SamplingParams(**{**params.__dict__, "max_tokens": 4, "ignore_eos": True})
    tokens = torch.tensor([o.outputs[0].token_ids for o in llm.generate([TINY_PROMPT] * NUM_SAMPLES, sampling)])
    if speculative_config:
        counters = spec_counters(llm)
        assert 0 < counters["num_accepted_tokens"] < counters["num_draft_tokens"] - 1000, counters
    assert_all_blocks_free(llm)

    joint = exact_distribution(model, params, 4).view(VOCAB ** 3, VOCAB)
    first_three = torch.bincount(tokens[:, 0] * 64 + tokens[:, 1] * 8 + tokens[:, 2], minlength=VOCAB ** 3)
    fourth = torch.bincount(tokens[:, 3], minlength=VOCAB)
    assert chi_square_p_value(first_three.double(), joint.sum(1)) > 1e-3
    assert chi_square_p_value(fourth.double(), joint.sum(0)) > 1e-3
