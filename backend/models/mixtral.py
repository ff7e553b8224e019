"""Mixtral: Mistral's decoder with a mixture of experts on every layer (softmax router, top-k
weights renormalised, no shared experts); Hugging Face's `block_sparse_moe` with w1/w3/w2 experts
loads under our names (`layers/moe.py`)."""

from __future__ import annotations

from typing import Any

from backend.models.decoder import ModelArgs
from backend.layers.moe import MoEArgs, sparse_layers
from backend.models.llama import dense_args


def mixtral(config: dict[str, Any]) -> ModelArgs:
    moe = MoEArgs(num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                  intermediate_size=config["intermediate_size"], norm_topk_prob=True,
                  sparse_layers=sparse_layers(config["num_hidden_layers"]))
    return dense_args(config, moe=moe)


ARCHITECTURES = {"MixtralForCausalLM": mixtral}
