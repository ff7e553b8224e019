"""Phi-3 and Phi-4-mini: Llama-shaped, with q/k/v and gate/up stored fused in the checkpoint (the
packed layers' loaders split them, `layers/sharding.packed`), longrope scaling and, on Phi-4-mini, a
partial rotary dimension; Phi-3-mini's config sets a sliding window on every layer."""

from __future__ import annotations

from typing import Any

from backend.models.decoder import ModelArgs
from backend.models.llama import dense_args


def phi3(config: dict[str, Any]) -> ModelArgs:
    return dense_args(config, qkv_bias=False, o_bias=False)


ARCHITECTURES = {"Phi3ForCausalLM": phi3}
