"""Tool calls in chat: the parsers on whole and streamed text, the conversation rendered through
chat templates with and without tool support, and calls coming back in OpenAI's format through the
official SDK from a real `tritonllm serve` (tool_choice required and named, streamed or not)."""

from __future__ import annotations

import json

import httpx
import pytest

from openai_frontend.prompts import PromptBuilder
from openai_frontend.tool_calls import ToolPlan
from openai_frontend.tool_parsers import PARSERS, HermesParser, JsonParser
from tests.utils.serve import API_KEY, TOOLS, WEATHER

pytestmark = pytest.mark.usefixtures("no_request_left_running")

QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
HERMES_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def streamed(plan: ToolPlan, text: str, piece: int) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of `piece` characters: (content sent, tool-call deltas sent)."""
    stream, deltas = plan.stream(), []
    for start in range(0, len(text), piece):
        deltas += stream.feed(text[start:start + piece])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    return content, [call for d in deltas for call in d.get("tool_calls", [])]


def merged(deltas: list[dict]) -> list[tuple[str, str, str]]:
    """Tool-call deltas put together as a client does: (id, name, arguments) by index."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] not in calls and delta["type"] == "function"  # a call starts once
            calls[delta["index"]] = [delta["id"], delta["function"]["name"], ""]
        calls[delta["index"]][2] += delta["function"].get("arguments") or ""
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[index]) for index in sorted(calls)]


def test_hermes_parser_reads_calls_and_text():
    content, calls = HermesParser().parse(HERMES_ANSWER)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")
    assert HermesParser().parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert HermesParser().parse("no calls, 1 < 2")[1] == []
    cut_short = '<tool_call>\n{"name": "get_time", "parameters": {}}'  # EOS before the closing tag
    assert [c.name for c in HermesParser().parse(cut_short)[1]] == ["get_time"]


# The same two calls (and, where the format has it, text before them) in each format.
ANSWERS = {
    "hermes": ("Let me check.", HERMES_ANSWER),
    "json": ("", '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                 '{"name": "get_time", "arguments": {}}]'),
    "llama3_json": ("", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                        '"celsius"}}; {"name": "get_time", "parameters": {}}'),
    "mistral": ("Let me check.", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": '
                                 '{"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "arguments": {}}]'),
    "mistral_v11": ("", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                        '[TOOL_CALLS]get_time[ARGS]{}'),
    "pythonic": ("", '[get_weather(city="Paris", unit="celsius"), get_time()]'),
}
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_parser_reads_its_format(name):
    parser = PARSERS[name.removesuffix("_v11")]()
    content, calls = parser.parse(ANSWERS[name][1])
    assert content.strip() == ANSWERS[name][0]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert parser.parse("The weather is fine.") == ("The weather is fine.", [])
    written = parser.format_calls([{"name": n, "arguments": a} for n, a in CALLS])
    assert [(c.name, json.loads(c.arguments)) for c in parser.parse(written)[1]] == CALLS  # round trip


@pytest.mark.parametrize("piece", [1, 2, 5, 13, 1000])
@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_streamed_calls_equal_whole_ones_at_any_split(name, piece):
    """Content never carries a piece of a call; each call starts once (id, name), and its argument
    pieces add up to the arguments of the whole answer, at any split of the text."""
    plan = ToolPlan(TOOLS, "auto", PARSERS[name.removesuffix("_v11")](), parallel=True)
    content, deltas = streamed(plan, ANSWERS[name][1], piece)
    assert content.strip() == ANSWERS[name][0]
    whole = plan.read(ANSWERS[name][1])[1]
    assert [(name, arguments) for _, name, arguments in merged(deltas)] == [(c.name, c.arguments) for c in whole]
    assert all(call_id.startswith("call_") for call_id, _, _ in merged(deltas))
    text = "plain answer < with a bracket <tool [TOOL"
    assert streamed(plan, text, piece) == (text, [])  # held back at most, then released at the end


def test_arguments_stream_while_they_are_written():
    """Arguments go out before the call is complete: a piece as soon as a value is whole."""
    plan = ToolPlan(TOOLS, "auto", HermesParser(), parallel=True)
    stream = plan.stream()
    deltas = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert merged([c for d in deltas for c in d["tool_calls"]]) == [(stream.calls[0].id, "get_weather", "{")]
    deltas = stream.feed('ris", "unit": ')
    assert deltas == [{"tool_calls": [{"index": 0, "function": {"arguments": '"city": "Paris"'}}]}]
    assert stream.feed('"cel') == []  # a string is sent once it is closed
    deltas = stream.feed('sius"}}\n</tool_call>') + stream.finish()
    assert "".join(c["function"]["arguments"] for d in deltas for c in d["tool_calls"]) == ', "unit": "celsius"}'
    required = ToolPlan(TOOLS, "required", JsonParser(), parallel=True).stream()
    assert required.feed('[{"name": "get_time", "arguments": {') == [{"tool_calls": [{
        "index": 0, "id": required.calls[0].id, "type": "function", "function": {"name": "get_time",
                                                                                 "arguments": "{"}}]}]


def test_parallel_tool_calls_false_streams_only_the_first_call():
    plan = ToolPlan(TOOLS, "auto", HermesParser(), parallel=False)
    content, deltas = streamed(plan, HERMES_ANSWER, 3)
    assert [name for _, name, _ in merged(deltas)] == ["get_weather"]


def test_json_parser_and_tool_choice_modes():
    parser = JsonParser()
    assert [c.name for c in parser.parse(' [{"name": "get_time", "arguments": {}}]')[1]] == ["get_time"]
    assert parser.parse("It is sunny {really}") == ("It is sunny {really}", [])
    named = ToolPlan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, parser, parallel=True)
    assert named.structured_outputs() == {"json": WEATHER["function"]["parameters"]}
    content, deltas = streamed(named, '{"city": "Oslo", "unit": "celsius"}', 4)
    assert content == "" and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo", "unit": "celsius"}'
    required = ToolPlan(TOOLS, "required", parser, parallel=False).structured_outputs()["json"]
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert ToolPlan(TOOLS, "none", parser, parallel=True).prompt_tools is None


def test_tool_conversations_render_through_templates(model_path):
    """SmolLM2's template knows no tools: they go into the system message in Hermes format. A
    template that knows tools gets them, and the calls, as it expects."""
    history = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"}]
    builder = PromptBuilder(model_path)
    text, _ = builder.render_chat(history, True, False, TOOLS, HermesParser())
    assert "<tools>" in text and '"name": "get_weather"' in text and "<|im_start|>system" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    builder.tokenizer.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n"
        "{% endfor %}")
    text, _ = builder.render_chat(history, False, False, TOOLS, HermesParser())
    assert text.startswith("TOOL get_weather\nTOOL get_time\nuser: What")
    assert 'CALL get_weather {"city": "Paris", "unit": "celsius"}' in text and 'tool: {"temperature": 21}' in text


# -- through the OpenAI SDK ----------------------------------------------------------------------
def test_required_tool_call_through_the_sdk(client, model_name):
    response = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                              tool_choice="required", temperature=0, max_tokens=100)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)

    stream = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", temperature=0, max_tokens=100, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    deltas = [call.model_dump(exclude_none=True) for c in chunks for call in c.delta.tool_calls or []]
    assert [(name, arguments) for _, name, arguments in merged(deltas)] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert chunks[-1].finish_reason == "tool_calls"


def test_named_tool_call_through_the_sdk(client, model_name):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS, tool_choice=forced,
                                              temperature=0, max_tokens=100)
    choice = response.choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")

    stream = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS, tool_choice=forced,
                                            temperature=0, max_tokens=100, stream=True)
    deltas = [call for c in stream if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_tool_results_continue_the_conversation(client, model_name):
    first = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    messages = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=20)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize("changes, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({}, "tool_choice"),  # tools alone mean "auto", which needs --enable-auto-tool-choice (as in vLLM)
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]}, "tools"),
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "get_time", "arguments": "{oops"}}]}], "tool_choice": "none"},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400(serve, model_name, changes, param):
    body = {"model": model_name, "messages": QUESTION, "tools": TOOLS, "max_tokens": 5, **changes}
    response = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
