"""LLaVA-NeXT, greedy float32 against transformers on the tiny random model of tests/utils/vision.py (every
weight perturbed, image_newline too): images of different sizes and aspect ratios, so different tile grids,
crops and placeholder counts; one and two per prompt, interleaved with text; two images of one tile count
but different sizes encoded in one batch; batched with a text-only prompt, under preemption, with an image's
placeholders split across prefill chunks, and through the prefix cache. `LLM.chat` with image_url parts
gives what `LLM.generate` gives for the chat template's prompt and the images; `tritonllm serve` gives the
offline engine's answers through tritonclient and the OpenAI SDK."""

from __future__ import annotations


import pytest

from backend import LLM, SamplingParams
from backend.errors import EngineError
from tests.utils.vision import MAX_TOKENS, check_served, data_url, hf_greedy, image, requests, tiny_llava_next, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXT_ONLY = "[INST] no image here [/INST]"
PROMPTS = [
    ("[INST] <image>\nWhat is in it? [/INST]", [image(0, 40, 100)]),  # wide: 1 x 3 tiles, rows cropped
    ("[INST] <image>\nand <image>\nwhich is brighter? [/INST]", [image(1, 100, 30), image(2, 30, 30)]),  # 3 x 1, 1 x 2
    ("[INST] Compare <image>\nwith <image>\n[/INST]", [image(3, 64, 64), image(4, 50, 60)]),  # 2 x 2 both, one cropped
]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory, model_path):
    """(path, HF model, processor)."""
    return tiny_llava_next(tmp_path_factory.mktemp("tiny_llava_next"), model_path)


@pytest.fixture(scope="module")
def reference(llava_next):
    _, model, processor = llava_next
    return [hf_greedy(model, processor, text, images) for text, images in PROMPTS]


def placeholders(llava_next, picture) -> int:
    _, model, processor = llava_next
    ids = processor(text="<image>", images=[picture])["input_ids"][0]
    return sum(int(token) == model.config.image_token_index for token in ids)


def test_llava_next_matches_transformers_batched_with_text(llava_next, reference):
    counts = [placeholders(llava_next, picture) for _, images in PROMPTS for picture in images]
    assert len(set(counts)) == len(counts)  # each image's size gives it its own placeholder count
    llm = LLM(llava_next[0], dtype="float32", kv_cache_memory_bytes=64 << 20)
    outputs = llm.generate(requests(PROMPTS) + [TEXT_ONLY], GREEDY)
    assert tokens(outputs)[:3] == reference
    assert tokens(outputs)[3] == hf_greedy(llava_next[1], llava_next[2], TEXT_ONLY, None)


BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block_size x KV heads x head_dim x float32


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 16, "enable_chunked_prefill": True},  # each image's placeholders in 4 to 6 chunks
    {"kv_cache_memory_bytes": 16 * BLOCK_BYTES, "block_size": 16},  # each prompt fits, three of them do not
], ids=["chunked", "preempted"])
def test_llava_next_stays_exact_when_images_are_split_or_preempted(llava_next, reference, engine_args):
    llm = LLM(llava_next[0], dtype="float32", **{"kv_cache_memory_bytes": 64 << 20, **engine_args})
    outputs = llm.generate(requests(PROMPTS) * 3, GREEDY)
    assert tokens(outputs) == reference * 3
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.runner.encoder_cache  # every image's features dropped once consumed
    if "block_size" in engine_args:
        assert {m.name: m.value for m in llm.get_metrics()}["vllm:num_preemptions"] > 0


def test_the_prefix_cache_keys_blocks_by_their_images(llava_next, reference):
    llm = LLM(llava_next[0], dtype="float32", kv_cache_memory_bytes=64 << 20, block_size=4)
    text, images = PROMPTS[0]
    first = llm.generate(requests([(text, images)]), GREEDY)[0]
    again = llm.generate(requests([(text, images)]), GREEDY)[0]
    other_image = image(7, 40, 100)  # the same size: the same placeholders, other pixels
    other = llm.generate(requests([(text, [other_image])]), GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > placeholders(llava_next, images[0])
    assert tokens([first, again]) == [reference[0]] * 2
    before_image = list(llava_next[2](text=text, images=images)["input_ids"][0]).index(
        llava_next[1].config.image_token_index)
    assert other.num_cached_tokens <= before_image  # only the text before the image is shared
    assert tokens([other]) == [hf_greedy(llava_next[1], llava_next[2], text, [other_image])]


def conversation(parts: list) -> list[dict]:
    """One user message of text and images (PIL images become PNG data URLs, as a client sends them)."""
    content = [{"type": "text", "text": part} if isinstance(part, str)
               else {"type": "image_url", "image_url": {"url": data_url(part)}} for part in parts]
    return [{"role": "user", "content": content}]


CHATS = [["What is in ", image(0, 40, 100), "?"], [image(1, 100, 30), "or", image(2, 30, 30), "which is brighter?"]]


def test_chat_takes_image_url_parts(llava_next):
    """LLM.chat with data URLs gives LLM.generate's tokens for the chat template's prompt and the images,
    batched with a text-only conversation; a bad data URL is refused naming its part."""
    _, model, processor = llava_next
    llm = LLM(llava_next[0], dtype="float32", kv_cache_memory_bytes=64 << 20)
    text_only = [{"role": "user", "content": "no image here"}]
    outputs = llm.chat([conversation(parts) for parts in CHATS] + [text_only], GREEDY)
    for parts, output in zip(CHATS, outputs):
        prompt = processor.apply_chat_template([{"role": "user", "content": [
            {"type": "text", "text": part} if isinstance(part, str) else {"type": "image"} for part in parts]}],
            add_generation_prompt=True)
        images = [part for part in parts if not isinstance(part, str)]
        assert output.prompt == prompt
        assert tokens([output]) == tokens(llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                                                       GREEDY))
        assert tokens([output]) == [hf_greedy(model, processor, prompt, images)]
    assert outputs[2].prompt == processor.apply_chat_template(text_only, add_generation_prompt=True)
    for url, message in [("data:image/png;base64,bm90IGFuIGltYWdl", "image 0 could not be decoded"),
                         ("data:image/png;base64,%%%", "base64 does not decode"),
                         ("https://example.com/a.png", "must be a data URL")]:
        bad = conversation(["look:", image(0, 40, 100)])
        bad[0]["content"][1]["image_url"]["url"] = url
        with pytest.raises(EngineError, match=message) as error:
            llm.chat(bad, GREEDY)
        assert error.value.param == "messages[0].content[1]"
    assert not llm.llm_engine.has_unfinished_requests()



def test_served_through_triton_and_the_openai_sdk(llava_next, tmp_path_factory):
    """`tritonllm serve`: tritonclient's `image` input (base64 PNGs, one per element) gives LLM.generate's
    text; the OpenAI SDK's image_url parts give LLM.chat's text and logprobs."""
    llm = LLM(llava_next[0], dtype="float32", kv_cache_memory_bytes=64 << 20)
    text, images = PROMPTS[1]
    expected = llm.generate(requests([(text, images)]), GREEDY)[0].outputs[0].text
    messages = conversation(CHATS[1])
    expected_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      logprobs=0))[0].outputs[0]
    check_served(llava_next[0], tmp_path_factory.mktemp("serve_llava_next"), 64 << 20, text, images, expected, messages,
                 expected_chat)
