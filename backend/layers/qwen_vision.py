"""Qwen2.5-VL's vision transformer: images at their own resolution (a grid of patches per image, the
processor's `image_grid_thw`), attention inside windows on most layers and over the whole image on
`fullatt_block_indexes`, a 2D rotary embedding (a patch's row and column), and a patch merger that
turns each `spatial_merge_size` x `spatial_merge_size` block of patches into one feature in the
decoder's width.

The tower takes a batch of images of one grid, [N, patches, C * T * P * P] as the processor
flattened them (patches in merge-block order). Like Hugging Face, it reorders the merge blocks so
that each window's are contiguous, runs the layers in that order (rotation is per patch, so order
does not matter to a full layer) and restores the order after the merger. A window layer attends
within each window: the windows of one size (whole ones, and those cut at the right and bottom
edges) are one batch, so its cost grows with the patches, not with their square.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend.layers.norm import RMSNorm
from backend.layers.sharding import Part, packed


@dataclass(frozen=True)
class QwenVisionArgs:
    """The tower's shape (config.json's `vision_config`)."""
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int  # in pixels
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @classmethod
    def from_config(cls, vision: dict) -> "QwenVisionArgs":
        if vision.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen2.5-VL vision hidden_act {vision['hidden_act']!r}: only 'silu' is supported")
        return cls(hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                   depth=vision["depth"], num_heads=vision["num_heads"], patch_size=vision["patch_size"],
                   temporal_patch_size=vision.get("temporal_patch_size", 2),
                   spatial_merge_size=vision.get("spatial_merge_size", 2), window_size=vision["window_size"],
                   out_hidden_size=vision["out_hidden_size"],
                   fullatt_block_indexes=tuple(vision["fullatt_block_indexes"]),
                   in_channels=vision.get("in_channels", 3),
                   rope_theta=(vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def window_order(height: int, width: int, window: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The merge blocks of a height x width grid (row-major) ordered window by window (windows of
    window x window blocks, row-major; row-major inside each), and the windows in that order as
    index tensors [windows of that size, size], one per size."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    windows_per_row = -(-width // window)
    window_of = ((rows // window) * windows_per_row + cols // window).flatten()
    order = torch.argsort(window_of * (height * width) + torch.arange(height * width))
    sizes = torch.bincount(window_of)
    starts = torch.cumsum(sizes, 0) - sizes
    windows = [starts[sizes == size, None] + torch.arange(int(size)) for size in sizes.unique()]
    return order, windows


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention, [B, L, H, D] in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class QwenVisionAttention(nn.Module):
    """Bidirectional attention over an image's patches, or inside each window (`windows`: the
    patches of each window, by window size), q and k rotated by each patch's row and column."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: list[torch.Tensor] | None):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.num_heads, -1).unbind(2)
        cos, sin = cos[:, None], sin[:, None]  # [length, 1, head_dim]: the same for every head
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)  # in float32, as Hugging Face
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        if windows is None:
            out = attend(q, k, v)
        else:
            out = torch.empty_like(q)
            for index in windows:  # [windows of one size, size]: each image's windows, one batch
                out[:, index] = attend(*(t[:, index].flatten(0, 1) for t in (q, k, v))).unflatten(0, (batch, -1))
        return self.proj(out.reshape(batch, length, width))


class QwenVisionMLP(nn.Module):
    """SwiGLU with biases; the checkpoint's gate_proj and up_proj packed into gate_up_proj."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size)
        part = Part(args.intermediate_size, args.intermediate_size, lambda t: t)
        self.weight_loaders = {"gate_up_proj": packed([part, part], 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class QwenVisionBlock(nn.Module):
    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, 1e-6)
        self.attn = QwenVisionAttention(args)
        self.norm2 = RMSNorm(args.hidden_size, 1e-6)
        self.mlp = QwenVisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: list[torch.Tensor] | None):
        x = x + self.attn(self.norm1(x.flatten(0, 1)).view_as(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x.flatten(0, 1))).view_as(x)


class PatchMerger(nn.Module):
    """Each merge block's patches, normalised and concatenated, through a GELU MLP into the decoder's width."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        width = args.hidden_size * args.merge_unit
        self.ln_q = RMSNorm(args.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, args.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, patches, hidden] (a merge block's patches consecutive) -> [N, patches / merge_unit, out_hidden]."""
        return self.mlp(self.ln_q(x.flatten(0, 1)).view(x.shape[0], -1, self.mlp[0].in_features))


class QwenVisionTower(nn.Module):
    """Images of one grid [N, patches, patch_dim] -> their merged features [N, patches / merge_unit, out_hidden]."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = nn.Linear(args.patch_dim, args.hidden_size, bias=False)  # the checkpoint's Conv3d
        self.blocks = nn.ModuleList(QwenVisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    def rotary(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] float32 for a height x width patch grid in merge-block order:
        the first half of each head's frequencies turn with the patch's row, the second with its column."""
        merge = self.args.spatial_merge_size
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        blocks = (height // merge, merge, width // merge, merge)
        rows, cols = (t.reshape(blocks).transpose(1, 2).flatten() for t in (rows, cols))
        quarter = self.args.hidden_size // self.args.num_heads // 2
        inv_freq = 1.0 / (self.args.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        angles = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Images with as many patches [N, patches, patch_dim] and their grids [N, 3] -> their features
        [N, patches / merge_unit, out_hidden]; the images of each grid run as one batch."""
        grids = [tuple(grid) for grid in image_grid_thw.tolist()]
        if len(set(grids)) == 1:
            return self.encode(pixel_values, grids[0])
        features = [torch.empty(0)] * len(grids)
        for grid in set(grids):
            same = [i for i, other in enumerate(grids) if other == grid]
            for i, feature in zip(same, self.encode(pixel_values[same], grid)):
                features[i] = feature
        return torch.stack(features)

    def encode(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        args = self.args
        frames, height, width = grid_thw
        if frames != 1:
            raise ValueError(f"a grid of {frames} frames: the Qwen2.5-VL tower here takes images (1 frame)")
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        merge = args.spatial_merge_size
        order, windows = window_order(height // merge, width // merge, args.window_size // merge // args.patch_size)

        def by_window(t: torch.Tensor) -> torch.Tensor:  # [.., patches, D] in window order of their merge blocks
            return t.unflatten(-2, (-1, args.merge_unit))[..., order.to(t.device), :, :].flatten(-3, -2)

        x = by_window(x)
        cos, sin = (by_window(t).to(device) for t in self.rotary(height, width))
        unit = torch.arange(args.merge_unit)  # a window's merge blocks -> their patches
        windows = [(index[..., None] * args.merge_unit + unit).flatten(1).to(device) for index in windows]
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if index in args.fullatt_block_indexes else windows)
        return self.merger(x)[:, torch.argsort(order).to(device)]
