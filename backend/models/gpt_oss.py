"""gpt-oss: a pre-norm decoder whose attention has q/k/v/o biases, a learned sink logit per head
(joining each softmax's denominator) and sliding-window layers alternating with full ones
(`layer_types`), yarn RoPE; every MLP is a mixture of experts (`layers/moe.py`) routed by a biased
linear (top-k logits, softmax over those) whose experts run a clamped SwiGLU with biases:

    gate = min(gate, limit); up = clamp(up, -limit, limit); out = (up + 1) * gate * sigmoid(alpha * gate)

The checkpoint stores the experts fused and transposed ([E, hidden, 2I] with gate and up
interleaved column by column, [E, I, hidden]); the MoE loader splits them per expert."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backend.models.decoder import ModelArgs
from backend.layers.moe import EXPERT_ACTIVATIONS, MoEArgs
from backend.models.llama import dense_args


def clamped_swiglu(gate_up: nn.Module, x: torch.Tensor, moe: MoEArgs) -> torch.Tensor:
    gate, up = gate_up(x).chunk(2, dim=-1)
    limit, alpha = moe.activation_options["limit"], moe.activation_options["alpha"]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


EXPERT_ACTIVATIONS["clamped_swiglu"] = clamped_swiglu


def gpt_oss(config: dict[str, Any]) -> ModelArgs:
    num_layers = config["num_hidden_layers"]
    moe = MoEArgs(num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                  intermediate_size=config["intermediate_size"], sparse_layers=(True,) * num_layers,
                  scoring="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
                  activation_options={"alpha": config.get("swiglu_alpha", 1.702),
                                      "limit": config.get("swiglu_limit", 7.0)},
                  fused_transposed=True, gate_up_interleaved=True)
    bias = config.get("attention_bias", True)
    return dense_args(config, qkv_bias=bias, o_bias=bias, attention_sinks=True, moe=moe)


ARCHITECTURES = {"GptOssForCausalLM": gpt_oss}
