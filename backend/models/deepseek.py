"""DeepSeek-V3 (and its tiny-config relatives): multi-head latent attention (`layers/mla.py`) with
an optional low-rank query, DeepSeek's yarn RoPE (the softmax scale grows by mscale(factor,
mscale_all_dim)^2) on interleaved rope dims, dense MLPs for the first `first_k_dense_replace`
layers and mixture-of-experts layers after them. Its checkpoint keeps latent attention's projections
apart (their names are `layers/mla.py`'s own); only gate/up are packed."""

from __future__ import annotations

import math
from typing import Any

from backend.models.decoder import ModelArgs
from backend.layers.mla import LatentAttentionArgs
from backend.layers.moe import MoEArgs, sparse_layers
from backend.models.llama import PACKED_MODULES, dense_args

GATE_UP = {name: target for name, target in PACKED_MODULES.items() if target[0] == "gate_up_proj"}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(mla: LatentAttentionArgs, rope: dict[str, Any]) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled RoPE (Hugging Face's
    yarn_apply_mscale)."""
    scale = mla.qk_head_dim ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def deepseek_v3(config: dict[str, Any]) -> ModelArgs:
    mla = LatentAttentionArgs(kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
                              qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
                              q_lora_rank=config.get("q_lora_rank"),
                              rope_interleave=config.get("rope_interleave", True) is not False)
    num_layers = config["num_hidden_layers"]
    moe = None
    if config.get("n_routed_experts"):
        moe = MoEArgs(num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
                      intermediate_size=config["moe_intermediate_size"],
                      sparse_layers=sparse_layers(num_layers, config.get("first_k_dense_replace", 0),
                                                  moe_layer_freq=config.get("moe_layer_freq", 1)),
                      scoring="sigmoid", norm_topk_prob=config.get("norm_topk_prob", True),
                      num_groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1,
                      correction_bias=True, routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
                      router_float32=True,
                      shared_intermediate_size=config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0))
        if not any(moe.sparse_layers):
            moe = None
    args = dense_args(config, head_dim=mla.qk_rope_head_dim, num_kv_heads=config["num_attention_heads"], mla=mla,
                      moe=moe, sliding_windows=(), packed_modules_mapping=GATE_UP)
    args.attention_scale = softmax_scale(mla, args.rope)
    return args


ARCHITECTURES = {"DeepseekV3ForCausalLM": deepseek_v3}
