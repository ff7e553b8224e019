"""LLaVA 1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and a
Llama-shaped decoder (Llama, Mistral, Qwen2: `text_config`). Each image's placeholder token stands
once per patch feature the tower makes; the decoder sees the projected features in their place.

Checkpoint names: `language_model.model.*` (or `model.language_model.*`) are the decoder's,
`language_model.lm_head` (or `lm_head`) its head, `vision_tower[.vision_model].*` and
`multi_modal_projector.*` (either under `model.`) the vision encoder's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backend.layers.vision import CLIPVisionTower, Projector, VisionArgs
from backend.models.decoder import ModelArgs
from backend.models.llama import checkpoint_tensors as text_checkpoint_tensors
from backend.models.llama import llama, qwen2

TEXT_FAMILIES = {"llama": llama, "mistral": llama, "qwen2": qwen2}


@dataclass(frozen=True)
class LlavaVision:
    """The vision side of a LLaVA model: its tower, its projector and its placeholder token."""
    tower: VisionArgs
    text_hidden_size: int
    image_token_id: int
    projector_act: str = "gelu"
    projector_bias: bool = True

    def image_input(self, outputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """One image's processor outputs as its encoder takes them, and its placeholder count."""
        return outputs, self.tower.num_patches + (0 if self.tower.drop_class_token else 1)

    def build(self) -> nn.Module:
        return LlavaEncoder(self)


class LlavaEncoder(nn.Module):
    """Images [N, 3, H, W] -> their features in the decoder's width, [N, tokens per image, hidden]."""

    def __init__(self, spec: LlavaVision) -> None:
        super().__init__()
        self.tower = CLIPVisionTower(spec.tower)
        self.projector = Projector(spec.tower.hidden_size, spec.text_hidden_size, spec.projector_act,
                                   spec.projector_bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixel_values))


def checkpoint_part(name: str) -> tuple[str, str]:
    """Where a checkpoint tensor of LLaVA's layout (Gemma 3's too) belongs, and its name there:
    ("decoder", the name as the Llama-shaped families read it), ("tower", the name within the vision
    tower, `encoder.` and `embeddings.` dropped), ("projector", the name within the projector), or
    ("decoder", the name as it is) for the rest."""
    name = name.removeprefix("model.")
    if name.startswith("language_model."):
        name = name.removeprefix("language_model.")
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name  # transformers 5's own layout: model.language_model.layers...
        return "decoder", name
    if name.startswith("vision_tower."):
        name = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        return "tower", name.removeprefix("embeddings.").replace("encoder.layers.", "layers.")
    if name.startswith("multi_modal_projector."):
        return "projector", name.removeprefix("multi_modal_projector.")
    return "decoder", name


def checkpoint_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, Any]]:
    """LLaVA's names under ours: the decoder's as the Llama-shaped families read them, the tower
    and the projector under `vision.`."""
    part, name = checkpoint_part(name)
    if part == "decoder":
        return text_checkpoint_tensors(name, tensor, args)
    if part == "tower" and (name.startswith(("post_layernorm.", "head.")) or name.startswith("layers.") and
                            int(name.split(".")[1]) >= args.vision.tower.layers_to_run):
        return []  # past the feature layer: never run
    return [(f"vision.{part}.{name}", tensor)]


def llava(config: dict[str, Any]) -> ModelArgs:
    text = dict(config["text_config"])
    family = TEXT_FAMILIES.get(text.get("model_type", "llama"))
    if family is None:
        raise ValueError(f"LLaVA over a {text.get('model_type')!r} decoder is not supported "
                         f"(supported: {', '.join(sorted(TEXT_FAMILIES))})")
    text["architectures"] = [config["architectures"][0]]
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    args = family(text)
    tower = VisionArgs.from_config(config["vision_config"], config.get("vision_feature_layer", -2),
                                   config.get("vision_feature_select_strategy", "default"))
    args.vision = LlavaVision(tower, args.hidden_size, config.get("image_token_index", config.get("image_token_id")),
                              config.get("projector_hidden_act", "gelu"), config.get("multimodal_projector_bias", True))
    args.checkpoint_names = checkpoint_tensors  # a module-level function: ModelArgs compare equal
    return args


ARCHITECTURES = {"LlavaForConditionalGeneration": llava}
