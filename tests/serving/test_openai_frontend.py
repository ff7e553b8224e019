"""The OpenAI frontend end to end: a real `tritonllm serve` (tritonserver with the `llm` and
`embeddings` models, and the frontend), the official `openai` SDK (sync and async), and raw HTTP
where the SDK hides what we check (SSE framing, error envelopes). Frontends with other settings
(unreachable Triton, a context longer than the engine's) run in-process on uvicorn. Bad-input
matrices, overload, faults and fuzzing are in test_reliability.py."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from openai_frontend import Settings
from openai_frontend.errors import OpenAIError
from openai_frontend.generation import sse_stream
from tests.utils.serve import API_KEY, AUTH, EMBEDDINGS, MAX_MODEL_LEN, ServedApp, engine_load, wait_engine_idle
from tools.triton_server import free_port

pytestmark = pytest.mark.usefixtures("no_request_left_running")


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE body; `[DONE]` kept as the string."""
    events = []
    for block in response.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# -- models, health, version, metrics --------------------------------------------------------------
def test_models_lists_the_llm_and_the_embeddings_model(client, model_name):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {model_name, EMBEDDINGS}
    assert client.models.retrieve(model_name).id == model_name


def test_health_version_and_metrics(serve, client, model_name):
    assert httpx.get(f"{serve.url}/health").status_code == 200
    assert httpx.get(f"{serve.url}/version").json()["version"]
    client.completions.create(model=model_name, prompt="Hi", max_tokens=1)
    metrics = httpx.get(f"{serve.url}/metrics").text
    line = next(line for line in metrics.splitlines()
                if line.startswith("tritonllm_frontend_requests_total") and '"/v1/completions"' in line)
    assert 'status="200"' in line and float(line.split()[-1]) >= 1
    assert 'tritonllm_frontend_request_duration_seconds_count{endpoint="/v1/completions"}' in metrics


# -- chat ----------------------------------------------------------------------------------------------
def test_chat_stream_equals_non_streamed_greedy_text(serve, client, model_name, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    full = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    rendered = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    prompt = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert (choice.finish_reason == "length") == (full.usage.completion_tokens == 24)

    stream = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_sse_framing(serve, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "stream": True, "n": 2, "temperature": 0.8, "seed": 3}
    events = sse_events(httpx.post(f"{serve.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum(1 for c in mine if c["finish_reason"] is not None) == 1
        assert mine[-1]["finish_reason"] in ("stop", "length")


def test_chat_n2_seeded_sampling_is_reproducible(client, model_name):
    def sample():
        return client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Tell me a word."}], n=2,
            temperature=1.0, seed=7, max_completion_tokens=8)

    first, again = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == again.usage.completion_tokens <= 16


def test_chat_logprobs_shape(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Count to five."}], temperature=0,
        max_tokens=6, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True) and token.logprob <= values[0] + 1e-6
        assert token.token == token.top_logprobs[0].token  # greedy picks the most likely
        assert token.bytes == list(token.token.encode())


# -- completions ---------------------------------------------------------------------------------------
def test_completion_usage_is_exact(client, model_name, tokenizer):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    response = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in prompts)
    assert response.usage.completion_tokens == 4 * 5
    for choice in response.choices:
        assert len(tokenizer(choice.text, add_special_tokens=False).input_ids) <= 6


def test_completion_matches_hf_greedy(client, model_name, tokenizer, hf_greedy):
    prompt_ids = tokenizer("Once upon a time, in a small village").input_ids
    response = client.completions.create(model=model_name, prompt=prompt_ids, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
    expected = hf_greedy(tuple(prompt_ids), 16)
    assert response.choices[0].text == tokenizer.decode(expected)
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == 16


def test_completion_stream_echo_and_usage(serve, client, model_name):
    full = client.completions.create(model=model_name, prompt="List three primary colors:", max_tokens=8,
                                     temperature=0, echo=True)
    assert full.choices[0].text.startswith("List three primary colors:")
    chunks = list(client.completions.create(model=model_name, prompt="List three primary colors:", max_tokens=8,
                                            temperature=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage == full.usage
    # vLLM's stream_interval: the first token at once, then every 4 (8 tokens: 3 chunks, not 8).
    sparse = list(client.completions.create(model=model_name, prompt="List three primary colors:", max_tokens=8,
                                            temperature=0, stream=True, extra_body={"stream_interval": 4}))
    pieces = [c.choices[0].text for c in sparse if c.choices and c.choices[0].text]
    assert "".join(pieces) == full.choices[0].text.removeprefix("List three primary colors:")
    assert len(pieces) <= 3


def test_stop_strings(client, model_name):
    prompt = "List three primary colors:"
    free = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = free.split()
    stop = words[len(words) // 2]
    cut = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[:free.index(stop)]
    kept = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == free[:free.index(stop) + len(stop)]


def test_completion_logprobs_shape(client, model_name):
    response = client.completions.create(model=model_name, prompt="The quick brown fox", max_tokens=5,
                                         temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == \
        len(logprobs.text_offset) == response.usage.completion_tokens
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(value)
        assert value == pytest.approx(max(top.values()))


def test_async_client_concurrent_requests(serve, model_name):
    async def run():
        client = AsyncOpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0)
        greedy = dict(model=model_name, temperature=0, max_tokens=10)
        messages = [{"role": "user", "content": "Say hello."}]

        async def streamed() -> str:
            stream = await client.chat.completions.create(messages=messages, stream=True, **greedy)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        chat, text, completion = await asyncio.gather(
            client.chat.completions.create(messages=messages, **greedy), streamed(),
            client.completions.create(prompt="Hello", **greedy))
        await client.close()
        return chat, text, completion

    chat, text, completion = asyncio.run(run())
    assert chat.choices[0].message.content == text
    assert completion.usage.completion_tokens >= 1


def test_bench_openai_runs_start_with_a_cold_prefix_cache(serve, model_name, tokenizer, monkeypatch):
    # `tritonllm bench`'s own OpenAI client, run twice on one server with the same prompts: each
    # run's cache_salt reaches the engine through the frontend, so neither finds the prompts cached.
    from tools.bench import runners
    from tools.bench.workloads import make_workload

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # read as `vllm bench serve` reads it
    workload = make_workload("fixed", tokenizer, 4, 0, 48, 3)
    urls = {"openai": serve.url, "model": model_name, "metrics": serve.metrics_url}
    args = argparse.Namespace(concurrency=[4, 4], client="builtin", request_rate=float("inf"), seed=0, goodput=None)
    results = runners.run_server_mode("openai", urls, args, workload)
    assert [(r["failed"], r["prefix_cache_hit_rate"]) for r in results] == [(0, 0.0), (0, 0.0)]
    assert all(r["output_tokens_per_s"] * r["seconds"] == pytest.approx(12) for r in results)


# -- errors --------------------------------------------------------------------------------------------
ERROR_CASES = [
    # (endpoint, body changes, status, param, code)
    ("chat/completions", {"model": "no-such-model"}, 404, "model", "model_not_found"),
    ("completions", {"model": "no-such-model"}, 404, "model", "model_not_found"),
    ("embeddings", {"model": "no-such-model"}, 404, "model", "model_not_found"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("chat/completions", {"messages": []}, 400, "messages", None),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", None),
    ("chat/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("completions", {"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("chat/completions", {"temperature": -0.5}, 400, "temperature", None),
    ("chat/completions", {"top_p": 0}, 400, "top_p", None),
    ("chat/completions", {"n": 0}, 400, "n", None),
    ("chat/completions", {"max_tokens": 0}, 400, "max_tokens", None),
    ("chat/completions", {"top_logprobs": 2}, 400, "top_logprobs", None),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema", None),
    ("completions", {"logprobs": 21}, 400, "logprobs", None),
    ("completions", {"stream_interval": 0, "stream": True}, 400, "stream_interval", None),
    ("completions", {"min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", None),
    ("completions", {"logit_bias": {"not-a-token": 1}}, 400, "logit_bias", None),
    ("completions", {"logit_bias": {"²": 1}}, 400, "logit_bias", None),
    ("completions", {"logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("completions", {"stop_token_ids": [10**6], "min_tokens": 1}, 400, "stop_token_ids", None),
    ("completions", {"prompt": [10**6]}, 400, "prompt", None),
    ("completions", {"prompt": ""}, 400, "prompt", None),
    ("completions", {"max_tokens": 0}, 400, "max_tokens", None),  # 0 only with echo
    ("completions", {"max_tokens": MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    ("chat/completions", {"max_completion_tokens": MAX_MODEL_LEN}, 400, "messages", "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}, 400, "messages",
     "context_length_exceeded"),
    ("embeddings", {"input": []}, 400, "input", None),
    ("embeddings", {"input": ["a", ""]}, 400, "input", None),
    ("embeddings", {"dimensions": 3}, 400, "dimensions", None),
    ("embeddings", {"encoding_format": "int8"}, 400, "encoding_format", None),
]


def base_body(endpoint: str, model_name: str) -> dict:
    if endpoint == "embeddings":
        return {"model": EMBEDDINGS, "input": "hello"}
    if endpoint == "completions":
        return {"model": model_name, "prompt": "Hello", "max_tokens": 4}
    return {"model": model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.mark.parametrize("endpoint,changes,status,param,code", ERROR_CASES,
                         ids=[f"{e}-{'-'.join(c)}-{s}" for e, c, s, _, _ in ERROR_CASES])
def test_error_envelope(serve, model_name, endpoint, changes, status, param, code):
    body = {**base_body(endpoint, model_name), **changes}
    response = httpx.post(f"{serve.url}/v1/{endpoint}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    if code == "context_length_exceeded":
        assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, ")


def test_context_error_from_the_engine_is_a_400(serve, model_path, model_name):
    """A frontend that believes in a longer context than the engine's: Triton's error is mapped."""
    with ServedApp(Settings(grpc_url=serve.grpc_url, model=model_path)) as loose:
        response = httpx.post(f"{loose.url}/v1/completions", timeout=60, json={
            "model": model_name, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN + 100})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                                           f"However, you requested {MAX_MODEL_LEN + 101} tokens")


def test_sdk_raises_typed_errors(client, serve, model_name):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], n=0)
    assert error.value.body["param"] == "n"
    anonymous = OpenAI(base_url=f"{serve.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_is_required(serve, model_name, headers):
    response = httpx.post(f"{serve.url}/v1/completions", headers=headers,
                          json={"model": model_name, "prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{serve.url}/health").status_code == 200  # outside /v1: open


def test_oversized_body_is_413(serve, model_name):
    body = json.dumps({"model": model_name, "prompt": "x" * (2 << 20)})
    response = httpx.post(f"{serve.url}/v1/completions", content=body, headers=AUTH)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        yield body.encode()

    response = httpx.post(f"{serve.url}/v1/completions", content=chunked(), headers=AUTH)
    assert response.status_code == 413


def test_unreachable_triton_is_503(model_path, model_name):
    with ServedApp(Settings(grpc_url=f"127.0.0.1:{free_port()}", model=model_path)) as orphan:
        client = OpenAI(base_url=f"{orphan.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as error:
            client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}])
        assert error.value.status_code == 503 and error.value.response.headers["retry-after"] == "1"
        assert error.value.body["type"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError):
            client.embeddings.create(model=EMBEDDINGS, input="hi")
        assert httpx.get(f"{orphan.url}/health").status_code == 503


def test_stream_failure_sends_error_event_then_done():
    async def events():
        yield {"choices": []}
        raise OpenAIError(503, "The model is unavailable: the model is being unloaded")

    async def frames():
        return [frame async for frame in sse_stream(events())]

    frames = asyncio.run(frames())
    assert frames[0] == 'data: {"choices":[]}\n\n'
    assert json.loads(frames[1][len("data: "):])["error"]["type"] == "service_unavailable"
    assert frames[2:] == ["data: [DONE]\n\n"]


# -- cancellation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_requests_blocks(serve, model_name, stream):
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(timeout=httpx.Timeout(60, read=3 if not stream else 60), headers=AUTH) as http:
        if stream:
            with http.stream("POST", f"{serve.url}/v1/completions", json=body) as response:
                # Read on until the metrics (updated every 0.5 s) show the request: leaving the loop closes
                # the stream, and 10 tokens can come faster than one update.
                for i, _ in enumerate(response.iter_lines()):
                    if i >= 20:
                        running, usage = engine_load(serve)
                        if (running == 1 and usage > 0) or i == 400:
                            break
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{serve.url}/v1/completions", json=body)
            running, usage = engine_load(serve)
    assert running == 1 and usage > 0  # generating when the client left (1500 tokens take minutes)
    assert wait_engine_idle(serve, timeout=5) == (0, 0)


# -- embeddings ----------------------------------------------------------------------------------------
def test_embeddings_match_sentence_transformers(client):
    from sentence_transformers import SentenceTransformer

    from tools.prepare_embeddings import prepare_embeddings
    texts = ["A man is eating food.", "The new movie is awesome", "Triton serves models over gRPC.",
             "短い日本語の文です。", "word " * 300]  # the last one is truncated to 256 tokens
    reference = SentenceTransformer(str(prepare_embeddings()), device="cpu").encode(texts)
    as_floats = client.embeddings.create(model=EMBEDDINGS, input=texts, encoding_format="float")
    as_base64 = client.embeddings.create(model=EMBEDDINGS, input=texts)  # the SDK asks for base64
    for response in (as_floats, as_base64):
        assert [d.index for d in response.data] == list(range(len(texts)))
        vectors = np.array([d.embedding for d in response.data])
        assert vectors.shape == (len(texts), 384)
        cosine = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)
        assert cosine.min() >= 0.999
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    model = SentenceTransformer(str(prepare_embeddings()), device="cpu")
    tokens = sum(min(len(model.tokenizer(t).input_ids), 256) for t in texts)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == tokens


def test_embeddings_single_string_and_raw_base64(serve):
    response = httpx.post(f"{serve.url}/v1/embeddings", headers=AUTH, json={
        "model": EMBEDDINGS, "input": "hello world", "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(response["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert response["usage"] == {"prompt_tokens": 4, "total_tokens": 4}  # [CLS] hello world [SEP]
    assert response["object"] == "list" and response["data"][0]["object"] == "embedding"
