"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA 1.5's CLIP tower, projector and decoder
(`llava.py`), with any-resolution images. The processor picks for each image the best of the
config's `image_grid_pinpoints` (a grid of tower-sized tiles) and sends a downscaled whole image
first, then the tiles; the model lays the tiles' patch features out as one grid, crops the rows or
columns that are only padding (from the image's original size), and ends each row with the learned
`image_newline`. So an image's placeholder count depends on its size.

Checkpoint names: LLaVA's, plus `[model.]image_newline`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backend.layers.vision import CLIPVisionTower, Projector
from backend.models.decoder import ModelArgs
from backend.models.llava import LlavaVision, llava
from backend.models.llava import checkpoint_tensors as llava_checkpoint_tensors

# transformers' default, llava-v1.6's: (height, width) in pixels, multiples of the tower's image size
DEFAULT_GRID_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The pinpoint that keeps most of the image's pixels when it is scaled to fit, then wastes the
    fewest (transformers' `select_best_resolution`, which the processor tiles the image by)."""
    best, most_kept, least_wasted = pinpoints[0], 0, float("inf")
    for fit_height, fit_width in pinpoints:
        scale = min(fit_width / width, fit_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = fit_width * fit_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (fit_height, fit_width), kept, wasted
    return best


def unpadded(height: int, width: int, rows: int, cols: int) -> tuple[slice, slice]:
    """The rows and columns of a rows x cols feature grid that hold the image (height x width, scaled
    to fit and centred by the processor), not padding; as transformers' `unpad_image` rounds them."""
    if width / height > cols / rows:  # wider than the grid: padding above and below
        padding = (rows - int(round(height * (cols / width), 7))) // 2
        return slice(padding, rows - padding), slice(0, cols)
    padding = (cols - int(round(width * (rows / height), 7))) // 2
    return slice(0, rows), slice(padding, cols - padding)


@dataclass(frozen=True)
class LlavaNextVision(LlavaVision):
    """LLaVA's vision side, plus the tile grids an image may be cut into."""
    grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_GRID_PINPOINTS

    @property
    def patches_per_side(self) -> int:
        return self.tower.image_size // self.tower.patch_size

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """The tiles (rows, columns) the processor cuts an image of this size into."""
        fit_height, fit_width = best_resolution(height, width, self.grid_pinpoints)
        return fit_height // self.tower.image_size, fit_width // self.tower.image_size

    def feature_grid(self, height: int, width: int) -> tuple[int, int, slice, slice]:
        """The tiles' patch features as one grid: (rows, columns, the rows kept, the columns kept)."""
        tile_rows, tile_cols = self.tile_grid(height, width)
        rows, cols = tile_rows * self.patches_per_side, tile_cols * self.patches_per_side
        return (rows, cols, *unpadded(height, width, rows, cols))

    def image_input(self, outputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """One image's tiles (less the processor's padding to the prompt's most tiles) and its size;
        its placeholders: the whole image's features, then each kept grid row and its newline."""
        height, width = outputs["image_sizes"].tolist()
        tile_rows, tile_cols = self.tile_grid(height, width)
        whole = self.tower.num_patches + (0 if self.tower.drop_class_token else 1)
        _, _, kept_rows, kept_cols = self.feature_grid(height, width)
        length = whole + (kept_rows.stop - kept_rows.start) * (kept_cols.stop - kept_cols.start + 1)
        return {**outputs, "pixel_values": outputs["pixel_values"][:1 + tile_rows * tile_cols]}, length

    def build(self) -> nn.Module:
        return LlavaNextEncoder(self)


class LlavaNextEncoder(nn.Module):
    """Images of one tile count [N, tiles, 3, H, W] and their sizes [N, 2] -> each image's features
    in the decoder's width: [its placeholder count, hidden] (a list: counts differ with the size)."""

    def __init__(self, spec: LlavaNextVision) -> None:
        super().__init__()
        self.spec = spec
        self.tower = CLIPVisionTower(spec.tower)
        self.projector = Projector(spec.tower.hidden_size, spec.text_hidden_size, spec.projector_act,
                                   spec.projector_bias)
        self.image_newline = nn.Parameter(torch.empty(spec.text_hidden_size))

    def forward(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> list[torch.Tensor]:
        num_images, num_tiles = pixel_values.shape[:2]
        features = self.projector(self.tower(pixel_values.flatten(0, 1)))
        features = features.view(num_images, num_tiles, *features.shape[1:])
        return [self.pack(tiles, *size) for tiles, size in zip(features, image_sizes.tolist())]

    def pack(self, tiles: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """One image's tile features [tiles, patches, hidden] in placeholder order."""
        whole, hidden = tiles[0], tiles.shape[-1]
        rows, cols, kept_rows, kept_cols = self.spec.feature_grid(height, width)
        side = self.spec.patches_per_side
        tile_rows, tile_cols = rows // side, cols // side
        # [tile row, tile column, patch row, patch column] -> [feature row, feature column]
        grid_features = tiles[1:].view(tile_rows, tile_cols, side, side, hidden).permute(0, 2, 1, 3, 4)
        grid_features = grid_features.reshape(rows, cols, hidden)[kept_rows, kept_cols]
        newlines = self.image_newline.to(whole.dtype).expand(grid_features.shape[0], 1, hidden)
        return torch.cat([whole, torch.cat([grid_features, newlines], dim=1).flatten(0, 1)])


def checkpoint_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, Any]]:
    """LLaVA's names, and the newline embedding under the vision encoder."""
    if name.removeprefix("model.") == "image_newline":
        return [("vision.image_newline", tensor)]
    return llava_checkpoint_tensors(name, tensor, args)


def llava_next(config: dict[str, Any]) -> ModelArgs:
    args = llava(config)
    pinpoints = tuple(tuple(p) for p in config.get("image_grid_pinpoints", DEFAULT_GRID_PINPOINTS))
    size = args.vision.tower.image_size
    if any(len(p) != 2 or p[0] % size or p[1] % size for p in pinpoints):
        raise ValueError(f"image_grid_pinpoints {pinpoints}: each must be (height, width), multiples of {size}")
    if not args.vision.tower.drop_class_token:  # transformers' tile layout has no room for a class token
        raise ValueError("LLaVA-NeXT with vision_feature_select_strategy 'full' is not supported")
    args.vision = LlavaNextVision(**vars(args.vision), grid_pinpoints=pinpoints)
    args.checkpoint_names = checkpoint_tensors
    return args


ARCHITECTURES = {"LlavaNextForConditionalGeneration": llava_next}
