"""Sampling behaviour on the real model: seeds, stops, lengths, n > 1, penalties, top-k/p."""

from __future__ import annotations

import pytest
import torch

from backend import SamplingParams
from backend.core.request import Request
from backend.sampling.sampler import Sampler, apply_penalties, apply_top_k_top_p

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
OTHERS = ["The capital of France is", "def fibonacci(n):", "你好，请介绍一下你自己。"]


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


def test_seeded_sampling_is_reproducible_across_runs_and_batch_mates(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234)
    alone = llm.generate([PROMPT], params)[0].outputs[0]
    again = llm.generate([PROMPT], params)[0].outputs[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    mixed = llm.generate(OTHERS + [PROMPT], [unseeded] * 3 + [params])[3].outputs[0]
    assert alone.token_ids == again.token_ids == mixed.token_ids
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=99))
    assert other_seed[0].outputs[0].token_ids != alone.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    top_k = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, max_tokens=16))
    top_p = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16))
    assert top_k[0].outputs[0].token_ids == greedy
    assert top_p[0].outputs[0].token_ids == greedy


def test_max_tokens_default_and_length_finish(llm):
    output = llm.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(output.token_ids) == 16 and output.finish_reason == "length"


def test_stop_string_truncates_and_reports(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    word = base.split()[3]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop=[word]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert stopped.text == base[:base.index(word)]
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop=[word],
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base[:base.index(word) + len(word)]


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    target = base.token_ids[4]
    first = base.token_ids.index(target)
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20,
                                                    stop_token_ids=[target]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target
    assert stopped.token_ids == base.token_ids[:first + 1]
    # min_tokens suppresses the stop token until enough tokens exist.
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                                 stop_token_ids=[target]))[0].outputs[0]
    assert len(held.token_ids) >= first + 2
    assert target not in held.token_ids[:first + 2]


def test_eos_stops_unless_ignored(llm):
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64))
    completion = chat[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == 2
    assert "<|im_end|>" not in completion.text
    ignored = llm.chat([{"role": "user", "content": "Say hi."}],
                       SamplingParams(temperature=0, max_tokens=len(completion.token_ids) + 3, ignore_eos=True))
    assert ignored[0].outputs[0].finish_reason == "length"


def test_n_samples_share_prompt_and_differ(llm):
    outputs = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7))
    completions = outputs[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in completions}) > 1
    again = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7))
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in completions]


def test_n_samples_compute_the_prompt_once(llm, tokenizer):
    prompt = "Some context to share between samples. " * 12  # many full blocks
    before = {m.name: m.value for m in llm.get_metrics()}
    llm.generate([prompt], SamplingParams(n=3, temperature=0.8, max_tokens=4, seed=1))
    after = {m.name: m.value for m in llm.get_metrics()}
    full_blocks = (len(tokenizer(prompt).input_ids) - 1) // 16
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    assert hits >= 2 * full_blocks * 16  # the two later samples found the prompt's blocks


def test_repetition_penalty_changes_greedy_output(llm):
    prompt = "one two one two one two one two one two"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    penalised = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                      repetition_penalty=2.0))[0].outputs[0].token_ids
    assert plain != penalised


def _request(prompt, output, **params):
    request = Request("r", None, prompt, SamplingParams(**params))
    request.all_token_ids.extend(output)
    return request


def test_penalties_match_a_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    requests = [_request([1, 2], [3, 3, 4], repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25),
                _request([5], [], repetition_penalty=1.0)]
    expected = logits.clone()
    for token in (1, 2, 3, 4):
        value = expected[0, token]
        expected[0, token] = value / 1.5 if value > 0 else value * 1.5
    expected[0, 3] -= 0.5 * 2 + 0.25
    expected[0, 4] -= 0.5 * 1 + 0.25
    actual = logits.clone()
    apply_penalties(actual, requests)
    torch.testing.assert_close(actual, expected)


def test_sampler_draws_from_the_softmax_and_never_a_masked_token():
    """Inverse-CDF draws follow softmax(logits / T) (chi-square over 16 tokens, 20k draws), top-k
    removes what it masks, and a seeded request's draws do not depend on its batch mates."""
    torch.manual_seed(0)
    logits = torch.randn(16) * 2
    logits[3] = float("-inf")  # a token a grammar or a bias forbade
    temperature, draws = 0.7, 20_000
    sampler = Sampler(seed=1)
    params = SamplingParams(temperature=temperature)
    requests = [_request([1], [], temperature=temperature) for _ in range(1000)]
    counts = torch.zeros(16)
    for _ in range(draws // len(requests)):
        tokens = sampler(logits.repeat(len(requests), 1), requests).token_ids
        counts += torch.bincount(torch.tensor(tokens), minlength=16)
    expected = (logits / params.temperature).softmax(-1) * draws
    assert counts[3] == 0
    kept = expected > 0
    chi_square = (((counts - expected)[kept] ** 2) / expected[kept]).sum().item()
    assert chi_square < 37.7, (chi_square, counts, expected)  # p = 0.001 at 14 degrees of freedom
    top_k = sampler(logits.repeat(200, 1), [_request([1], [], temperature=5.0, top_k=2) for _ in range(200)])
    assert set(top_k.token_ids) <= set(logits.topk(2).indices.tolist())

    def seeded_tokens(batch_mates):
        seeded = _request([1], [], temperature=1.0, seed=7)
        batch = [_request([1], [], temperature=1.0) for _ in range(batch_mates)] + [seeded]
        return [Sampler(seed=batch_mates)(logits.repeat(len(batch), 1), batch).token_ids[-1] for _ in range(20)]

    assert seeded_tokens(0) == seeded_tokens(5)


def test_top_k_top_p_mask():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(masked[0]).tolist() == [True, False, False, True]
    # softmax of [1,4,3,2] is [.03,.64,.24,.09]: the 0.5 nucleus is the top token alone.
    assert torch.isinf(masked[1]).tolist() == [True, False, True, True]


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(max_tokens=0), dict(top_p=0.0),
                                 dict(n=0), dict(logprobs=21), dict(min_tokens=5, max_tokens=2),
                                 dict(top_k=1e30), dict(seed=1 << 70), dict(temperature="hot"),
                                 dict(max_tokens=2.5), dict(temperature=float("nan")),
                                 dict(repetition_penalty=float("inf")),
                                 dict(stream_interval=0), dict(stream_interval=2.0)])
def test_invalid_sampling_params_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_sampling_params_from_json_casts_strings():
    params = SamplingParams.from_dict({"temperature": "0.5", "max_tokens": "7", "ignore_eos": "true",
                                       "stop": "x"})
    assert (params.temperature, params.max_tokens, params.ignore_eos, params.stop) == (0.5, 7, True, ["x"])
    assert SamplingParams.from_dict({"stream_interval": "4"}).stream_interval == 4
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 1})


def test_token_ids_outside_the_vocabulary_are_rejected_not_fatal(llm):
    for bad in (dict(stop_token_ids=[10**6], min_tokens=2), dict(logit_bias={10**6: 5.0})):
        with pytest.raises(ValueError, match="token ids must be in"):
            llm.generate(["Hello"], SamplingParams(max_tokens=4, **bad))
    huge_top_k = llm.generate(["Hello"], SamplingParams(max_tokens=4, top_k=10**7, seed=3))
    assert len(huge_top_k[0].outputs[0].token_ids) >= 1
