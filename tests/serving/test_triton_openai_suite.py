"""Triton's own OpenAI frontend tests (triton-inference-server/server, python/openai/tests:
test_completions.py, test_chat_completions.py, test_observability.py), run against ours.

Ported with their assertions, on our `tritonllm serve` fixture (test_openai_frontend.py) with
SmolLM2 in place of their Llama, and `max_tokens` bounded where theirs leave it open (a CPU
generating to the context's end would take minutes). Where that frontend's tests encode its own
choices against OpenAI's, these assert OpenAI's and docs/openai.md lists the difference
("Compared with Triton's OpenAI frontend"): validation errors are 400 with OpenAI's error envelope,
not FastAPI's 422; n > 1 and logit_bias work; `logprobs: 0` returns the sampled tokens' logprobs
with empty top_logprobs; models are owned by "tritonllm"; /metrics is the frontend's own.
"""

from __future__ import annotations


import httpx
import pytest

from tests.utils.serve import AUTH, Serve

PROMPT = "What is machine learning?"
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 16  # theirs: unbounded
START_TIMEOUT_S = 900  # two models load on a shared CPU


@pytest.fixture(scope="module")
def serve(tmp_path_factory, model_path):
    """`tritonllm serve` (Triton with the llm and embeddings models, and the frontend), as
    test_openai_frontend.py starts it."""
    with Serve(model_path, tmp_path_factory.mktemp("suite"), kv_cache_bytes=128 << 20,
               start_timeout=START_TIMEOUT_S, stop_timeout=120) as served:
        yield served


@pytest.fixture(scope="module")
def client(serve):
    with httpx.Client(base_url=serve.url, headers=AUTH, timeout=300) as http:
        yield http


def completion(client, model: str, **body) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, **body})


def chat(client, model: str, **body) -> httpx.Response:
    return client.post("/v1/chat/completions",
                       json={"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **body})


def assert_openai_400(response: httpx.Response, param: str | None = None) -> None:
    """OpenAI's answer to a bad field: 400 and {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def words(response: httpx.Response, key: str = "text") -> list[str]:
    choice = response.json()["choices"][0]
    return (choice["text"] if key == "text" else choice["message"]["content"]).strip().split()


# -- test_completions.py ---------------------------------------------------------------------------
def test_completions_defaults(client, model_name):
    response = completion(client, model_name, temperature=0)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"].strip()
    assert response.json().get("usage") is not None


@pytest.mark.parametrize("sampling_parameter, value", [
    ("temperature", 0.7), ("max_tokens", 10), ("top_p", 0.9), ("frequency_penalty", 0.5),
    ("presence_penalty", 0.2), ("n", 1), ("logprobs", 5),
    ("logit_bias", {"0": 0}),  # theirs: 400 "logit bias is not supported"; OpenAI and we accept it
    ("min_tokens", 16), ("ignore_eos", True)])
def test_completions_sampling_parameters(client, model_name, sampling_parameter, value):
    response = completion(client, model_name, **{"temperature": 0, sampling_parameter: value})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].strip()


def test_completions_max_tokens(client, model_name):
    # A prompt whose next token is a word: SmolLM2 continues theirs with a line break, no word at all.
    prompt = "The capital of France is"
    one = [completion(client, model_name, prompt=prompt, temperature=0, max_tokens=1) for _ in range(2)]
    longer = completion(client, model_name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    for response in [*one, longer]:
        assert response.status_code == 200
    assert len(words(one[0])) == len(words(one[1])) == 1
    assert len(words(longer)) > len(words(one[0]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_temperature_vllm(client, model_name, temperature):
    responses = [completion(client, model_name, temperature=temperature) for _ in range(2)]
    assert all(r.status_code == 200 for r in responses)
    if temperature == 0.0:
        assert words(responses[0]) == words(responses[1])
    else:
        assert words(responses[0]) != words(responses[1])


def test_completions_seed(client, model_name):
    responses = [completion(client, model_name, seed=seed, temperature=1.0) for seed in (1, 1, 2)]
    assert all(r.status_code == 200 for r in responses)
    assert words(responses[0]) == words(responses[1])
    assert words(responses[0]) != words(responses[2])


INVALID_SAMPLING = [("temperature", 2.1), ("temperature", -0.1), ("max_tokens", -1), ("top_p", 1.1),
                    ("frequency_penalty", 3), ("frequency_penalty", -3), ("presence_penalty", 2.1),
                    ("presence_penalty", -2.1), ("min_tokens", -1), ("ignore_eos", 123)]


@pytest.mark.parametrize("sampling_parameter, value", INVALID_SAMPLING)
def test_completions_invalid_sampling_parameters(client, model_name, sampling_parameter, value):
    assert_openai_400(completion(client, model_name, **{sampling_parameter: value}), sampling_parameter)  # theirs: 422


def test_completions_empty_request_no_model_no_prompt(client, model_name):
    for body in ({}, {"prompt": PROMPT}, {"model": model_name}):
        assert_openai_400(client.post("/v1/completions", json=body))  # theirs: 422


def test_completions_empty_prompt(client, model_name):
    assert_openai_400(completion(client, model_name, prompt=""), "prompt")


@pytest.mark.parametrize("sampling, error", [
    ({"n": 2}, None), ({"best_of": 2}, None), ({"n": 2, "best_of": 2}, None),
    ({"n": 2, "best_of": 1}, "best_of")])
def test_completions_multiple_choices(client, model_name, sampling, error):
    """Theirs: 400 "only single choice" for every case; OpenAI (and we) serve n and best_of, and
    refuse best_of < n."""
    response = completion(client, model_name, temperature=1.0, max_tokens=4, **sampling)
    if error is not None:
        return assert_openai_400(response, error)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == sampling.get("n", 1)


@pytest.mark.parametrize("echo", [False, True])
def test_echo(client, model_name, echo):
    text = completion(client, model_name, temperature=0, echo=echo).json()["choices"][0]["text"].strip()
    if echo:
        assert text.startswith(PROMPT)
    else:
        assert PROMPT not in text


def test_usage_response(client, model_name):
    response = completion(client, model_name)
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert all(isinstance(usage[key], int) for key in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completions_logprobs(client, model_name):
    response = completion(client, model_name, logprobs=3, max_tokens=10)
    assert response.status_code == 200
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs is not None
    num_tokens = len(logprobs["tokens"])
    for key in ("text_offset", "token_logprobs", "top_logprobs"):
        assert isinstance(logprobs[key], list) and len(logprobs[key]) == num_tokens
    for i in range(num_tokens):
        assert isinstance(logprobs["tokens"][i], str)
        assert isinstance(logprobs["token_logprobs"][i], (int, float))
        assert isinstance(logprobs["text_offset"][i], int)
        assert isinstance(logprobs["top_logprobs"][i], dict)
        for token, logprob in logprobs["top_logprobs"][i].items():
            assert isinstance(token, str) and isinstance(logprob, (int, float))


def test_completions_logprobs_zero(client, model_name):
    """Theirs: logprobs 0 returns no logprobs. OpenAI's (and ours): each sampled token's logprob,
    with empty top_logprobs."""
    response = completion(client, model_name, logprobs=0, max_tokens=10, temperature=0)
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == response.json()["usage"]["completion_tokens"]
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"])
    assert logprobs["top_logprobs"] == [{}] * len(logprobs["tokens"])
    assert "".join(logprobs["tokens"]) == choice["text"]


def test_completions_logprobs_validation(client, model_name):
    response = completion(client, model_name, logprobs=7, max_tokens=5)
    assert_openai_400(response, "logprobs")  # theirs: 422
    assert "less than or equal to 5" in response.json()["error"]["message"]


# -- test_chat_completions.py ----------------------------------------------------------------------
@pytest.mark.parametrize("messages", [
    MESSAGES,
    [{"role": "system", "content": "You are a helpful assistant."}, *MESSAGES],
    [{"role": "system", "content": "You are a helpful assistant."}],
    [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]])
def test_chat_completions_prompts(client, model_name, messages):
    response = chat(client, model_name, messages=messages, temperature=0)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"].strip() and message["role"] == "assistant"
    assert response.json().get("usage") is not None


@pytest.mark.parametrize("param_key, param_value", [
    ("temperature", 0.7), ("max_tokens", 10), ("max_completion_tokens", 10), ("top_p", 0.9),
    ("frequency_penalty", 0.5), ("presence_penalty", 0.2), ("n", 1), ("stop", "."), ("stop", []),
    ("stop", [".", ","]), ("logprobs", True), ("logit_bias", {"0": 0}), ("min_tokens", 16),
    ("ignore_eos", True)])
def test_chat_completions_sampling_parameters(client, model_name, param_key, param_value):
    response = chat(client, model_name, **{"temperature": 0, param_key: param_value})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("param_key, param_value", [*INVALID_SAMPLING, ("max_completion_tokens", -1)])
def test_chat_completions_invalid_sampling_parameters(client, model_name, param_key, param_value):
    assert_openai_400(chat(client, model_name, **{param_key: param_value}), param_key)  # theirs: 422


@pytest.mark.parametrize("max_tokens_key", ["max_tokens", "max_completion_tokens"])
def test_chat_completions_max_tokens(client, model_name, max_tokens_key):
    one = [chat(client, model_name, temperature=0, **{max_tokens_key: 1}) for _ in range(2)]
    longer = chat(client, model_name, temperature=0, **{max_tokens_key: MAX_TOKENS})
    assert all(r.status_code == 200 for r in [*one, longer])
    assert len(words(one[0], "message")) == len(words(one[1], "message")) == 1
    assert len(words(longer, "message")) > len(words(one[0], "message"))


def test_chat_completions_max_completion_tokens_precedence(client, model_name):
    response = chat(client, model_name, temperature=0, max_tokens=MAX_TOKENS, max_completion_tokens=1)
    assert response.status_code == 200
    assert len(words(response, "message")) == 1


def test_chat_completions_seed(client, model_name):
    responses = [chat(client, model_name, seed=seed, temperature=1.0) for seed in (1, 1, 2)]
    assert all(r.status_code == 200 for r in responses)
    assert words(responses[0], "message") == words(responses[1], "message")
    assert words(responses[0], "message") != words(responses[2], "message")


def test_chat_completions_no_or_empty_message(client, model_name):
    for messages in ([], [{}]):
        assert_openai_400(chat(client, model_name, messages=messages))  # theirs: 422


def test_chat_completions_multiple_choices(client, model_name):
    response = chat(client, model_name, n=2, temperature=1.0, max_tokens=4)  # theirs: 400 "only single choice"
    assert response.status_code == 200
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]


def test_chat_completions_logprobs(client, model_name):
    response = chat(client, model_name, logprobs=True, top_logprobs=3, max_tokens=10)
    assert response.status_code == 200
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert isinstance(content, list) and len(content) > 0
    for token_logprob in content:
        assert isinstance(token_logprob["token"], str)
        assert isinstance(token_logprob["logprob"], (int, float))
        assert isinstance(token_logprob["bytes"], list)
        assert isinstance(token_logprob["top_logprobs"], list)
        for top in token_logprob["top_logprobs"]:
            assert {"token", "logprob", "bytes"} <= set(top)


def test_chat_completions_logprobs_false(client, model_name):
    response = chat(client, model_name, logprobs=False, max_tokens=10)
    assert response.status_code == 200
    assert response.json()["choices"][0].get("logprobs") is None


@pytest.mark.parametrize("top_logprobs_value", [0, 5])
def test_chat_completions_top_logprobs_without_logprobs(client, model_name, top_logprobs_value):
    response = chat(client, model_name, top_logprobs=top_logprobs_value, max_tokens=10)
    assert_openai_400(response, "top_logprobs")
    assert "logprobs" in response.json()["error"]["message"]


def test_chat_completions_top_logprobs_validation(client, model_name):
    response = chat(client, model_name, logprobs=True, top_logprobs=25, max_tokens=5)
    assert_openai_400(response, "top_logprobs")  # theirs: 422
    assert "less than or equal to 20" in response.json()["error"]["message"]


# -- vLLM's truncate_prompt_tokens (an extra both vLLM frontends take) -----------------------------
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, model_name):
    long_prompt = "one two three four five six seven eight nine ten " * 4
    full = completion(client, model_name, prompt=long_prompt, temperature=0, max_tokens=4).json()
    cut = completion(client, model_name, prompt=long_prompt, temperature=0, max_tokens=4, truncate_prompt_tokens=5).json()
    assert full["usage"]["prompt_tokens"] > 5 and cut["usage"]["prompt_tokens"] == 5
    response = chat(client, model_name, temperature=0, max_tokens=4, truncate_prompt_tokens=3)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 3
    assert_openai_400(completion(client, model_name, truncate_prompt_tokens=0), "truncate_prompt_tokens")
    assert_openai_400(completion(client, model_name, truncate_prompt_tokens=10**6), "truncate_prompt_tokens")


# -- test_observability.py -------------------------------------------------------------------------
def test_not_found(client):
    assert client.get("/does-not-exist").status_code == 404


def test_startup_success(client):
    assert client.get("/health/ready").status_code == 200


def test_startup_metrics(client):
    """Theirs looks for Triton's nv_cpu_utilization (their frontend runs Triton in-process); ours
    serves the frontend's own metrics, Triton's (nv_*, vllm:*) being on Triton's metrics port."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "tritonllm_frontend_requests_in_flight" in response.text
    assert "tritonllm_frontend_replica_ready" in response.text


def test_models_list(client, model_name):
    response = client.get("/v1/models")
    assert response.status_code == 200
    models = response.json()["data"]
    assert len(models) == 2  # the LLM and the embeddings model, as their two test models
    for model in models:
        assert model["id"]
        assert model["object"] == "model"
        assert model["created"] > 0
        assert model["owned_by"] == "tritonllm"  # theirs: "Triton Inference Server"


def test_models_get(client, model_name):
    response = client.get(f"/v1/models/{model_name}")
    assert response.status_code == 200
    card = response.json()
    assert card["id"] == model_name and card["object"] == "model" and card["created"] > 0
    assert card["owned_by"] == "tritonllm"
