"""Images into a request, as vLLM's offline API takes them: `{"prompt": text, "multi_modal_data":
{"image": a PIL image or a list of them}}`.

The model's own Hugging Face processor (`AutoProcessor`, from the model's folder) turns the text and
images into token ids, with each image's placeholder token repeated once per feature the vision
tower will make, and into pixel tensors. Each image becomes an `ImageInput`: its pixels, where its
placeholders sit in the prompt, and a hash of its pixels, which keys the prefix cache (the same
image and prompt share blocks, a different image never does) and the runner's encoder cache. The
model's vision spec says, from one image's processor outputs, what its encoder takes and how many
placeholders it has (`image_input`): a fixed count for LLaVA 1.5, one that depends on the image's
size for LLaVA-NeXT.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from backend.errors import EngineError, check

MAX_IMAGES_PER_PROMPT = 16  # vLLM's --limit-mm-per-prompt; the engine's own bound
MAX_IMAGE_BYTES = 20 << 20  # an encoded image (PNG, JPEG, ...) as a client sends it
MAX_IMAGE_PIXELS = 50_000_000  # decoded: width x height, checked before the pixels are decoded


@dataclass(frozen=True)
class ImageInput:
    pixel_values: torch.Tensor  # as the model's image processor made it: [3, H, W]; [tiles, 3, H, W] for LLaVA-NeXT
    offset: int  # the first of its placeholder tokens in the prompt
    length: int  # its placeholder tokens: the features the model makes of it
    hash: str  # sha256 of its pixels and extras (shapes and values)
    # The processor's other outputs for this image that its encoder takes too (LLaVA-NeXT's image_sizes).
    extras: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of this image's placeholders among prompt positions [start, end), as offsets
        into its features, or None."""
        first, last = max(start, self.offset), min(end, self.offset + self.length)
        return (first - self.offset, last - self.offset) if first < last else None


def pixel_hash(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        data = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(str(tuple(data.shape)).encode() + data.numpy().tobytes())
    return digest.hexdigest()


def images_of(multi_modal_data: Any) -> list:
    """The images of a request's `multi_modal_data` (one or a list), checked to be images."""
    check(isinstance(multi_modal_data, dict), "multi_modal_data", "must be a dict such as {'image': image}")
    unknown = set(multi_modal_data) - {"image"}
    check(not unknown, "multi_modal_data", f"only 'image' is supported, not {sorted(unknown)}")
    images = multi_modal_data.get("image")
    images = images if isinstance(images, (list, tuple)) else [images]
    from PIL import Image

    for index, image in enumerate(images):
        check(isinstance(image, Image.Image), "multi_modal_data",
              f"image {index} must be a PIL image, not {type(image).__name__}")
    check(0 < len(images) <= MAX_IMAGES_PER_PROMPT, "multi_modal_data",
          f"takes 1 to {MAX_IMAGES_PER_PROMPT} images per prompt, not {len(images)}")
    return list(images)


def decode_image(data: bytes, param: str, index: int = 0):
    """An encoded image (PNG, JPEG, WebP, ...) as an RGB PIL image; EngineError(param) for bytes
    that are not an image, too many bytes, or too many pixels (checked from the header, before the
    pixels are decoded: a small file can claim a huge image)."""
    import io

    from PIL import Image, UnidentifiedImageError

    check(len(data) <= MAX_IMAGE_BYTES, param, f"image {index} is {len(data)} bytes; at most {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        check(width * height <= MAX_IMAGE_PIXELS, param,
              f"image {index} is {width} x {height} pixels; at most {MAX_IMAGE_PIXELS} in all")
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        if isinstance(error, EngineError):
            raise
        raise EngineError(param, f"image {index} could not be decoded ({type(error).__name__})") from None


ImageOutputs = dict[str, torch.Tensor]  # one image's processor outputs: pixel_values and, for some models, more


class ImageProcessor:
    """The model's processor, and for each image what its encoder takes and how many placeholder
    tokens it has (`image_input`, from the model's vision spec)."""

    def __init__(self, model_path: str, image_token_id: int,
                 image_input: Callable[[ImageOutputs], tuple[ImageOutputs, int]],
                 load_processor: Callable[[str], Any] | None = None) -> None:
        from transformers import AutoProcessor

        # A vision spec may load its processor itself (Qwen2.5-VL's, without the video half).
        self.processor = load_processor(model_path) if load_processor is not None else \
            AutoProcessor.from_pretrained(model_path, trust_remote_code=False)
        self.image_token_id = image_token_id
        self.image_input = image_input
        # The outputs with one entry per image (pixel_values; LLaVA-NeXT's image_sizes too).
        self.image_keys = list(getattr(self.processor.image_processor, "model_input_names", ["pixel_values"]))

    def __call__(self, prompt: str, multi_modal_data: Any) -> tuple[list[int], list[ImageInput]]:
        images = images_of(multi_modal_data)
        try:
            inputs = self.processor(text=prompt, images=images, return_tensors="pt")
        except (ValueError, TypeError, OSError) as error:  # e.g. placeholders and images disagree in number
            raise EngineError("multi_modal_data", f"the model's processor refused the prompt and images: {error}") \
                from None
        prompt_ids = inputs["input_ids"][0].tolist()
        positions = [i for i, token in enumerate(prompt_ids) if token == self.image_token_id]
        per_image = {key: inputs[key] for key in self.image_keys if key in inputs}
        if "image_grid_thw" in inputs:  # Qwen2-VL's family: every image's patches in one run, split by its grid
            per_image["pixel_values"] = inputs["pixel_values"].split(inputs["image_grid_thw"].prod(-1).tolist())
        result, cursor = [], 0
        for index in range(len(images)):
            outputs, length = self.image_input({key: values[index] for key, values in per_image.items()})
            pixels = outputs["pixel_values"]
            extras = {key: value for key, value in outputs.items() if key != "pixel_values"}
            run = positions[cursor:cursor + length]
            check(len(run) == length and run[-1] - run[0] == length - 1, "prompt",
                  f"image {index}'s placeholder tokens are not where the processor puts them: "
                  "give one image placeholder per image, as the model's chat template writes it")
            result.append(ImageInput(pixels, run[0], length, pixel_hash(pixels, *extras.values()), extras))
            cursor += length
        check(cursor == len(positions), "prompt", f"holds {len(positions) - cursor} image placeholder tokens "
              "with no image for them")
        return prompt_ids, result
