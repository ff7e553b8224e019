"""A tiny random Qwen2.5-VL for the vision-language tests: transformers' own config classes, image processor
and placeholder expansion (the engine's image-only processor), every weight perturbed."""

from __future__ import annotations

import torch

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image, as Qwen2.5-VL's chat template writes it
# Qwen2-VL / Qwen2.5-VL's chat template, less its video and vision-id options.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen2_5_vl(path, tokenizer_source: str):
    """A tiny Qwen2.5-VL in `path` over `tokenizer_source`'s tokenizer (plus Qwen's vision tokens): a 4-block
    tower (full attention on blocks 1 and 3, windows of 2 x 2 merged patches elsewhere) on 4 x 4 patches,
    merged 2 x 2, so an image of H x W pixels (resized to multiples of 8) takes H/8 x W/8 placeholders; a
    2-layer decoder whose 8 rotary frequencies are split (2, 3, 3) among M-RoPE's parts; Qwen2-VL's chat
    template. (path, HF model, processor)."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from backend.models.qwen2_5_vl import image_processor_class

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64}, patch_size=4,
                                               merge_size=2, temporal_patch_size=2)
    processor = image_processor_class()(image_processor, tokenizer, chat_template=CHAT_TEMPLATE)
    token = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3]),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"))
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # biases and norm weights too: a dropped term shows
            param.add_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.15))
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path), model, processor
