"""Vision-language models, greedy float32 against transformers on tiny random-weight models built from
its own config classes and processors (every weight perturbed): one and two images per prompt, of
different sizes, batched with a text-only prompt, under preemption, with an image's placeholders split
across prefill chunks, and through the prefix cache (the same image hits, another image never does)."""

from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from backend.errors import EngineError
from tests.utils.vision import MAX_TOKENS, base64_png, data_url, hf_greedy, image, requests, tiny_llava, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory, model_path):
    """The tiny LLaVA 1.5 of tests/utils/vision.py: (path, HF model, processor)."""
    return tiny_llava(tmp_path_factory.mktemp("tiny_llava"), model_path)


PROMPTS = [("USER: <image>\nWhat is in it? ASSISTANT:", [image(0, 40, 48)]),
           ("USER: <image> and <image>: which is brighter? ASSISTANT:", [image(1, 64, 32), image(2, 32, 32)])]


@pytest.fixture(scope="module")
def reference(llava):
    _, model, processor = llava
    return [hf_greedy(model, processor, text, images) for text, images in PROMPTS]


def test_llava_matches_transformers_batched_with_text(llava, reference):
    llm = LLM(llava[0], dtype="float32", kv_cache_memory_bytes=64 << 20)
    outputs = llm.generate(requests(PROMPTS) + ["USER: no image here. ASSISTANT:"], GREEDY)
    assert tokens(outputs)[:2] == reference
    assert tokens(outputs)[2] == hf_greedy(llava[1], llava[2], "USER: no image here. ASSISTANT:", None)


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},  # an image's 16 placeholders in 2-3 chunks
    {"kv_cache_memory_bytes": 8 * (2 * 2 * 16 * 2 * 16 * 4), "block_size": 16},  # 8 blocks: preemption
], ids=["chunked", "preempted"])
def test_llava_stays_exact_when_images_are_split_or_preempted(llava, reference, engine_args):
    llm = LLM(llava[0], dtype="float32", **{"kv_cache_memory_bytes": 64 << 20, **engine_args})
    outputs = llm.generate(requests(PROMPTS) * 3, GREEDY)
    assert tokens(outputs) == reference * 3
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.runner.encoder_cache  # every image's features dropped once consumed
    if "block_size" in engine_args:
        assert {m.name: m.value for m in llm.get_metrics()}["vllm:num_preemptions"] > 0


def test_the_prefix_cache_keys_blocks_by_their_images(llava, reference):
    llm = LLM(llava[0], dtype="float32", kv_cache_memory_bytes=64 << 20, block_size=4)
    text, images = PROMPTS[0]
    first = llm.generate(requests([(text, images)]), GREEDY)[0]
    again = llm.generate(requests([(text, images)]), GREEDY)[0]
    other_image = image(7, 40, 48)
    other = llm.generate(requests([(text, [other_image])]), GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 16  # the image's blocks too
    assert tokens([first, again]) == [reference[0]] * 2
    placeholders = list(llava[2](text=text, images=images)["input_ids"][0]).index(
        llava[1].config.image_token_index)
    assert other.num_cached_tokens <= placeholders  # only the text before the image is shared
    assert tokens([other]) == [hf_greedy(llava[1], llava[2], text, [other_image])]


def chosen_logprobs(completion) -> list[float]:
    return [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]


def test_chat_takes_image_url_parts(llava):
    """LLM.chat with two PNG data URLs gives what transformers gives for llava-1.5's template prompt and
    the images, and LLM.generate's logprobs (which the images' order moves); a conversation without images
    stays a plain chat beside it."""
    _, model, processor = llava
    llm = LLM(llava[0], dtype="float32", kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    images = PROMPTS[1][1]
    content = [{"type": "image_url", "image_url": {"url": data_url(picture)}} for picture in images]
    content.append({"type": "text", "text": "Which is brighter?"})
    text_only = [{"role": "user", "content": "no image here"}]
    with_images, without = llm.chat([[{"role": "user", "content": content}], text_only], params)
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is brighter?"}]}], add_generation_prompt=True)
    assert with_images.prompt == prompt
    assert tokens([with_images]) == [hf_greedy(model, processor, prompt, images)]
    direct, swapped = [llm.generate({"prompt": prompt, "multi_modal_data": {"image": order}}, params)[0].outputs[0]
                       for order in (images, images[::-1])]
    assert chosen_logprobs(with_images.outputs[0]) == pytest.approx(chosen_logprobs(direct), abs=1e-5)
    assert chosen_logprobs(swapped) != pytest.approx(chosen_logprobs(direct), abs=1e-5)
    assert without.prompt == processor.apply_chat_template(text_only, add_generation_prompt=True)


def test_bad_images_are_refused_clearly(llava, model_path):
    llm = LLM(llava[0], dtype="float32", kv_cache_memory_bytes=64 << 20)
    text, images = PROMPTS[0]
    cases = [({"prompt": text, "multi_modal_data": {"image": "not an image"}}, "PIL image"),
             ({"prompt": text, "multi_modal_data": {"image": images * 2}}, "processor refused"),
             ({"prompt": text, "multi_modal_data": {"audio": images}}, "only 'image'"),
             ({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": images}}, "text prompt")]
    for prompt, message in cases:
        with pytest.raises(EngineError, match=message) as error:
            llm.generate(prompt, GREEDY)
        assert error.value.param in ("multi_modal_data", "prompt")
    assert not llm.llm_engine.has_unfinished_requests()
    text_model = LLM(model_path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(EngineError, match="text only"):
        text_model.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)


def test_triton_takes_the_vllm_backends_image_input(llava, tmp_path_factory):
    """tritonclient sends `image` as the vLLM backend's clients do (base64 images, one per element):
    the text is the offline engine's; an undecodable image is INVALID_ARG naming it, and the model
    serves on."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from tests.utils.triton import Stream, llm_server, make_inputs, texts

    text, images = PROMPTS[1]
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    expected = LLM(llava[0], dtype="float32", kv_cache_memory_bytes=64 << 20).generate(
        requests([(text, images)]), GREEDY)[0].outputs[0].text

    def send(server, encoded: list[bytes]):
        inputs = make_inputs(text, params, exclude_input_in_output=True)
        tensor = grpcclient.InferInput("image", [len(encoded)], "BYTES")
        tensor.set_data_from_numpy(np.array(encoded, dtype=np.object_))
        stream = Stream(server.grpc_url)
        try:
            stream.send(inputs + [tensor])
            return stream.collect()
        finally:
            stream.close()

    engine_args = {"model": llava[0], "dtype": "float32", "kv_cache_memory_bytes": 64 << 20}
    with llm_server(tmp_path_factory.mktemp("llava_triton"), engine_args) as server:
        [result] = send(server, [base64_png(i) for i in images])
        assert texts(result) == [expected]
        for encoded, message in [([b"bm90IGFuIGltYWdl"], "image 0 could not be decoded"),
                                 ([b"%%%"], "image 0 is not base64")]:
            with pytest.raises(InferenceServerException, match=message):
                send(server, encoded)
        [result] = send(server, [base64_png(i) for i in images])
        assert texts(result) == [expected]
