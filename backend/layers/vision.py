"""Vision towers: the ViT encoders vision-language models put in front of their decoder (CLIP for
LLaVA), and the projector that maps their features into the decoder's embedding space.

A tower takes a batch of images of one size, [N, 3, H, W] as the model's image processor made them,
and returns each patch's features from the layer the model selects (`feature_layer`, counted as
Hugging Face's `hidden_states` are: 0 is the embeddings, -1 the last layer, so only the layers up
to it run). Attention over an image's patches is bidirectional; nothing here is paged or cached
(the runner's encoder cache keeps the projected features until the prompt has consumed them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend.layers.sharding import Part, packed

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionArgs:
    """A CLIP-style tower's shape (config.json's `vision_config`) and how its features are used."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    num_channels: int = 3
    feature_layer: int = -2  # hidden_states index whose features are used
    drop_class_token: bool = True  # vision_feature_select_strategy "default"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def layers_to_run(self) -> int:
        return self.feature_layer if self.feature_layer >= 0 else self.num_layers + 1 + self.feature_layer

    @classmethod
    def from_config(cls, vision: dict, feature_layer: int, strategy: str) -> "VisionArgs":
        if not isinstance(feature_layer, int):
            raise ValueError(f"vision_feature_layer {feature_layer!r}: only one layer is supported")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r}: 'default' or 'full'")
        return cls(hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                   num_layers=vision["num_hidden_layers"], num_heads=vision["num_attention_heads"],
                   image_size=vision["image_size"], patch_size=vision["patch_size"],
                   layer_norm_eps=vision.get("layer_norm_eps", 1e-5), hidden_act=vision.get("hidden_act", "quick_gelu"),
                   num_channels=vision.get("num_channels", 3), feature_layer=feature_layer,
                   drop_class_token=strategy == "default")


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's patches; q/k/v in one projection (the checkpoint's
    q_proj, k_proj and v_proj packed as the decoder's are)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv_proj = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.out_proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.weight_loaders = {"qkv_proj": packed([Part(args.hidden_size, args.hidden_size, lambda t: t)] * 3, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv_proj(x).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = VisionAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer up to the selected layer: patch embedding, a class token, learned
    positions, a layer norm before the layers (no post-norm: the features come from inside)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.class_embedding = nn.Parameter(torch.empty(args.hidden_size))
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, args.patch_size, args.patch_size,
                                         bias=False)
        self.position_embedding = nn.Embedding(args.num_patches + 1, args.hidden_size)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)  # (CLIP's spelling)
        self.layers = nn.ModuleList(VisionLayer(args) for _ in range(args.layers_to_run))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, patches (+ 1 with the class token kept), hidden]."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.args.num_patches:
            raise ValueError(f"images of {tuple(pixel_values.shape[-2:])} pixels: this tower takes "
                             f"{self.args.image_size} x {self.args.image_size}")
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x[:, 1:] if self.args.drop_class_token else x


class Projector(nn.Module):
    """LLaVA's multi-modal projector: linear, activation, linear, into the decoder's width."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))
