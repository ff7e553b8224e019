"""A tiny random LLaVA 1.5 and images for it: the vision-language tests' model (tests/models/) and the
served one behind the OpenAI frontend (tests/serving/test_openai_images.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

# llava-hf/llava-1.5-7b-hf's chat template: content is a list of parts, images first in each message.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

# Gemma 3's chat template as it writes images and text (its system-prompt handling left out).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def image(seed: int, height: int, width: int):
    """Random RGB pixels as a PIL image."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encoded(picture, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format=format)
    return buffer.getvalue()


def base64_png(picture) -> bytes:
    return base64.b64encode(encoded(picture))


def data_url(picture, format: str = "PNG") -> str:
    return f"data:image/{format.lower()};base64," + base64.b64encode(encoded(picture, format)).decode()


def tiny_llava(path, tokenizer_source: str):
    """A tiny LLaVA 1.5 in `path` over `tokenizer_source`'s tokenizer (plus an <image> token), CLIP tower of
    3 layers on 32 x 32 images in 8 x 8 patches (16 features each), with its processor and llava-1.5's chat
    template; (path, HF model, processor)."""
    from transformers import (AutoTokenizer, CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       image_size=32, patch_size=8),
        text_config=LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.02))
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path), model, processor


# llava-v1.6-mistral's chat template, shortened: content parts in their order, each image as its placeholder.
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>\n' }}{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% if message['role'] == 'user' %}{{ ' [/INST]' }}{% else %}{{ eos_token }}"
    "{% endif %}{% endfor %}")


def tiny_llava_next(path, tokenizer_source: str):
    """A tiny LLaVA-NeXT in `path` over `tokenizer_source`'s tokenizer (plus an <image> token): the CLIP tower of
    `tiny_llava` (32 x 32 tiles, 16 features each), grids of 1 x 2 to 2 x 2 and 1 x 3 tiles, a Qwen2 decoder (q/k/v
    biases); its processor and chat template. Every weight perturbed, image_newline included. (path, HF model,
    processor)."""
    from transformers import (AutoTokenizer, CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessorPil, LlavaNextProcessor, Qwen2Config)

    pinpoints = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                   image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=LLAVA_NEXT_CHAT_TEMPLATE)
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       image_size=32, patch_size=8),
        text_config=Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
        image_grid_pinpoints=pinpoints, image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.1))
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path), model, processor


def tiny_gemma3(path, tokenizer_source: str):
    """A tiny Gemma 3 with images in `path` over `tokenizer_source`'s tokenizer (plus Gemma 3's image
    tokens): a SigLIP tower of 2 layers on 32 x 32 images in 4 x 4 patches, pooled to 16 features
    each, a decoder of sliding layers with a window of 8 (shorter than an image's placeholders)
    around one global layer, both soft caps on; its processor (no pan-and-scan) and Gemma 3's chat template beside it. Every weight
    perturbed; the reference runs eager attention (which applies the soft caps). (path, HF model, processor)."""
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, image_seq_length=16, chat_template=GEMMA3_CHAT_TEMPLATE)
    config = Gemma3Config(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, image_size=32, patch_size=4, vision_use_head=False),
        text_config=Gemma3TextConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
        mm_tokens_per_image=16, image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.02))
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.3)  # zero at init: images would barely show
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path), model, processor


MAX_TOKENS = 10  # the greedy tokens each vision-language test compares


def hf_greedy(model, processor, text: str, images: list | None) -> list[int]:
    """transformers' greedy tokens for a prompt and its images (its processor's outputs as they come:
    Gemma 3's token_type_ids give the bidirectional image mask, Qwen2.5-VL's image_grid_thw its grids)."""
    import torch

    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def requests(prompts) -> list[dict]:
    """(text, images) pairs as LLM.generate's prompts."""
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_served(model_path: str, workdir, kv_cache_bytes: int, text: str, images: list, expected: str,
                 messages: list, expected_chat) -> None:
    """`tritonllm serve` on `model_path`: tritonclient's `image` input (base64 PNGs, one per element)
    with `text` gives `expected` (LLM.generate's text); the OpenAI SDK's chat with `messages` (image_url
    parts) gives `expected_chat`'s text and logprobs (LLM.chat's, asked with logprobs=0)."""
    from pathlib import Path

    import pytest
    import tritonclient.grpc as grpcclient
    from openai import OpenAI

    from tests.utils.serve import API_KEY, Serve
    from tests.utils.triton import Stream, make_inputs, texts

    with Serve(model_path, workdir, kv_cache_bytes=kv_cache_bytes, max_model_len=512, start_timeout=300,
               stop_timeout=60) as served:
        inputs = make_inputs(text, {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
                             exclude_input_in_output=True)
        tensor = grpcclient.InferInput("image", [len(images)], "BYTES")
        tensor.set_data_from_numpy(np.array([base64_png(i) for i in images], dtype=np.object_))
        stream = Stream(served.grpc_url)
        try:
            stream.send(inputs + [tensor])
            [result] = stream.collect()
        finally:
            stream.close()
        assert texts(result) == [expected]
        client = OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        response = client.chat.completions.create(
            model=Path(model_path).name, messages=messages, temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
            extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.message.content == expected_chat.text
    logprobs = [position[token].logprob for position, token in zip(expected_chat.logprobs, expected_chat.token_ids)]
    assert [entry.logprob for entry in choice.logprobs.content] == pytest.approx(logprobs, abs=1e-5)
