"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP tower (`layers/siglip.py`), a
projector that average-pools its patch features to `mm_tokens_per_image`, normalises them (Gemma's
(1 + w) RMSNorm) and projects them into the decoder's width, and the Gemma 3 text decoder of
`gemma.py`. Each image's placeholder token stands once per pooled feature.

Unlike LLaVA's, the decoder attends bidirectionally among the placeholders of one image during
prefill (Hugging Face's `token_type_ids` mask: causal OR same image, then the sliding window on the
sliding layers). The spec says so (`bidirectional_images`): the scheduler then never ends a prefill
chunk inside an image, and the runner marks each chunk's image spans for the attention op.

Checkpoint names: `model.language_model.*` (or `language_model.model.*`) are the decoder's,
`lm_head` (or `language_model.lm_head`) its head, `[model.]vision_tower.vision_model.*` and
`[model.]multi_modal_projector.*` the vision encoder's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend.errors import EngineError
from backend.layers.norm import RMSNorm
from backend.layers.siglip import SiglipVisionTower, siglip_args
from backend.layers.vision import VisionArgs
from backend.models.decoder import ModelArgs
from backend.models.gemma import gemma3
from backend.models.llama import checkpoint_tensors as text_checkpoint_tensors
from backend.models.llava import checkpoint_part


@dataclass(frozen=True)
class Gemma3Vision:
    """The vision side of Gemma 3: its tower, the pooled feature count and the placeholder token."""
    tower: VisionArgs
    text_hidden_size: int
    image_token_id: int
    mm_tokens_per_image: int
    bidirectional_images: bool = True  # an image's placeholders see each other in the decoder

    def image_input(self, outputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """One image's processor outputs as its encoder takes them (its pixels), and its placeholder count."""
        return {"pixel_values": outputs["pixel_values"]}, self.mm_tokens_per_image

    def build(self) -> nn.Module:
        return Gemma3Encoder(self)

    @staticmethod
    def load_processor(model_path: str) -> Any:
        """transformers' Gemma 3 processor, refused where it would add pan-and-scan crops (each a
        further image sequence in the prompt, which the engine does not place)."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=False)
        if getattr(processor.image_processor, "do_pan_and_scan", False):
            raise EngineError("model", "Gemma 3's pan-and-scan crops are not supported: set do_pan_and_scan "
                              "to false in the model's processor config")
        return processor


class Gemma3Projector(nn.Module):
    """Patch features [N, P * P, vision hidden] -> [N, mm_tokens_per_image, text hidden]: an average
    pool over square groups of patches, the soft-embedding norm, then a projection (a bare matrix,
    [vision hidden, text hidden], as the checkpoint stores it)."""

    def __init__(self, spec: Gemma3Vision) -> None:
        super().__init__()
        self.patches_per_side = spec.tower.image_size // spec.tower.patch_size
        self.kernel = self.patches_per_side // round(spec.mm_tokens_per_image ** 0.5)
        self.mm_soft_emb_norm = RMSNorm(spec.tower.hidden_size, spec.tower.layer_norm_eps, load_offset=1.0)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(spec.tower.hidden_size, spec.text_hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch, _, width = features.shape
        grid = features.transpose(1, 2).reshape(batch, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [N, tokens, width]
        # (rows, width) in row-major order: the norm kernels read each row as one contiguous vector
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, width).contiguous()).view(pooled.shape)
        return torch.matmul(normed, self.mm_input_projection_weight)


class Gemma3Encoder(nn.Module):
    """Images [N, 3, H, W] -> their features in the decoder's width, [N, mm_tokens_per_image, hidden]."""

    def __init__(self, spec: Gemma3Vision) -> None:
        super().__init__()
        self.tower = SiglipVisionTower(spec.tower)
        self.projector = Gemma3Projector(spec)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixel_values))


def checkpoint_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, Any]]:
    """Gemma 3's names under ours (LLaVA's layout): the decoder's as the dense families read them, the
    tower and the projector under `vision.` (SigLIP's attention-pooling head, never run, skipped)."""
    part, name = checkpoint_part(name)
    if part == "decoder":
        return text_checkpoint_tensors(name, tensor, args)
    return [] if part == "tower" and name.startswith("head.") else [(f"vision.{part}.{name}", tensor)]


def gemma3_vision(config: dict[str, Any]) -> ModelArgs:
    from transformers import Gemma3Config

    # Released checkpoints leave most sizes to the config classes' defaults: take them from there.
    full = Gemma3Config(**{key: value for key, value in config.items() if key != "architectures"})
    text = full.text_config.to_dict()
    text["architectures"] = [config["architectures"][0]]
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
    args = gemma3(text)
    tower = siglip_args(full.vision_config.to_dict())
    tokens = full.mm_tokens_per_image
    side = round(tokens ** 0.5)
    patches_per_side = tower.image_size // tower.patch_size
    if side * side != tokens or patches_per_side % side:
        raise ValueError(f"mm_tokens_per_image {tokens}: must be a square whose side divides the tower's "
                         f"{patches_per_side} patches a side")
    image_token_id = config.get("image_token_id", config.get("image_token_index", full.image_token_id))
    args.vision = Gemma3Vision(tower, args.hidden_size, image_token_id, tokens)
    args.checkpoint_names = checkpoint_tensors  # a module-level function: ModelArgs compare equal
    return args


ARCHITECTURES = {"Gemma3ForConditionalGeneration": gemma3_vision}
