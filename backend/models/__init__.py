"""Model implementations, each written against the paged-attention op, and the registry that picks
one by the `architectures` of a model's config.json. Every family is the dense decoder of
`decoder.py` with its options read from the config by a short mapping (`llama.py`, `gemma.py`,
`phi3.py`, `olmo2.py`; the mixtures of experts `mixtral.py`, `qwen_moe.py`, whose sparse layers
put `layers/moe.py` in the MLP's slot); the shared building blocks live in `layers/`. Each family's
mapping also names its checkpoint's weights (`ModelArgs.packed_modules_mapping`,
`ModelArgs.checkpoint_names`), which `loading.py` applies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend.errors import EngineError
from backend.models import (deepseek, gemma, gemma3_vision, gpt_oss, llama, llava, llava_next, mixtral, olmo2, phi3,
                            qwen2_5_vl, qwen_moe)
from backend.models.decoder import CausalLM, ModelArgs, check_parallel

ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ModelArgs]] = {
    **llama.ARCHITECTURES, **gemma.ARCHITECTURES, **phi3.ARCHITECTURES, **olmo2.ARCHITECTURES,
    **mixtral.ARCHITECTURES, **qwen_moe.ARCHITECTURES, **deepseek.ARCHITECTURES,
    **gpt_oss.ARCHITECTURES, **llava.ARCHITECTURES, **llava_next.ARCHITECTURES, **qwen2_5_vl.ARCHITECTURES,
    **gemma3_vision.ARCHITECTURES}

__all__ = ["ARCHITECTURES", "CausalLM", "ModelArgs", "architecture", "build_model", "check_parallel", "model_args"]


def architecture(config: dict[str, Any]) -> str:
    """The first of the config's `architectures` that the engine implements; a clear error naming
    the supported ones otherwise."""
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise EngineError("model", f"architecture {names} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")


def model_args(config: dict[str, Any]) -> ModelArgs:
    """The decoder's options for a Hugging Face config.json (as a dict)."""
    name = architecture(config)
    return ARCHITECTURES[name]({**config, "architectures": [name]})


def build_model(args: ModelArgs, parallel=None, max_positions: int | None = None) -> CausalLM:
    return CausalLM(args, parallel, max_positions)
