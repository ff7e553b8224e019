"""Reasoning models: the <think> parsers on whole and streamed text, and `reasoning` /
`reasoning_content` apart from `content` through the official SDK from a frontend started with
`--reasoning-parser deepseek_r1` on a real `tritonllm serve`, with a chat template that opens the
think block as DeepSeek-R1's does (SmolLM2 never closes it by itself, so structured outputs write
one where a test needs it), and `chat_template_kwargs` reaching the template."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from openai_frontend.reasoning_parsers import PARSERS
from openai_frontend.serving_chat import AnswerStream
from openai_frontend.tool_calls import ToolPlan
from openai_frontend.tool_parsers import HermesParser
from openai_frontend.main import parse_settings
from tests.utils.serve import API_KEY, ServedApp

THOUGHT, ANSWER = "The user greets me. I greet back.", "Hello there!"


def split_streamed(parser, text: str, piece: int) -> tuple[str, str]:
    stream, reasoning, content = parser.stream(), "", ""
    for start in range(0, len(text), piece):
        r, c = stream.feed(text[start:start + piece])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
@pytest.mark.parametrize("name, text, expected", [
    ("deepseek_r1", f"{THOUGHT}</think>\n\n{ANSWER}", (THOUGHT, f"\n\n{ANSWER}")),  # opened by the template
    ("deepseek_r1", f"<think>{THOUGHT}</think>{ANSWER}", (THOUGHT, ANSWER)),  # opened again by the model
    ("deepseek_r1", f"{THOUGHT} 1 < 2 </thi", (f"{THOUGHT} 1 < 2 </thi", None)),  # cut short: all reasoning
    ("qwen3", f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", (f"\n{THOUGHT}\n", f"\n\n{ANSWER}")),
    ("qwen3", f"\n{ANSWER} <think>no</think>", (None, f"\n{ANSWER} <think>no</think>")),  # thinking off
    ("qwen3", "<thin", (None, "<thin")),
    ("qwen3", f"<think>{THOUGHT}", (THOUGHT, None)),
])
def test_think_parsers_whole_and_streamed_alike(name, text, expected, piece):
    parser = PARSERS[name]()
    reasoning, content = parser.split(text)
    assert (reasoning or None, content or None) == expected
    streamed = split_streamed(parser, text, piece)
    assert (streamed[0] or None, streamed[1] or None) == expected


def test_a_constrained_answer_has_reasoning_only_in_a_written_block():
    parser = PARSERS["deepseek_r1"]().constrained()
    assert parser.split('{"a": 1}') == (None, '{"a": 1}')
    assert parser.split("<think>hm</think>ok") == ("hm", "ok")


def test_reasoning_then_tool_calls_streamed():
    """The reasoning goes out first; what follows the block is read for tool calls."""
    text = ("I need the weather.</think>\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    stream = AnswerStream(PARSERS["deepseek_r1"]().stream(), ToolPlan([{}], "auto", HermesParser(), True).stream())
    deltas = [d for k in range(0, len(text), 4) for d in stream.feed(text[k:k + 4])] + stream.finish()
    assert "".join(d.get("reasoning", "") for d in deltas) == "I need the weather."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas).strip() == ""
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"city": "Paris"}'


def test_flags_as_vllm_spells_them():
    import argparse

    from tools.serve import add_serve_arguments
    flags = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    settings, _ = parse_settings(flags)
    assert (settings.reasoning_parser, settings.enable_auto_tool_choice, settings.tool_call_parser) == \
        ("qwen3", True, "pythonic")
    assert parse_settings([])[0].reasoning_parser is None and not parse_settings([])[0].enable_auto_tool_choice
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    args = serve.parse_args(flags)
    assert (args.reasoning_parser, args.enable_auto_tool_choice, args.tool_call_parser) == ("qwen3", True, "pythonic")
    with pytest.raises(SystemExit):
        parse_settings(["--reasoning-parser", "nope"])


# -- through the OpenAI SDK, from a real `tritonllm serve --reasoning-parser deepseek_r1` ---------
# A ChatML template that, as DeepSeek-R1's, opens the think block after the assistant's header,
# unless enable_thinking is false (then the block is written closed, empty).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def thinking(serve, model_path, tmp_path_factory):
    """A second frontend, with the reasoning flags, on the Triton of a real `tritonllm serve`."""
    template = tmp_path_factory.mktemp("reasoning") / "template.jinja"
    template.write_text(TEMPLATE)
    settings, _ = parse_settings(["--grpc-url", serve.grpc_url, "--model", model_path, "--api-key", API_KEY,
                                  "--chat-template", str(template), "--reasoning-parser", "deepseek_r1",
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    with ServedApp(settings) as app:
        yield OpenAI(base_url=f"{app.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_an_open_think_block_is_reasoning(thinking, model_name):
    """The template opened the block and SmolLM2 never closes it: all of its answer is reasoning,
    the very text /v1/completions gives for the same prompt."""
    response = thinking.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=12)
    message = response.choices[0].message
    prompt = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    text = thinking.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=12).choices[0].text
    assert message.content is None or message.content == ""
    assert message.reasoning == message.reasoning_content == text and text

    stream = thinking.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=12,
                                              stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == text
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == text
    assert "".join(d.content or "" for d in deltas) == ""


def test_a_closed_block_splits_reasoning_from_content(thinking, model_name):
    """Structured outputs make the model write a whole block: reasoning, then the answer."""
    regex = {"regex": "<think>[a-z ]{3,20}</think>[A-Za-z ]{3,20}"}
    response = thinking.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=40,
                                                extra_body={"structured_outputs": regex})
    message = response.choices[0].message
    assert message.reasoning and message.content and "<think>" not in message.content + message.reasoning
    stream = thinking.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=40,
                                              extra_body={"structured_outputs": regex}, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def test_chat_template_kwargs_reach_the_template(thinking, model_name, tokenizer):
    on = thinking.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1)
    off = thinking.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    closed = len(tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids)
    opened = len(tokenizer("<think>\n", add_special_tokens=False).input_ids)
    assert off.usage.prompt_tokens - on.usage.prompt_tokens == closed - opened > 0
    with pytest.raises(Exception) as error:
        thinking.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert error.value.status_code == 400 and "chat_template_kwargs" in str(error.value)


def test_reasoning_then_a_tool_call_read_from_free_text(thinking, model_name):
    """With --enable-auto-tool-choice, tools alone mean `auto`: the calls are read from the answer's
    text (here written by a regex as a Hermes block after a think block), whole and streamed;
    an assistant turn's reasoning is accepted back."""
    messages = QUESTION + [{"role": "assistant", "content": "Hello!", "reasoning": "Greet."},
                           {"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    regex = ('<think>[a-z ]{3,20}</think>\n<tool_call>\n\\{"name": "get_weather", "arguments": '
             '\\{"city": "[A-Z][a-z]{2,8}", "days": [1-9]\\}\\}\n</tool_call>')
    request = dict(model=model_name, messages=messages, tools=tools, temperature=0, max_tokens=80,
                   extra_body={"structured_outputs": {"regex": regex}})
    choice = thinking.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "days"}

    chunks = [chunk.choices[0] for chunk in thinking.chat.completions.create(**request, stream=True) if chunk.choices]
    deltas = [d for c in chunks for d in c.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # The arguments stream as written, but how many pieces arrive depends on the host: a stream that
    # falls behind the engine gets its waiting outputs merged into one response (model.py's coalesce).
    # Feeding the parser in pieces is tested on its own (tests/serving/test_tool_calls.py, `streamed`).
    assert [d for d in deltas if d.function.arguments]
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == choice.message.reasoning
    assert chunks[-1].finish_reason == "tool_calls"
