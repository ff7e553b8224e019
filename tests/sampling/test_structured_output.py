"""Structured outputs on the real model: JSON schemas, regex, choice, EBNF grammars and json_object
hold greedy and seeded sampling alike, with n > 1, batch mates and preemption; bad specs are refused
when the request is added, and a huge one compiles without holding up other requests. The OpenAI side (response_format, structured_outputs, the 400s) runs
against a real `tritonllm serve` through the official SDK."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest

from backend import LLM, SamplingParams
from backend.errors import EngineError, parse_wire
from backend.sampling_params import StructuredOutputsParams
from tests.utils.models import BLOCK_BYTES_FP32
from tests.utils.serve import API_KEY

pytestmark = pytest.mark.usefixtures("no_request_left_running")

INT = lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}  # noqa: E731
STR = lambda n: {"type": "string", "maxLength": n}  # noqa: E731


def obj(required: list[str] | None = None, **properties) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required}


# Bounded (maxLength, maxItems, ranges), so that even a wandering 135M model must finish in 200 tokens.
SCHEMAS = {
    "person": obj(name=STR(20), age=INT(0, 120)),
    "nested address": obj(name=STR(20), address=obj(city=STR(20), zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    "bounded numbers": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10},
                        "minItems": 1, "maxItems": 4},
    "enum": obj(color={"enum": ["red", "green", "blue"]}),
    "boolean and null": obj(ok={"type": "boolean"}, note={"type": "null"}),
    "optional field": obj(["title"], title=STR(15), subtitle=STR(10)),
    "date pattern": obj(date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}),
    "bounded integer": INT(1, 100),
    "const": obj(version={"const": 2}, name=STR(8)),
    "anyOf": {"anyOf": [STR(10), INT(0, 9)]},
    "array of objects": {"type": "array", "items": obj(id=INT(0, 999), done={"type": "boolean"}), "maxItems": 3},
    "string enum": {"type": "string", "enum": ["yes", "no", "maybe"]},
    "refs": {"$defs": {"point": obj(x=INT(-100, 100), y=INT(-100, 100))}, "type": "object",
             "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"]},
    "matrix": {"type": "array", "items": {"type": "array", "items": INT(0, 9), "maxItems": 3}, "maxItems": 3},
    "string length": {"type": "string", "minLength": 3, "maxLength": 12},
    "product": obj(title=STR(30), price={"type": "number", "minimum": 0, "maximum": 1000},
                   in_stock={"type": "boolean"}, rating=INT(1, 5)),
    "nullable": obj(nickname={"type": ["string", "null"], "maxLength": 10}),
    "deep nesting": obj(a=obj(b=obj(c=obj(d=INT(0, 9))))),
    "oneOf shapes": {"oneOf": [obj(kind={"const": "circle"}, r=INT(1, 10)),
                               obj(kind={"const": "square"}, side=INT(1, 10))]},
    "tags": obj(tags={"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                count=INT(0, 3)),
}
CHOICES = ["red", "green", 'bl"ue é']  # quotes and non-ASCII must survive the grammar


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def schema_prompt(tokenizer, name: str) -> list[int]:
    return chat_prompt(tokenizer, f"Answer in JSON ({name}), following this schema: {json.dumps(SCHEMAS[name])}")


def json_params(schema: dict, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


def assert_valid(output, schema: dict) -> None:
    assert output.finish_reason == "stop", (output.finish_reason, output.text)
    jsonschema.validate(json.loads(output.text), schema)


def test_twenty_json_schemas_always_validate_greedy_and_seeded(llm, tokenizer):
    prompts, params, schemas = [], [], []
    for seed, (name, schema) in enumerate(SCHEMAS.items()):
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=seed)):
            prompts.append(schema_prompt(tokenizer, name))
            params.append(json_params(schema, **sampling))
            schemas.append(schema)
    assert len(SCHEMAS) == 20
    for output, schema in zip(llm.generate(prompts, params), schemas):
        assert_valid(output.outputs[0], schema)


def test_json_schema_with_n_samples_and_unconstrained_batch_mates(llm, tokenizer):
    """Masks stay in their rows: an unconstrained request's tokens and a constrained one's do not
    depend on their batch mates; each of n samples follows the schema on its own."""
    schema, prompt = SCHEMAS["person"], schema_prompt(tokenizer, "person")
    plain_prompt = "The capital of France is"
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([plain_prompt], plain)[0].outputs[0].token_ids
    greedy_alone = llm.generate([prompt], json_params(schema, temperature=0))
    outputs = llm.generate([plain_prompt, prompt, prompt], [plain, json_params(schema, temperature=0),
                                                             json_params(schema, n=3, temperature=1.0, seed=7)])
    assert outputs[0].outputs[0].token_ids == alone
    assert outputs[1].outputs[0].token_ids == greedy_alone[0].outputs[0].token_ids
    assert_valid(outputs[1].outputs[0], schema)
    samples = outputs[2].outputs
    assert len(samples) == 3 and len({s.text for s in samples}) > 1
    for sample in samples:
        assert_valid(sample, schema)


def test_regex_choice_and_grammar_are_obeyed(llm):
    regex = r"(yes|no), because [a-z ]{5,30}\."
    grammar = 'root ::= "(" num " + " num ") = " num\nnum ::= [1-9] [0-9]?'
    specs = [dict(regex=regex), dict(choice=CHOICES), dict(grammar=grammar)]
    prompts = ["Is the sky blue? Answer:", "My favourite colour is", "A sum:"]
    greedy = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=60, structured_outputs=s) for s in specs])
    sampled = llm.generate(prompts, [SamplingParams(temperature=1.2, n=4, seed=3, max_tokens=60, structured_outputs=s)
                                     for s in specs])
    patterns = [regex, "|".join(map(re.escape, CHOICES)), r"\([1-9][0-9]? \+ [1-9][0-9]?\) = [1-9][0-9]?"]
    for pattern, one, many in zip(patterns, greedy, sampled):
        for sample in one.outputs + many.outputs:
            assert sample.finish_reason == "stop" and re.fullmatch(pattern, sample.text), sample.text
    assert len({s.text for s in sampled[1].outputs}) > 1  # choice samples, not always the same


def test_json_object_yields_a_json_object(llm, tokenizer):
    prompt = chat_prompt(tokenizer, 'Reply with a JSON object with the keys "city" and "country" for Paris.')
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json_object": True})
    output = llm.generate([prompt], params)[0].outputs[0]
    assert output.finish_reason == "stop" and isinstance(json.loads(output.text), dict), output.text


def test_the_grammar_ends_the_request_even_past_eos_rules(llm):
    """A finished grammar finishes the request: with ignore_eos, and before min_tokens."""
    for extra in (dict(ignore_eos=True), dict(min_tokens=20)):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": ["yes", "no"]}, **extra)
        output = llm.generate(["Is water wet?"], params)[0].outputs[0]
        assert output.finish_reason == "stop" and output.text in ("yes", "no"), (extra, output.text)


def test_logprobs_follow_the_mask(llm):
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=8, structured_outputs={"choice": ["yes", "no"]})
    output = llm.generate(["Is water wet?"], params)[0].outputs[0]
    first = output.logprobs[0]
    assert first[output.token_ids[0]].rank == 1
    allowed = [entry.decoded_token for entry in first.values() if entry.logprob > float("-inf")]
    assert allowed and all("yes".startswith(token) or "no".startswith(token) for token in allowed), allowed
    assert len(allowed) < len(first)  # the rest of the top 8 are -inf


@pytest.mark.slow
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_requests_keep_their_grammar(model_path, llm, tokenizer, preemption_mode):
    """A KV cache too small for the batch preempts requests mid-JSON; their tokens match an
    unpreempted run and every answer still validates (no token fed twice to a matcher)."""
    names = ["person", "product", "refs", "nested address", "tags", "array of objects"]
    prompts = [schema_prompt(tokenizer, name) for name in names]
    params = [json_params(SCHEMAS[name], temperature=0) for name in names]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = LLM(model_path, dtype="float32", kv_cache_memory_bytes=36 * BLOCK_BYTES_FP32, swap_space=0.1,
                preemption_mode=preemption_mode, enable_prefix_caching=False)
    outputs = small.generate(prompts, params)
    preemptions = {m.name: m.value for m in small.get_metrics()}["vllm:num_preemptions"]
    assert preemptions > 0, "the KV budget was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outputs] == reference
    for output, name in zip(outputs, names):
        assert_valid(output.outputs[0], SCHEMAS[name])


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "objekt"}), "invalid JSON schema"),
    (dict(json={"type": "string", "pattern": "["}), "invalid JSON schema"),
    (dict(regex="a(b"), "invalid regex"),
    (dict(grammar="root ::= missing_rule"), "invalid grammar"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(), "exactly one"),
    (dict(choice=[]), "choice must be"),
    (dict(jsn={"type": "object"}), "unknown key\\(s\\) jsn"),
])
def test_bad_specs_are_refused_when_added(llm, spec, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=message) as error:
        engine.add_request("bad", "Hi", SamplingParams(structured_outputs=spec))
    assert str(error.value).startswith("structured_outputs: ")
    assert not engine.has_unfinished_requests()


def test_compiled_grammars_are_cached(llm):
    grammars = llm.llm_engine.grammars
    first = grammars.compile(StructuredOutputsParams(json=SCHEMAS["refs"]))
    assert grammars.compile(StructuredOutputsParams(json=json.dumps(SCHEMAS["refs"]))) is first
    assert grammars.compile(StructuredOutputsParams(json=SCHEMAS["refs"], disable_any_whitespace=True)) is not first


def test_an_unconstrained_batch_never_loads_the_grammar_library():
    code = ("import sys, torch\n"
            "from backend import SamplingParams\nfrom backend.core.request import Request\n"
            "from backend.sampling.sampler import Sampler\n"
            "requests = [Request(str(i), None, [1, 2], SamplingParams(temperature=t)) for i, t in enumerate((0, 1))]\n"
            "Sampler()(torch.randn(2, 64), requests)\n"
            "assert 'xgrammar' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the OpenAI API ------------------------------------------------------------------------------
def test_response_format_json_schema_through_the_sdk(client, model_name):
    schema = SCHEMAS["person"]
    response = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=100,
        messages=[{"role": "user", "content": "Describe a person in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=100, stream=True,
        messages=[{"role": "user", "content": "Describe a person in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content


def test_completions_take_response_format_and_structured_outputs(client, model_name):
    by_format = client.completions.create(model=model_name, prompt="Some JSON:", max_tokens=100, temperature=0,
                                          extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(by_format.choices[0].text), dict)
    by_choice = client.completions.create(model=model_name, prompt="The best colour is", max_tokens=10, n=3,
                                          seed=5, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in by_choice.choices)
    by_regex = client.chat.completions.create(
        model=model_name, max_tokens=20, messages=[{"role": "user", "content": "A date?"}],
        extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", by_regex.choices[0].message.content)


@pytest.mark.parametrize("endpoint, changes, param, message", [
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format", "invalid JSON schema"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "needs `schema`"),
    ("chat/completions", {"stream": True, "structured_outputs": {"regex": "a(b"}}, "structured_outputs",
     "invalid regex"),
    ("completions", {"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "invalid grammar"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "not both"),
])
def test_bad_structured_outputs_are_400(serve, model_name, endpoint, changes, param, message):
    body = {"model": model_name, "max_tokens": 5, **changes}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if endpoint.startswith("chat") else {"prompt": "Hi"})
    response = httpx.post(f"{serve.url}/v1/{endpoint}", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and message in error["message"]


def test_sdk_raises_bad_request_for_a_bad_schema(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_name, max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}})


# -- a grammar's cost falls on its own request -----------------------------------------------------
def test_a_huge_choice_list_compiles_off_the_step_path(llm):
    """8,000 choices (about 180 KB) take seconds to compile: the engine keeps stepping a concurrent
    greedy request meanwhile, each step (the add included) within a second of the slowest decode
    step without a compilation (before it and after), and the huge request waits in the queue, then
    answers with one of its choices (or, on a machine too busy to compile it in time, a clear error)."""
    engine = llm.llm_engine
    choices = [f"option number {i}" for i in range(8000)]
    engine.add_request("greedy", "The capital of France is",
                       SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))

    def timed(call):
        started = time.monotonic()
        result = call()
        return time.monotonic() - started, result

    engine.step()  # the prompt
    usual = [timed(engine.step)[0] for _ in range(12)]
    add_seconds, _ = timed(lambda: engine.add_request(
        "huge", "Pick one option:", SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": choices})))
    compiled = engine.grammars.submit(StructuredOutputsParams(choice=choices))
    while_compiling, final = [add_seconds], None
    while final is None:
        compiling = not compiled.done()
        seconds, outputs = timed(engine.step)
        if compiling:
            assert any(o.request_id == "greedy" for o in outputs)
            while_compiling.append(seconds)
        final = next((o for o in outputs if o.request_id == "huge" and o.finished), None)
    usual += [timed(engine.step)[0] for _ in range(12)]
    engine.abort_request("greedy")
    print(f"\nslowest usual step {max(usual):.3f} s; {len(while_compiling) - 1} steps while the grammar "
          f"compiled, slowest {max(while_compiling):.3f} s (the add: {add_seconds:.3f} s)")
    assert len(while_compiling) > 1, "the grammar compiled before the engine stepped again"
    assert max(while_compiling) - max(usual) < 1.0
    if final.error is None:
        assert final.outputs[0].text in choices
    else:  # a machine too busy to compile it within the bound (compiles run at the lowest priority)
        assert parse_wire(final.error)[:2] == ("invalid_parameter", "structured_outputs"), final.error
        assert "did not compile within" in final.error


def test_oversized_and_slow_grammars_are_refused_with_a_clear_error(llm):
    engine = llm.llm_engine
    too_many = [f"a rather long option, number {i}" for i in range(10000)]  # about 370 KB
    with pytest.raises(EngineError, match="structured_outputs: the spec is .* bytes; at most") as error:
        engine.add_request("oversized", "Hi", SamplingParams(structured_outputs={"choice": too_many}))
    assert error.value.param == "structured_outputs" and not engine.has_unfinished_requests()
    timeout, engine.grammars.compile_timeout_s = engine.grammars.compile_timeout_s, 0.0
    try:
        engine.add_request("slow", "Hi", SamplingParams(structured_outputs={"choice": too_many[:3000]}))
        outputs = engine.step()
    finally:
        engine.grammars.compile_timeout_s = timeout
    assert [o.request_id for o in outputs] == ["slow"] and outputs[0].finished
    code, param, message = parse_wire(outputs[0].error)
    assert (code, param) == ("invalid_parameter", "structured_outputs")
    assert "did not compile within 0 s" in message and not engine.has_unfinished_requests()
