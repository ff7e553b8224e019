"""/v1/responses through the official SDK's `client.responses.create(...)` against a real `tritonllm
serve`: text (whole, streamed, and the same tokens as chat), instructions, structured text formats,
function tools (required and named, whole and streamed, then their outputs sent back), and the
400s for what is not served (stored responses, non-function tools)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from openai_frontend.serving_responses import EventWriter, ResponseBuilder, ResponsesRequest
from tests.utils.serve import API_KEY, TOOLS, WEATHER

pytestmark = pytest.mark.usefixtures("no_request_left_running")

QUESTION = "What is the weather like in Paris?"
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's tool shape


def test_chat_deltas_become_output_items_and_events():
    """Reasoning, text and two calls (arguments in pieces) -> one output item each, every item
    opened, filled and done in order; the items hold what the deltas carried."""
    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"))
    writer = EventWriter(builder)
    deltas = [{"reasoning": "Think", "reasoning_content": "Think"}, {"reasoning": "ing."}, {"content": "Hi"},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "f", "arguments": "{"}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"x": 1}'}}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}}]},
              {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}]
    events = [event for delta in deltas for event in writer.feed(delta)] + writer.close()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    reasoning, message, first, second = builder.output
    assert reasoning["content"][0]["text"] == "Thinking." and message["content"][0]["text"] == "Hi"
    assert (first["call_id"], first["name"], first["arguments"]) == ("call_a", "f", '{"x": 1}')
    assert (second["call_id"], second["arguments"]) == ("call_b", "{}")
    assert all(item["status"] == "completed" for item in builder.output)
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]


def test_text_response_matches_chat(client, model_name):
    response = client.responses.create(model=model_name, input="Say hello.", instructions="Be brief.",
                                       temperature=0, max_output_tokens=12)
    chat = client.chat.completions.create(model=model_name, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    finished = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert response.status == finished
    if finished == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_streamed_text_events(client, model_name):
    whole = client.responses.create(model=model_name, input="Count to five.", temperature=0, max_output_tokens=10)
    events = list(client.responses.create(model=model_name, input="Count to five.", temperature=0,
                                          max_output_tokens=10, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    completed = events[-1].response
    assert completed.output_text == text and completed.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and completed.id == events[0].response.id


def test_conversation_items_and_json_format(client, model_name):
    """Earlier turns as input items; a json_schema text format holds the answer to the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(
        model=model_name, temperature=0, max_output_tokens=40,
        input=[{"role": "user", "content": "Name a city."},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
               {"role": "user", "content": [{"type": "input_text", "text": "As JSON, please."}]}],
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert set(json.loads(response.output_text)) == {"city"}


def test_required_function_call_whole_and_streamed(client, model_name):
    response = client.responses.create(model=model_name, input=QUESTION, tools=FUNCTIONS, tool_choice="required",
                                       temperature=0, max_output_tokens=100)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    assert calls[0].name in ("get_weather", "get_time") and isinstance(json.loads(calls[0].arguments), dict)

    events = list(client.responses.create(model=model_name, input=QUESTION, tools=FUNCTIONS, tool_choice="required",
                                          temperature=0, max_output_tokens=100, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [(item.name) for item in added] == [call.name for call in calls]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1  # the arguments stream as they are written
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done[0].arguments == calls[0].arguments
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]


def test_named_function_then_its_output(client, model_name):
    response = client.responses.create(model=model_name, input=QUESTION, tools=FUNCTIONS, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    call = next(item for item in response.output if item.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    follow_up = client.responses.create(
        model=model_name, tools=FUNCTIONS, tool_choice="none", temperature=0, max_output_tokens=10,
        input=[{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert follow_up.output_text and not [i for i in follow_up.output if i.type == "function_call"]


@pytest.mark.parametrize("changes, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "none"}, "tools[0]"),
    ({"tools": [{"type": "function", **WEATHER["function"]}]}, "tool_choice"),  # auto needs the server's flag
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": []}, "input"),
    ({"model": "nope"}, "model"),
])
def test_bad_responses_requests_are_400(serve, model_name, changes, param):
    body = {"model": model_name, "input": QUESTION, "max_output_tokens": 5, **changes}
    response = httpx.post(f"{serve.url}/v1/responses", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_sdk_raises_on_a_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model_name, input=QUESTION, previous_response_id="resp_1")
