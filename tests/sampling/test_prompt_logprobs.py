"""Prompt logprobs (issue 29, item 1): SamplingParams.prompt_logprobs offline, through the Triton
model (`return_prompt_logprobs`), and echo + logprobs on /v1/completions (max_tokens 0 included),
exact against Hugging Face transformers in float32 whatever the chunking, prefix cache or
preemption. Also /tokenize and /detokenize (item 3)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from backend import LLM, SamplingParams
from tests.utils.prompts import PROMPTS
from tests.utils.models import BLOCK_BYTES_FP32
from tests.utils.serve import AUTH, ServedApp
from tests.utils.triton import generate

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_model):
    """Each prompt position's log_softmax row from transformers (row i scores token i + 1)."""
    def compute(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return compute


def ranks_within_tolerance(row: torch.Tensor, logprob: float) -> range:
    """The ranks a token of this logprob may have: tokens within TOLERANCE of it may sort either way
    (float32 sums in another order move a logprob by ~1e-6, and a vocabulary holds near ties)."""
    return range(int((row > logprob + TOLERANCE).sum()) + 1, int((row > logprob - TOLERANCE).sum()) + 1)


def assert_prompt_logprobs_match(prompt_ids, prompt_logprobs, reference, k: int) -> None:
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for position, (token, entry) in enumerate(zip(prompt_ids[1:], prompt_logprobs[1:]), start=1):
        row = reference[position - 1]
        assert next(iter(entry)) == token, "the prompt's own token comes first"
        assert abs(entry[token].logprob - row[token].item()) < TOLERANCE, (position, entry[token], row[token])
        assert entry[token].rank in ranks_within_tolerance(row, row[token].item())
        top = row.topk(k)
        assert len(entry) in (k, k + 1)
        for logprob, token_id in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[token_id].logprob - logprob) < TOLERANCE
            if token_id != token:
                assert entry[token_id].rank in ranks_within_tolerance(row, logprob)


def test_prompt_logprobs_match_hf(llm, tokenizer, hf_prompt_logprobs):
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:4]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    for ids, output in zip(prompts, outputs):
        assert_prompt_logprobs_match(ids, output.prompt_logprobs, hf_prompt_logprobs(ids), 3)
        second = output.prompt_logprobs[1][ids[1]]
        assert second.decoded_token == tokenizer.decode([ids[1]])


def test_without_prompt_logprobs_there_are_none_and_a_one_token_prompt_has_only_none(llm):
    [plain] = llm.generate(["Hello there"], SamplingParams(max_tokens=1))
    assert plain.prompt_logprobs is None
    [single] = llm.generate([[504]], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert single.prompt_logprobs == [None]


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": "x"})


def test_chunked_prefill_prefix_cache_and_n_give_the_same_numbers(model_path, tokenizer, hf_prompt_logprobs):
    """16-token chunks; the same prompt again (its blocks now cached: recomputed, not read), and
    with n = 2 (one set of prompt logprobs). A plain request still hits the cache afterwards."""
    chunked = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=16,
                  enable_chunked_prefill=True, enable_prefix_caching=True)
    ids = tokenizer(PROMPTS[6] + " " + PROMPTS[16]).input_ids
    assert len(ids) > 40, "the prompt should span several chunks and blocks"
    reference = hf_prompt_logprobs(ids)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    [first] = chunked.generate([ids], params)
    [again] = chunked.generate([ids], params)
    [pair] = chunked.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, n=2))
    for output in (first, again, pair):
        assert_prompt_logprobs_match(ids, output.prompt_logprobs, reference, 2)
        assert output.num_cached_tokens == 0
    assert len(pair.outputs) == 2
    [plain] = chunked.generate([ids], SamplingParams(temperature=0, max_tokens=2))
    assert plain.num_cached_tokens >= 32, "the scored prompts' blocks are in the prefix cache"
    assert chunked.llm_engine.kv_cache.num_free_blocks == chunked.llm_engine.kv_cache.num_blocks


def test_prompt_logprobs_under_preemption(model_path, tokenizer, hf_prompt_logprobs):
    """33 blocks' worth of requests in 24 blocks: some are preempted (recomputed) and score again."""
    small = LLM(model_path, dtype="float32", kv_cache_memory_bytes=24 * BLOCK_BYTES_FP32,
                max_num_batched_tokens=512)
    prompts = [tokenizer(PROMPTS[i]).input_ids for i in (6, 8, 10, 16, 3)]
    outputs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                     prompt_logprobs=1))
    assert {m.name: m.value for m in small.get_metrics()}["vllm:num_preemptions"] > 0
    for ids, output in zip(prompts, outputs):
        assert_prompt_logprobs_match(ids, output.prompt_logprobs, hf_prompt_logprobs(ids), 1)
    assert small.llm_engine.kv_cache.num_free_blocks == 24


# -- through Triton and the OpenAI frontend -------------------------------------------------------
PROMPT = "The quick brown fox jumps over the lazy dog because"


def test_triton_returns_prompt_logprobs(serve, tokenizer, hf_prompt_logprobs):
    """tritonclient, the vLLM backend's tensors plus `return_prompt_logprobs`: JSON, first response."""
    ids = tokenizer(PROMPT).input_ids
    reference = hf_prompt_logprobs(ids)
    responses = generate(serve, ids, {"temperature": 0, "max_tokens": 3, "prompt_logprobs": 2},
                         stream=True, return_prompt_logprobs=True)
    payloads = [json.loads(r.as_numpy("prompt_logprobs")[0]) for r in responses if r.as_numpy("prompt_logprobs")
                is not None]
    assert payloads[0] is not None and all(p is None for p in payloads[1:]), "sent once, in the first response"
    scored = payloads[0]
    assert len(scored) == len(ids) and scored[0] is None
    for position, (token, entry) in enumerate(zip(ids[1:], scored[1:]), start=1):
        assert list(entry)[0] == str(token)
        assert abs(entry[str(token)]["logprob"] - reference[position - 1][token].item()) < TOLERANCE
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
    # The flag alone asks for the prompt tokens' logprobs (no top-N).
    [final] = generate(serve, PROMPT, {"temperature": 0, "max_tokens": 1}, return_prompt_logprobs=True)
    alone = json.loads(final.as_numpy("prompt_logprobs")[0])
    assert [len(entry) for entry in alone[1:]] == [1] * (len(ids) - 1)


def test_completions_echo_logprobs_max_tokens_0(client, model_name, tokenizer, hf_prompt_logprobs):
    """lm-evaluation-harness' loglikelihood request, through the openai SDK."""
    ids = tokenizer(PROMPT).input_ids
    reference = hf_prompt_logprobs(ids)
    response = client.completions.create(model=model_name, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0,
                                         temperature=0)
    [choice] = response.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position, token in enumerate(ids[1:], start=1):
        expected = reference[position - 1]
        assert abs(logprobs.token_logprobs[position] - expected[token].item()) < TOLERANCE
        top = logprobs.top_logprobs[position]
        assert 2 <= len(top) <= 3 and tokenizer.decode([token]) in top
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 0


def test_completions_echo_logprobs_with_generation(client, serve, model_name, tokenizer, hf_prompt_logprobs):
    """Prompt then generated tokens in one logprobs list; streamed, the prompt comes first."""
    ids = tokenizer(PROMPT).input_ids
    response = client.completions.create(model=model_name, prompt=[ids, ids[:5]], echo=True, logprobs=1,
                                         max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    for choice, prompt in zip(response.choices, [ids, ids[:5]]):
        tokens = choice.logprobs.tokens
        assert len(tokens) == len(prompt) + 3
        assert choice.text == tokenizer.decode(prompt) + "".join(tokens[len(prompt):])
        reference = hf_prompt_logprobs(prompt)
        assert abs(choice.logprobs.token_logprobs[-4] - reference[-2][prompt[-1]].item()) < TOLERANCE
    # Streamed: the echoed prompt with its logprobs, then the tokens.
    body = {"model": model_name, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{serve.url}/v1/completions", json=body, headers=AUTH, timeout=120) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(ids)
    streamed = "".join(e["choices"][0]["text"] for e in events[1:])
    unstreamed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert streamed == unstreamed.choices[0].text


def test_completions_max_tokens_0_needs_echo(client, model_name):
    import openai
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0)


# -- /tokenize and /detokenize (issue 29, item 3): the frontend's tokenizer, no Triton needed ------
def test_tokenize_and_detokenize(model_path, tokenizer):
    """vLLM's shapes, through the openai SDK's raw post (it has no typed method for them), on a
    frontend whose Triton is absent: these endpoints never ask it. (/v1/models/{id} is in
    test_openai_frontend.py.)"""
    import openai

    from openai_frontend import Settings
    from tools.triton_server import free_port

    with ServedApp(Settings(grpc_url=f"127.0.0.1:{free_port()}", model=model_path, max_model_len=2048)) as app:
        raw = openai.OpenAI(base_url=app.url, api_key="unused", max_retries=0, timeout=60)
        model = Settings(model=model_path).resolved().served_model_name

        def post(path: str, body: dict) -> dict:
            return raw.post(path, body=body, cast_to=httpx.Response).json()

        ids = tokenizer(PROMPT).input_ids
        answer = post("/tokenize", {"model": model, "prompt": PROMPT, "return_token_strs": True})
        assert answer["tokens"] == ids and answer["count"] == len(ids)
        assert answer["max_model_len"] == 2048 and answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
        assert post("/detokenize", {"model": model, "tokens": ids}) == {"prompt": tokenizer.decode(ids)}
        messages = [{"role": "user", "content": "Hi there"}]
        chat = post("/tokenize", {"model": model, "messages": messages})
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat["tokens"] == tokenizer(expected, add_special_tokens=False).input_ids
        assert chat["token_strs"] is None
        special = post("/tokenize", {"model": model, "messages": messages, "add_special_tokens": True})
        assert special["tokens"] == tokenizer(expected, add_special_tokens=True).input_ids
        bare = post("/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
        for path, body, status, param in [("/tokenize", {"prompt": "x", "messages": messages}, 400, None),
                                          ("/tokenize", {"model": "absent", "prompt": "x"}, 404, None),
                                          ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens")]:
            with pytest.raises(openai.APIStatusError) as error:
                post(path, body)
            assert error.value.status_code == status, (path, body)
            if param:
                assert error.value.param == param
