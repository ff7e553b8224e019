"""OLMo 2: norms after each block instead of before (`layout="post"`), q/k RMSNorms across all
heads, applied to the projections before they split into heads."""

from __future__ import annotations

from typing import Any

from backend.models.decoder import ModelArgs
from backend.models.llama import dense_args


def olmo2(config: dict[str, Any]) -> ModelArgs:
    return dense_args(config, layout="post", qk_norm="full")


ARCHITECTURES = {"Olmo2ForCausalLM": olmo2}
