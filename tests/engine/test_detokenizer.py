"""Incremental detokenization: deltas concatenate exactly to the final text, multibyte included."""

from __future__ import annotations

from backend import RequestOutputKind, SamplingParams
from backend.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! 你好，世界。", "emoji 🙂🐶🏠 and ünïcödé", "  leading spaces\nand\ttabs  ",
         "日本語のテキストも大丈夫です", "def f(x):\n    return x ** 2  # 二乗"]


def test_one_token_at_a_time_equals_full_decode(tokenizer):
    for text in TEXTS:
        prompt = tokenizer("Say:").input_ids
        ids = tokenizer(text).input_ids
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        pieces = []
        for token in ids:
            before = len(detokenizer.output_text)
            detokenizer.update([token], check_stop=True)
            pieces.append(detokenizer.output_text[before:])
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
        assert all("\ufffd" not in piece for piece in pieces)


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer("alpha beta gamma delta").input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["a gam"]))
    matched = None
    for token in ids:
        matched = detokenizer.update([token], check_stop=True) or matched
        if matched:
            break
    assert matched == "a gam" and detokenizer.output_text == "alpha bet"


def test_streamed_deltas_concatenate_to_final_text(llm):
    engine = llm.llm_engine
    prompts = ["请用中文写一首关于月亮的诗。", "Use three emoji to describe a sunny day:", "Count: one, two,"]
    finals = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"stream-{i}", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                                  output_kind=RequestOutputKind.DELTA))
    streamed = {i: "" for i in range(len(prompts))}
    tokens = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            index = int(output.request_id.split("-")[1])
            streamed[index] += output.outputs[0].text
            tokens[index] += output.outputs[0].token_ids
    for i, final in enumerate(finals):
        assert streamed[i] == final.outputs[0].text
        assert tokens[i] == final.outputs[0].token_ids
    assert any(ord(ch) > 0x2E80 for ch in finals[0].outputs[0].text), "expected Chinese output"


def test_streaming_never_shows_a_stop_string(llm):
    engine = llm.llm_engine
    base = llm.generate(["Count: one, two,"], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    stop = base.strip().split()[2]
    engine.add_request("s", "Count: one, two,", SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                              output_kind=RequestOutputKind.DELTA))
    seen = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen += output.outputs[0].text
            assert stop not in seen
    assert seen == base[:base.index(stop)]


def stream(engine, prompt: str, params: SamplingParams) -> list:
    engine.add_request("interval", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_stream_interval_sends_the_first_token_then_every_n(llm, monkeypatch):
    engine = llm.llm_engine
    prompt = "Use three emoji to describe a sunny day:"
    final = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    delta = stream(engine, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stream_interval=4,
                                                  output_kind=RequestOutputKind.DELTA))
    assert [len(o.outputs[0].token_ids) for o in delta] == [1, 4, 4, 1]  # tokens 1, 2-5, 6-9, 10
    assert "".join(o.outputs[0].text for o in delta) == final.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == final.token_ids
    assert [o.finished for o in delta] == [False, False, False, True]

    # Cumulative outputs come as rarely; the server's interval is a floor for every request's.
    monkeypatch.setattr(engine.config, "stream_interval", 3)
    cumulative = stream(engine, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                       stream_interval=2))
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 4, 7, 10]
    assert cumulative[-1].outputs[0].text == final.text
