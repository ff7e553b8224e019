"""Qwen2.5-VL, greedy float32 against transformers on a tiny random-weight model (tests/utils/qwen_vl.py): images
at their own resolution (different sizes, so different grids and placeholder counts), one and two per prompt,
interleaved with text, batched with a text-only prompt, with an image's placeholders split across prefill
chunks, under preemption and through the prefix cache, and through `LLM.chat` (Qwen2-VL's template); images of
one patch count but different grids in one encoder batch; the M-RoPE positions against transformers'
`get_rope_index`; the hub's older checkpoint layout; served through Triton and the OpenAI SDK."""

from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from tests.utils.qwen_vl import IMAGE, tiny_qwen2_5_vl
from tests.utils.vision import MAX_TOKENS, check_served, data_url, hf_greedy, image, requests, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXT_ONLY = "No image here, only text:"
# 40 x 48 pixels: 5 x 6 placeholders (windows of 2 x 2 cut at the edges); 64 x 32: 8 x 4; 24 x 40: 3 x 5.
PROMPTS = [(IMAGE + "What is in it?", [image(0, 40, 48)]),
           ("Compare " + IMAGE + " with " + IMAGE + ": which is brighter?", [image(1, 64, 32), image(2, 24, 40)])]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, model_path):
    """(path, HF model, processor)."""
    return tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), model_path)


@pytest.fixture(scope="module")
def reference(qwen):
    _, model, processor = qwen
    return [hf_greedy(model, processor, text, images) for text, images in PROMPTS]


def test_m_rope_positions_are_transformers(qwen):
    """Each prompt token's (temporal, height, width) position and the decode shift, as `get_rope_index`."""
    path, model, processor = qwen
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    vision = llm.llm_engine.runner.args.vision
    for text, images in PROMPTS:
        inputs = processor(text=text, images=images, return_tensors="pt")
        expected, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                     inputs["image_grid_thw"])
        prompt_ids, image_inputs = llm.llm_engine.image_processor(text, {"image": images})
        length = len(prompt_ids)
        positions = vision.rope_positions(torch.arange(length + 3), image_inputs)
        assert positions[:, :length].tolist() == expected[:, 0].tolist()
        decode = torch.arange(length, length + 3) + delta.item()  # after the prompt: shifted as its end
        assert positions[:, length:].tolist() == [decode.tolist()] * 3


def test_qwen2_5_vl_matches_transformers_batched_with_text(qwen, reference):
    path, model, processor = qwen
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=64 << 20)
    outputs = llm.generate(requests(PROMPTS) + [TEXT_ONLY], GREEDY)
    assert tokens(outputs)[:2] == reference
    assert tokens(outputs)[2] == hf_greedy(model, processor, TEXT_ONLY, None)  # equal parts: plain RoPE


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},  # each image's placeholders over 2-5 chunks
    {"kv_cache_memory_bytes": 8 * (2 * 2 * 16 * 2 * 16 * 4), "block_size": 16},  # 8 blocks: preemption
], ids=["chunked", "preempted"])
def test_qwen2_5_vl_stays_exact_when_images_are_split_or_preempted(qwen, reference, engine_args):
    llm = LLM(qwen[0], dtype="float32", **{"kv_cache_memory_bytes": 64 << 20, **engine_args})
    outputs = llm.generate(requests(PROMPTS) * 3, GREEDY)
    assert tokens(outputs) == reference * 3
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.runner.encoder_cache
    if "block_size" in engine_args:
        assert {m.name: m.value for m in llm.get_metrics()}["vllm:num_preemptions"] > 0


def test_the_prefix_cache_keys_qwen_blocks_by_their_images(qwen, reference):
    path, model, processor = qwen
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=64 << 20, block_size=4)
    text, images = PROMPTS[1]
    first = llm.generate(requests([(text, images)]), GREEDY)[0]
    again = llm.generate(requests([(text, images)]), GREEDY)[0]
    other_images = [images[0], image(7, 24, 40)]  # the second image differs, at the same size
    other = llm.generate(requests([(text, other_images)]), GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 40  # both images' blocks too
    assert tokens([first, again]) == [reference[1]] * 2
    first_image, second_image = llm.llm_engine.image_processor(text, {"image": images})[1]
    assert first_image.offset + first_image.length <= other.num_cached_tokens <= second_image.offset
    assert tokens([other]) == [hf_greedy(model, processor, text, other_images)]


def test_the_tower_batches_images_of_one_size_whatever_their_grids(qwen):
    """Images with as many patches share an encoder batch: two of one grid and one of the transposed grid (10 x 12
    and 12 x 10 patches) give transformers' features, and the prompt holding all three its tokens."""
    path, model, processor = qwen
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    images = [image(3, 40, 48), image(4, 40, 48), image(5, 48, 40)]
    inputs = processor.image_processor(images=images, return_tensors="pt")
    with torch.inference_mode():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        ours = llm.llm_engine.runner.model.vision(inputs["pixel_values"].view(3, 120, -1), inputs["image_grid_thw"])
    for feature, hf_feature in zip(ours, expected):
        torch.testing.assert_close(feature, hf_feature)
    text = IMAGE + IMAGE + " and " + IMAGE + ":"
    assert tokens(llm.generate(requests([(text, images)]), GREEDY)) == [hf_greedy(model, processor, text, images)]


def test_chat_writes_qwen_image_placeholders(qwen):
    """LLM.chat with data URLs: Qwen2-VL's template writes each image's placeholder, and the tokens are
    transformers' for that prompt and the images; a conversation without images is a plain chat beside it."""
    path, model, processor = qwen
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=64 << 20)
    images = PROMPTS[1][1]
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url(images[0])}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": data_url(images[1])}}]
    text_only = [{"role": "user", "content": TEXT_ONLY}]
    with_images, without = llm.chat([[{"role": "user", "content": content}], text_only], GREEDY)
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}, {"type": "image"}]}],
        add_generation_prompt=True)
    assert with_images.prompt == prompt and prompt.count(IMAGE) == 2
    assert tokens([with_images]) == [hf_greedy(model, processor, prompt, images)]
    assert without.prompt == processor.apply_chat_template(text_only, add_generation_prompt=True)
    assert tokens([without]) == [hf_greedy(model, processor, without.prompt, None)]


def test_the_hubs_older_layout_loads_to_the_same_tokens(qwen, reference, tmp_path):
    """Checkpoints saved before transformers 5 (as the hub's Qwen2.5-VL are): the decoder's keys at the top of
    config.json with `rope_scaling: {type: mrope, ...}`, weights under `model.layers.*` and `visual.*`."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    source = Path(qwen[0])
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    renamed = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): tensor
               for name, tensor in load_file(source / "model.safetensors").items()}
    assert any(name.startswith("visual.") for name in renamed) and any(name.startswith("model.layers.") for name in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=64 << 20)
    assert tokens(llm.generate(requests(PROMPTS), GREEDY)) == reference


def test_served_through_triton_and_the_openai_sdk(qwen, tmp_path_factory):
    """`tritonllm serve`: tritonclient's `image` input (base64 PNGs, one per element) gives LLM.generate's text;
    the OpenAI SDK's image_url parts (Qwen2-VL's template) give LLM.chat's text and logprobs."""
    llm = LLM(qwen[0], dtype="float32", kv_cache_memory_bytes=64 << 20)
    text, images = PROMPTS[1]
    expected = llm.generate(requests([(text, images)]), GREEDY)[0].outputs[0].text
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(images[0])}},
                                             {"type": "text", "text": "or"},
                                             {"type": "image_url", "image_url": {"url": data_url(images[1])}}]}]
    expected_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      logprobs=0))[0].outputs[0]
    assert expected
    check_served(qwen[0], tmp_path_factory.mktemp("serve_qwen2_5_vl"), 64 << 20, text, images, expected, messages,
                 expected_chat)
