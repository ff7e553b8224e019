"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders (q/k/v biases; per-head q/k norms) with a
mixture of experts on the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse (the others
keep the dense MLP of `intermediate_size`). Softmax routing, top-k weights renormalised when
`norm_topk_prob`; Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from typing import Any

from backend.models.decoder import ModelArgs
from backend.layers.moe import MoEArgs, sparse_layers
from backend.models.llama import dense_args


def moe_args(config: dict[str, Any], **options: Any) -> MoEArgs:
    return MoEArgs(num_experts=config.get("num_experts") or config["num_local_experts"],
                   top_k=config["num_experts_per_tok"], intermediate_size=config["moe_intermediate_size"],
                   norm_topk_prob=config.get("norm_topk_prob", False),
                   sparse_layers=sparse_layers(config["num_hidden_layers"],
                                               decoder_sparse_step=config.get("decoder_sparse_step", 1),
                                               mlp_only_layers=config.get("mlp_only_layers") or ()),
                   **options)


def qwen2_moe(config: dict[str, Any]) -> ModelArgs:
    shared = config.get("shared_expert_intermediate_size") or 0
    moe = moe_args(config, shared_intermediate_size=shared, shared_expert_gate=bool(shared))
    return dense_args(config, qkv_bias=config.get("qkv_bias", True), o_bias=False, moe=moe)


def qwen3_moe(config: dict[str, Any]) -> ModelArgs:
    return dense_args(config, qk_norm="head", moe=moe_args(config))


ARCHITECTURES = {"Qwen2MoeForCausalLM": qwen2_moe, "Qwen3MoeForCausalLM": qwen3_moe}
