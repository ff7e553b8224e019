"""DeepSeek-V3 (and its tiny-config relatives): multi-head latent attention (`layers/mla.py`) with
an optional low-rank query, DeepSeek's yarn RoPE (the softmax scale grows by mscale(factor,
mscale_all_dim)^2) on interleaved rope dims, dense MLPs for the first `first_k_dense_replace`
layers and mixture-of-experts layers after them."""

from __future__ import annotations

import math
from typing import Any

from backend.models.decoder import ModelArgs
from backend.models.layers.mla import LatentAttentionArgs
from backend.models.llama import dense_args


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
    if config.get("first_k_dense_replace", num_layers) < num_layers and config.get("n_routed_experts"):
        raise NotImplementedError("DeepSeek-V3's mixture-of-experts layers are not supported yet")
    args = dense_args(config, head_dim=mla.qk_rope_head_dim, num_kv_heads=config["num_attention_heads"], mla=mla,
                      sliding_windows=())
    args.attention_scale = softmax_scale(mla, args.rope)
    return args


ARCHITECTURES = {"DeepseekV3ForCausalLM": deepseek_v3}
