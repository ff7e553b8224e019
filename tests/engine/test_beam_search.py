"""Beam search (backend/engine/beam_search.py): token-exact against transformers' `generate(num_beams=k)` in
float32 offline, and the same beams through Triton (tritonclient) and the OpenAI frontend (the
openai SDK) on a real `tritonllm serve`."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from backend import BeamSearchParams
from backend.errors import EngineError

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):"]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def hf_beams(hf_model):
    """transformers' beams of one prompt: (generated token ids, sequences_scores) best first."""
    @functools.lru_cache(maxsize=None)
    def generate(prompt_ids: tuple[int, ...], k: int, max_tokens: int, early_stopping, length_penalty: float,
                 ignore_eos: bool = False):
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt_ids]), num_beams=k, num_return_sequences=k, do_sample=False,
                                    max_new_tokens=max_tokens, early_stopping=early_stopping,
                                    length_penalty=length_penalty, output_scores=True, return_dict_in_generate=True,
                                    pad_token_id=2, **({"eos_token_id": None} if ignore_eos else {}))
        return [(row[len(prompt_ids):].tolist(), score) for row, score in zip(out.sequences, out.sequences_scores.tolist())]
    return generate


def same_tokens(ours: list[int], theirs: list[int], pad: int = 2) -> bool:
    """transformers pads shorter beams to the longest (SmolLM2's pad is its EOS)."""
    return theirs[:len(ours)] == ours and all(t == pad for t in theirs[len(ours):])


@pytest.mark.parametrize("k, max_tokens, early_stopping, length_penalty", [
    (2, 24, False, 1.0), (4, 16, True, 1.0), (4, 20, "never", 0.5)])
def test_beams_equal_transformers(llm, tokenizer, hf_beams, k, max_tokens, early_stopping, length_penalty):
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, early_stopping=early_stopping,
                              length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = tokenizer(prompt).input_ids
        expected = hf_beams(tuple(prompt_ids), k, max_tokens, early_stopping, length_penalty)
        assert len(output.sequences) == k
        for sequence, (tokens, score) in zip(output.sequences, expected):
            assert sequence.tokens[:len(prompt_ids)] == prompt_ids
            generated = sequence.tokens[len(prompt_ids):]
            assert same_tokens(generated, tokens), (prompt, generated, tokens)
            assert sequence.score == pytest.approx(score, abs=1e-4)
            assert sequence.text == tokenizer.decode([t for t in generated if t != 2], skip_special_tokens=True)
            assert sequence.finish_reason == ("stop" if generated[-1] == 2 else "length")
            assert len(sequence.logprobs) == len(generated)
            assert sequence.cum_logprob == pytest.approx(sum(entry[t].logprob for entry, t in
                                                             zip(sequence.logprobs, generated)), abs=1e-4)


def test_ignore_eos_and_a_token_id_prompt(llm, tokenizer, hf_beams):
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    output, = llm.beam_search([prompt_ids], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    expected = hf_beams(tuple(prompt_ids), 3, 12, False, 1.0, ignore_eos=True)
    assert [s.tokens[len(prompt_ids):] for s in output.sequences] == [tokens for tokens, _ in expected]
    assert all(s.finish_reason == "length" for s in output.sequences)


def test_beams_share_prompt_blocks(llm, tokenizer):
    """Every step after the first finds the prompt's full blocks cached: the prefix cache counts
    a hit for each beam of each later step."""
    prompt = " ".join(["word"] * 70)  # several full blocks
    metrics = lambda: {m.name: m.value for m in llm.get_metrics()}  # noqa: E731
    before = metrics()
    k, steps = 3, 6
    llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=steps, ignore_eos=True))
    after = metrics()
    num_prompt = len(tokenizer(prompt).input_ids)
    queries = after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"]
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    full_prompt_blocks = num_prompt // 16 * 16
    assert queries >= num_prompt + (steps - 1) * k * num_prompt
    assert hits >= (steps - 1) * k * full_prompt_blocks  # each later beam request: the prompt's full blocks


def test_bad_beam_parameters_are_named():
    with pytest.raises(EngineError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(EngineError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


def test_too_long_a_request_is_refused(llm):
    with pytest.raises(EngineError, match="maximum context length"):
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=llm.llm_engine.max_model_len))


# -- served: tritonclient and the openai SDK against one `tritonllm serve` -------------------------
@pytest.fixture(scope="module")
def serve(tmp_path_factory, model_path):
    from tests.utils.serve import Serve
    with Serve(model_path, tmp_path_factory.mktemp("beam_serve"), kv_cache_bytes=128 << 20,
               max_model_len=MAX_MODEL_LEN, start_timeout=300, stop_timeout=60) as served:
        yield served


def triton_beams(serve, prompt: str, params: dict, **flags):
    from tests.utils.triton import Stream, make_inputs
    stream = Stream(serve.grpc_url)
    try:
        stream.send(make_inputs(prompt, params, **flags))
        return stream.collect()
    finally:
        stream.close()


def test_triton_beam_width_returns_the_n_best_beams(serve, llm):
    prompt = PROMPTS[1]
    offline, = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=16))
    responses = triton_beams(serve, prompt, {"beam_width": 4, "n": 2, "max_tokens": 16},
                             exclude_input_in_output=True, return_cumulative_logprob=True, return_finish_reason=True)
    assert len(responses) == 1
    result = responses[0]
    texts = [t.decode() for t in result.as_numpy("text_output")]
    assert texts == [s.text for s in offline.sequences[:2]]
    assert result.as_numpy("cumulative_logprob").tolist() == pytest.approx(
        [s.cum_logprob for s in offline.sequences[:2]], abs=1e-4)
    assert [r.decode() for r in result.as_numpy("finish_reason")] == [s.finish_reason for s in offline.sequences[:2]]
    # use_beam_search (vLLM's spelling): beam_width defaults to n
    responses = triton_beams(serve, prompt, {"use_beam_search": True, "n": 4, "max_tokens": 16},
                             exclude_input_in_output=True)
    assert [t.decode() for t in responses[-1].as_numpy("text_output")] == [s.text for s in offline.sequences]


@pytest.mark.parametrize("params, flags, message", [
    ({"beam_width": 2, "n": 3}, {}, "n: must be at most beam_width"),
    ({"use_beam_search": True, "n": 2}, {"stream": True}, "beam search is not streamed"),
    ({"length_penalty": 0.5}, {}, "needs use_beam_search"),
])
def test_triton_bad_beam_requests_are_invalid_arg(serve, params, flags, message):
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException, match=message):
        triton_beams(serve, "Hello", {"max_tokens": 4, **params}, **flags)


def test_openai_completions_use_beam_search(serve, llm, model_path):
    import openai
    from openai import OpenAI
    from tests.utils.serve import API_KEY
    client = OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    model = model_path.rstrip("/").split("/")[-1]
    offline = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=16, length_penalty=0.5))
    response = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=16, n=2, temperature=0,
                                         extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5})
    assert [c.text for c in response.choices] == [s.text for o in offline for s in o.sequences[:2]]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    with pytest.raises(openai.BadRequestError, match="beam search is not streamed") as error:
        client.completions.create(model=model, prompt="Hi", max_tokens=4, stream=True,
                                  extra_body={"use_beam_search": True})
    assert error.value.body["param"] == "use_beam_search"


def test_async_beam_search_matches_offline_and_abort_frees_blocks(model_path, llm):
    """The driver the Triton model uses (AsyncBeamSearch on an AsyncLLMEngine): the same beams as
    LLM.beam_search; aborted mid-way, it ends with an error and leaves no request or block behind."""
    import queue

    from backend import AsyncLLMEngine, EngineConfig
    from backend.engine.beam_search import AsyncBeamSearch, BeamSearchOutput
    engine = AsyncLLMEngine(EngineConfig.from_dict({"model": model_path, "dtype": "float32",
                                                    "kv_cache_memory_bytes": 64 << 20}))
    try:
        prompt_ids = engine.tokenizer(PROMPTS[2]).input_ids
        params = BeamSearchParams(beam_width=3, max_tokens=12)
        results: queue.Queue = queue.Queue()
        AsyncBeamSearch(engine, "whole", prompt_ids, params, results.put).start()
        result = results.get(timeout=600)
        assert isinstance(result, BeamSearchOutput)
        offline, = llm.beam_search([prompt_ids], params)
        assert [s.tokens for s in result.sequences] == [s.tokens for s in offline.sequences]

        search = AsyncBeamSearch(engine, "aborted", prompt_ids, BeamSearchParams(beam_width=4, max_tokens=200,
                                                                                 ignore_eos=True), results.put)
        search.start()
        deadline = time.monotonic() + 600
        while search.num_steps < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        search.abort()
        assert isinstance(results.get(timeout=600), Exception)
        while engine.num_unfinished_requests() or engine.engine.num_used_blocks():
            assert time.monotonic() < deadline, "an aborted beam search left requests or blocks behind"
            time.sleep(0.05)
    finally:
        engine.shutdown()
