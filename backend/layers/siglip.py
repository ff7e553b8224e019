"""SigLIP's vision transformer, the tower of Gemma 3 (and PaliGemma): CLIP's encoder layers
(`layers/vision.py`) behind a patch embedding with a bias and learned positions, no class token,
no norm before the layers, and a layer norm after the last one. Its features are the last layer's,
one per patch, in row-major patch order; the attention-pooling head is never run.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.layers.vision import VisionArgs, VisionLayer


def siglip_args(vision: dict) -> VisionArgs:
    """A SigLIP tower's shape from its config.json `vision_config` (features from the last layer)."""
    return VisionArgs(hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                      num_layers=vision["num_hidden_layers"], num_heads=vision["num_attention_heads"],
                      image_size=vision["image_size"], patch_size=vision["patch_size"],
                      layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                      hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
                      num_channels=vision.get("num_channels", 3), feature_layer=-1, drop_class_token=False)


class SiglipVisionTower(nn.Module):
    """[N, 3, H, W] at the tower's image size -> [N, patches, hidden] after the post-layernorm."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, args.patch_size, args.patch_size)
        self.position_embedding = nn.Embedding(args.num_patches, args.hidden_size)
        self.layers = nn.ModuleList(VisionLayer(args) for _ in range(args.num_layers))
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.args.num_patches:
            raise ValueError(f"images of {tuple(pixel_values.shape[-2:])} pixels: this tower takes "
                             f"{self.args.image_size} x {self.args.image_size}")
        x = patches + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)
