"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the windowed vision transformer of
`layers/qwen_vision.py` (images at their own resolution: the processor's `image_grid_thw` gives each
image's patch grid and so its number of placeholders) in front of the Qwen2 decoder with M-RoPE.

M-RoPE: a prompt token's position has three parts (temporal, height, width), and each rotates its
section of the frequencies (`mrope_section`). A text token's three parts are equal; an image's
placeholders sit at the image's start position plus (0, row, column) of their merged patch; text after
an image continues from the image's largest position + 1, so a request's later positions are its
sequence positions shifted by what its images saved (vLLM's `mrope_position_delta`). Equal parts are
plain RoPE, so only steps holding image placeholders need three rows (`rope_positions`).

Checkpoint names: `model.visual.*` or `visual.*` are the tower's, `model.language_model.*` (or, in
older checkpoints, `model.*`) the decoder's, `lm_head` its head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backend.layers.qwen_vision import QwenVisionArgs, QwenVisionTower
from backend.models.decoder import ModelArgs
from backend.models.llama import checkpoint_tensors as text_checkpoint_tensors
from backend.models.llama import qwen2
from backend.multimodal import ImageInput


@dataclass(frozen=True)
class QwenVLVision:
    """The vision side of Qwen2.5-VL: its tower, its placeholder token and its M-RoPE positions."""
    tower: QwenVisionArgs
    image_token_id: int

    def image_input(self, outputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """One image's processor outputs (its patches and `image_grid_thw`) and its placeholder count."""
        return outputs, int(outputs["pixel_values"].shape[0]) // self.tower.merge_unit

    def build(self) -> nn.Module:
        return QwenVisionTower(self.tower)

    def load_processor(self, model_path: str):
        """transformers' Qwen2.5-VL processor for images alone: its image processor, tokenizer and
        placeholder expansion, without the video processor (which needs torchvision)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        return image_processor_class()(AutoImageProcessor.from_pretrained(model_path), tokenizer,
                                       chat_template=tokenizer.chat_template)

    def rope_positions(self, positions: torch.Tensor, images: Sequence[ImageInput]) -> torch.Tensor:
        """M-RoPE positions [3, n] of one request's tokens at sequence positions `positions` [n]."""
        rope = positions.expand(3, -1).clone()
        shift = 0  # what the images before saved: their placeholders less their largest extent
        for image in images:
            _, height, width = (int(size) // self.tower.spatial_merge_size
                                for size in image.extras["image_grid_thw"].tolist())
            end = image.offset + image.length
            inside = (positions >= image.offset) & (positions < end)
            index = positions[inside] - image.offset  # its merged patches, row-major
            start = image.offset + shift
            rope[0, inside] = start
            rope[1, inside] = start + index // width
            rope[2, inside] = start + index % width
            shift += max(height, width) - image.length
            rope[:, positions >= end] += max(height, width) - image.length
        return rope


def image_processor_class():
    """Qwen2_5_VLProcessor less its video processor (transformers imported only when it is needed)."""
    from transformers import Qwen2_5_VLProcessor

    class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return Qwen2_5_VLImageProcessor


def checkpoint_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, Any]]:
    """The tower's names under `vision.` (its Conv3d patch embedding as the linear it is on whole
    patches), the decoder's as Qwen2 reads them."""
    if name.startswith(("model.visual.", "model.language_model.")):
        name = name.removeprefix("model.")
    if name.startswith("visual."):
        if name == "visual.patch_embed.proj.weight":
            return [("vision.patch_embed.weight", tensor.flatten(1))]
        return [("vision." + name.removeprefix("visual."), tensor)]
    if name.startswith("language_model."):
        name = "model." + name.removeprefix("language_model.")
    return text_checkpoint_tensors(name, tensor, args)


def qwen2_5_vl(config: dict[str, Any]) -> ModelArgs:
    text = dict(config.get("text_config") or config)  # older checkpoints: the decoder's keys at the top
    text["architectures"] = [config["architectures"][0]]
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    section = tuple(rope.pop("mrope_section", (16, 24, 24)))
    if rope.get("rope_type", rope.get("type")) == "mrope":  # older configs' name for it: default RoPE, three positions
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text["rope_parameters"] = rope
    args = qwen2(text)
    if 2 * sum(section) != args.head_dim:
        raise ValueError(f"mrope_section {list(section)} must cover half the head dim ({args.head_dim // 2})")
    args.mrope_section = section
    args.vision = QwenVLVision(QwenVisionArgs.from_config(config["vision_config"]), config["image_token_id"])
    args.checkpoint_names = checkpoint_tensors  # a module-level function: ModelArgs compare equal
    return args


ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": qwen2_5_vl}
