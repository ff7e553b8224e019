"""Reasoning models: the <think> parsers on whole and streamed text, and `reasoning` /
`reasoning_content` apart from `content` through the official SDK from a frontend started with
`--reasoning-parser deepseek_r1` on a real `tritonllm serve`, with a chat template that opens the
think block as DeepSeek-R1's does
(SmolLM2 never closes it by itself, so structured outputs write one where a test needs it), with
`chat_template_kwargs` reaching the template."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from openai_frontend.reasoning_parsers import PARSERS
from openai_frontend.serving_chat import AnswerStream
from openai_frontend.tool_calls import ToolPlan
from openai_frontend.tool_parsers import HermesParser
from openai_frontend.main import parse_settings
from test_openai_frontend import API_KEY, ServedApp, model_name, serve, tokenizer  # noqa: F401

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


def test_reasoning_given_back_and_auto_tool_choice(thinking, model_name):
    """An assistant turn's reasoning is accepted back; with --enable-auto-tool-choice, tools alone
    mean `auto` (free text, read for calls)."""
    messages = QUESTION + [{"role": "assistant", "content": "Hello!", "reasoning": "Greet."},
                           {"role": "user", "content": "Again."}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    response = thinking.chat.completions.create(model=model_name, messages=messages, tools=tools, max_tokens=5,
                                                temperature=0)
    assert response.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert json.loads(response.model_dump_json())["choices"][0]["message"]["reasoning"]
