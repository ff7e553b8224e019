"""Gemma 3 with images, greedy float32 against transformers on a tiny random-weight model built from its
own config classes and processor (every weight perturbed, both soft caps on, a sliding window shorter
than an image's placeholders): one and two images per prompt interleaved with text, batched with a
text-only prompt, under preemption, with prefill chunks that must not cut an image (its placeholders
attend to each other), through the prefix cache, and served (tritonclient's `image` input, the OpenAI
SDK's image_url parts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend import LLM, SamplingParams
from backend.errors import EngineError
from tests.utils.vision import MAX_TOKENS, check_served, data_url, hf_greedy, image, requests, tiny_gemma3, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# The tiny model's KV-cache block in float32: 3 layers, keys and values, blocks of 16, 2 KV heads of 16.
BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, model_path):
    """The tiny Gemma 3 of tests/utils/vision.py: (path, HF model, processor)."""
    return tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"), model_path)


PROMPTS = [("Look: <start_of_image> What is in it?", [image(0, 40, 48)]),
           ("First <start_of_image> then <start_of_image>, which is brighter?", [image(1, 64, 32), image(2, 32, 32)])]
TEXT_ONLY = "No image here, just a question about the weather."


@pytest.fixture(scope="module")
def reference(gemma3):
    _, model, processor = gemma3
    return [hf_greedy(model, processor, text, images) for text, images in PROMPTS]


def test_gemma3_matches_transformers_batched_with_text(gemma3, reference):
    llm = LLM(gemma3[0], dtype="float32", kv_cache_memory_bytes=16 << 20)
    outputs = llm.generate(requests(PROMPTS) + [TEXT_ONLY], GREEDY)
    assert tokens(outputs)[:2] == reference
    assert tokens(outputs)[2] == hf_greedy(gemma3[1], gemma3[2], TEXT_ONLY, None)


@pytest.mark.parametrize("engine_args", [
    # 16 placeholders an image, 20 tokens a step: chunks end before an image the budget cannot finish
    {"max_num_batched_tokens": 20, "enable_chunked_prefill": True},
    {"kv_cache_memory_bytes": 8 * BLOCK_BYTES, "block_size": 16},  # 8 blocks: preemption
], ids=["chunked", "preempted"])
def test_gemma3_stays_exact_when_chunked_or_preempted(gemma3, reference, engine_args):
    llm = LLM(gemma3[0], dtype="float32", **{"kv_cache_memory_bytes": 16 << 20, **engine_args})
    outputs = llm.generate(requests(PROMPTS) * 3 + [TEXT_ONLY], GREEDY)
    assert tokens(outputs)[:6] == reference * 3
    assert tokens(outputs)[6] == hf_greedy(gemma3[1], gemma3[2], TEXT_ONLY, None)
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.runner.encoder_cache
    if "block_size" in engine_args:
        assert {m.name: m.value for m in llm.get_metrics()}["vllm:num_preemptions"] > 0


def test_gemma3_prefix_cache_hit_is_exact(gemma3, reference):
    llm = LLM(gemma3[0], dtype="float32", kv_cache_memory_bytes=16 << 20, block_size=4)
    text, images = PROMPTS[1]
    first = llm.generate(requests([(text, images)]), GREEDY)[0]
    again = llm.generate(requests([(text, images)]), GREEDY)[0]
    ids = gemma3[2](text=text, images=images)["input_ids"][0]
    last_placeholder = len(ids) - 1 - list(ids)[::-1].index(gemma3[1].config.image_token_id)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > last_placeholder  # both images' blocks
    assert tokens([first, again]) == [reference[1]] * 2
    swapped = [images[1], images[0]]
    other = llm.generate(requests([(text, swapped)]), GREEDY)[0]
    assert other.num_cached_tokens <= list(ids).index(gemma3[1].config.image_token_id)  # only the text before
    assert tokens([other]) == [hf_greedy(gemma3[1], gemma3[2], text, swapped)]


def test_a_prefix_cache_hit_may_end_inside_an_image(gemma3):
    """Two prompts that share an image but differ soon after it: with blocks of 8 the second's hit ends
    inside the image (the cached placeholders were computed seeing the whole image), and the rest of
    the image is computed in one chunk that sees the cached part: still transformers' tokens."""
    _, model, processor = gemma3
    llm = LLM(gemma3[0], dtype="float32", kv_cache_memory_bytes=16 << 20, block_size=8)
    text, images = PROMPTS[0]
    other = "Look: <start_of_image> Why is it so?"
    llm.generate(requests([(text, images)]), GREEDY)
    second = llm.generate(requests([(other, images)]), GREEDY)[0]
    first_placeholder = list(processor(text=other, images=images)["input_ids"][0]).index(model.config.image_token_id)
    assert first_placeholder < second.num_cached_tokens < first_placeholder + 16
    assert tokens([second]) == [hf_greedy(model, processor, other, images)]


def test_chat_and_the_openai_prompt_write_the_begin_of_image_token(gemma3):
    """LLM.chat's image_url parts and the OpenAI frontend's prompt for image parts both write Gemma 3's
    <start_of_image> (which its processor expands into the image's soft tokens), not the soft token
    config.json's image_token_index names: transformers' tokens for the template's prompt."""
    from openai_frontend.prompts import PromptBuilder

    _, model, processor = gemma3
    images = PROMPTS[1][1]
    question = {"type": "text", "text": "Which is brighter?"}
    content = [{"type": "image_url", "image_url": {"url": data_url(picture)}} for picture in images] + [question]
    llm = LLM(gemma3[0], dtype="float32", kv_cache_memory_bytes=16 << 20)
    [output] = llm.chat([{"role": "user", "content": content}], GREEDY)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, question]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert output.prompt == prompt
    assert tokens([output]) == [hf_greedy(model, processor, prompt, images)]
    builder = PromptBuilder(gemma3[0])
    assert (builder.image_token, builder.template_takes_image_parts) == ("<start_of_image>", True)
    assert builder.render_chat(messages, True, False)[0] == prompt


def test_the_encoder_runs_on_the_triton_kernels(gemma3):
    """The projector's norm on the Triton kernels (CUDA's path, through the interpreter here), which take
    each row as one contiguous vector, gives the torch path's features."""
    from backend import ops

    llm = LLM(gemma3[0], dtype="float32", kv_cache_memory_bytes=16 << 20)
    encoder = llm.llm_engine.runner.model.vision
    pixels = gemma3[2](text=PROMPTS[0][0], images=PROMPTS[0][1], return_tensors="pt")["pixel_values"]  # one image
    with torch.inference_mode():
        expected = encoder(pixels)
        with ops.triton_kernels():
            actual = encoder(pixels)
    torch.testing.assert_close(actual, expected)


def test_checkpoint_names_in_transformers_5s_own_layout(gemma3, reference, tmp_path):
    """save_pretrained writes the hub's names (language_model.model.*, vision_tower.*); the same weights
    under transformers 5's module names (model.language_model.*, model.vision_tower.vision_model.*,
    model.multi_modal_projector.*) load to the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    renames = [("language_model.model.", "model.language_model."),
               ("vision_tower.", "model.vision_tower.vision_model."),
               ("multi_modal_projector.", "model.multi_modal_projector.")]
    for file in Path(gemma3[0]).iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    weights = load_file(Path(gemma3[0]) / "model.safetensors")
    renamed = {}
    for name, tensor in weights.items():
        old, new = next(((old, new) for old, new in renames if name.startswith(old)), ("", ""))
        renamed[new + name.removeprefix(old)] = tensor
    assert len(renamed) == len(weights) and all(name.startswith(("model.", "lm_head.")) for name in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    assert tokens(llm.generate(requests(PROMPTS), GREEDY)) == reference


def test_an_image_longer_than_a_step_is_refused(gemma3):
    llm = LLM(gemma3[0], dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=8,
              enable_chunked_prefill=True)
    with pytest.raises(EngineError, match="an image takes 16 tokens") as error:
        llm.generate(requests(PROMPTS[:1]), GREEDY)
    assert error.value.param == "multi_modal_data"
    assert not llm.llm_engine.has_unfinished_requests()


def test_pan_and_scan_is_refused_at_start(gemma3, tmp_path):
    """A processor that would add pan-and-scan crops (further image sequences per image) is refused
    when the engine starts, not by a miscounted prompt later."""
    import shutil

    shutil.copytree(gemma3[0], tmp_path, dirs_exist_ok=True)
    gemma3[2].image_processor.do_pan_and_scan = True
    try:
        gemma3[2].save_pretrained(tmp_path)
    finally:
        gemma3[2].image_processor.do_pan_and_scan = False
    with pytest.raises(EngineError, match="pan-and-scan"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=16 << 20)


def test_served_through_triton_and_the_openai_sdk(gemma3, tmp_path_factory):
    """`tritonllm serve`: tritonclient's `image` input (base64 PNGs, one per element) gives LLM.generate's
    text; the OpenAI SDK's image_url parts give LLM.chat's text and logprobs."""
    llm = LLM(gemma3[0], dtype="float32", kv_cache_memory_bytes=16 << 20)
    text, images = PROMPTS[1]
    expected = llm.generate(requests([(text, images)]), GREEDY)[0].outputs[0].text
    content = [{"type": "image_url", "image_url": {"url": data_url(picture)}} for picture in images]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "Which is brighter?"}]}]
    expected_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      logprobs=0))[0].outputs[0]
    check_served(gemma3[0], tmp_path_factory.mktemp("serve_gemma3"), 16 << 20, text, images, expected, messages,
                 expected_chat)
