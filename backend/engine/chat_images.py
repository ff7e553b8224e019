"""Images in `LLM.chat`'s messages, as vLLM's offline API takes them: OpenAI-style content parts
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`. Each becomes the
`{"type": "image"}` part transformers' chat templates write the model's image placeholder for, and
its decoded image goes to the request's `multi_modal_data`. Only data URLs: the offline engine
fetches nothing and reads no files (the OpenAI frontend does, under the operator's rules)."""

from __future__ import annotations

import base64
import binascii
import re

from backend.errors import EngineError, check
from backend.multimodal import MAX_IMAGE_BYTES, decode_image

DATA_URL = re.compile(r"data:image/[^,;]*(?P<params>(?:;[^,;]*)*),(?P<payload>.*)", re.DOTALL | re.IGNORECASE)


def image_of_data_url(url: object, param: str, index: int):
    """A `data:image/...;base64,...` URL's image (RGB PIL), or EngineError(param)."""
    match = DATA_URL.fullmatch(url) if isinstance(url, str) else None
    check(match is not None and match.group("params").lower().endswith(";base64"), param,
          "image_url must be a data URL (data:image/<type>;base64,<data>); give other images to "
          "LLM.generate as PIL images in multi_modal_data")
    payload = match.group("payload")
    check(len(payload) // 4 * 3 <= MAX_IMAGE_BYTES + 3, param, f"image {index} is over {MAX_IMAGE_BYTES} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EngineError(param, f"image {index}'s base64 does not decode") from None
    return decode_image(data, param, index)


def chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """A conversation for the chat template, each image_url part as {"type": "image"}, and its
    images in order. A conversation without image parts comes back as it is."""
    template_messages: list[dict] = []
    images: list = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                    for p in content):
            template_messages.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                param = f"messages[{i}].content[{j}]"
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                images.append(image_of_data_url(url, param, len(images)))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        template_messages.append({**message, "content": parts})
    return template_messages, images
