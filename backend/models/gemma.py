"""The Gemma families: (1 + w) RMSNorm, embeddings scaled by sqrt(hidden_size), GeGLU (GELU with
the tanh approximation), tied embeddings. Gemma 2 adds norms after each block ("sandwich"),
attention and final logit soft-capping, query_pre_attn_scalar and a sliding window on every other
layer; Gemma 3 (text) per-head q/k norms, five sliding layers to one global, and a RoPE base of its
own for the sliding layers."""

from __future__ import annotations

from typing import Any

from backend.models.decoder import ModelArgs
from backend.layers.activation import activation_name
from backend.layers.rotary import rope_parameters
from backend.models.llama import dense_args, sliding_windows


def _activation(config: dict[str, Any]) -> str:
    name = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    return activation_name("gelu_pytorch_tanh" if name == "gelu" else name)  # Gemma's "gelu" means tanh


def gemma(config: dict[str, Any], **options: Any) -> ModelArgs:
    fields = dict(activation=_activation(config), norm_offset=1.0, embed_multiplier=config["hidden_size"] ** 0.5,
                  embed_multiplier_in_dtype=True, tie_word_embeddings=config.get("tie_word_embeddings", True))
    fields.update(options)
    return dense_args(config, **fields)


def _windows(config: dict[str, Any], every: int) -> tuple[int | None, ...]:
    """layer_types where the config has them; else Hugging Face's older rule (a global layer every
    `every` layers: Gemma 2 the odd ones, Gemma 3 each sixth)."""
    if config.get("layer_types") or not config.get("sliding_window"):
        return sliding_windows(config, config["num_hidden_layers"])
    window = config["sliding_window"]
    return tuple(None if (i + 1) % every == 0 else window for i in range(config["num_hidden_layers"]))


def gemma2(config: dict[str, Any]) -> ModelArgs:
    return gemma(config, layout="sandwich", sliding_windows=_windows(config, 2),
                 attention_scale=config.get("query_pre_attn_scalar", 256) ** -0.5,
                 attn_logit_softcap=config.get("attn_logit_softcapping"),
                 final_logit_softcap=config.get("final_logit_softcapping"))


def gemma3(config: dict[str, Any]) -> ModelArgs:
    if "sliding_attention" in (config.get("rope_parameters") or {}):
        rope, local_rope = (rope_parameters(config, "full_attention"), rope_parameters(config, "sliding_attention"))
    else:  # the older form: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        rope = rope_parameters(config)
        local_rope = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
    return gemma(config, layout="sandwich", qk_norm="head", rope=rope, local_rope=local_rope,
                 sliding_windows=_windows(config, config.get("sliding_window_pattern", 6)),
                 attention_scale=config.get("query_pre_attn_scalar", 256) ** -0.5,
                 attn_logit_softcap=config.get("attn_logit_softcapping"),
                 final_logit_softcap=config.get("final_logit_softcapping"))


ARCHITECTURES = {"GemmaForCausalLM": gemma, "Gemma2ForCausalLM": gemma2, "Gemma3ForCausalLM": gemma3}
