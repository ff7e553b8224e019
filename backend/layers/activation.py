"""Gated MLP activations: act(gate) * up over one fused gate/up projection. SiLU (SwiGLU) keeps the
fused CPU op (`ops.linear_silu_and_mul`, which a packed bfloat16 linear applies as it writes);
GELU with the tanh approximation (GeGLU, the Gemma families) and exact GELU run in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend import ops

# Hugging Face's hidden_act names -> ours
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


def activation_name(hf_name: str) -> str:
    if hf_name not in ACTIVATIONS:
        raise NotImplementedError(f"hidden_act {hf_name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[hf_name]


def gated_activation(gate_up: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of gate_up(x) = [gate, up]."""
    if activation == "silu":
        return ops.linear_silu_and_mul(gate_up, x)
    gate, up = gate_up(x).chunk(2, dim=-1)
    # In place on GELU's own output: one allocation fewer per layer, the same values.
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none").mul_(up)
