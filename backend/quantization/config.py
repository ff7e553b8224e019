"""QuantConfig: which quantization a model runs with, read from the checkpoint's
`quantization_config` (config.json) or asked for with the `quantization` engine option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHECKPOINT_METHODS = ("awq", "gptq", "gguf")  # the checkpoint holds the quantized weights
LOAD_TIME_METHODS = ("fp8", "int8")  # float weights, quantized as they load


@dataclass(frozen=True)
class QuantConfig:
    method: str
    bits: int = 8
    group_size: int = -1  # inputs per scale and zero; -1: one group per output channel
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" stores zero - 1, "gptq_v2" the zero

    def group_size_for(self, in_features: int) -> int:
        return self.group_size if self.group_size > 0 else in_features

    @classmethod
    def from_checkpoint(cls, stored: dict[str, Any]) -> QuantConfig:
        method = str(stored.get("quant_method", "")).lower()
        if method == "awq":
            version = str(stored.get("version", "gemm")).lower()
            bits = stored.get("bits", stored.get("w_bit", 4))
            if version != "gemm" or bits != 4 or not stored.get("zero_point", True):
                raise ValueError(f"quantization: AWQ checkpoints are read in AutoAWQ's GEMM layout, 4-bit with "
                                 f"zero points (got version {version!r}, bits {bits}, "
                                 f"zero_point {stored.get('zero_point', True)})")
            return cls("awq", 4, stored.get("group_size", stored.get("q_group_size", 128)), sym=False)
        if method == "gptq":
            bits, fmt = stored.get("bits", 4), stored.get("checkpoint_format", "gptq")
            if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2") or stored.get("lm_head", False):
                raise ValueError(f"quantization: GPTQ checkpoints are read with 4 or 8 bits, format gptq or "
                                 f"gptq_v2 and a float lm_head (got bits {bits}, checkpoint_format {fmt!r}, "
                                 f"lm_head {stored.get('lm_head', False)})")
            return cls("gptq", bits, stored.get("group_size", 128), sym=stored.get("sym", True),
                       desc_act=stored.get("desc_act", False), checkpoint_format=fmt)
        if method == "gguf":
            return cls("gguf")
        raise ValueError(f"quantization: the checkpoint's quant_method {method!r} is not supported "
                         f"(supported: {', '.join(CHECKPOINT_METHODS)})")


def detect(hf_config: dict[str, Any], option: str | None, world_size: int = 1) -> QuantConfig | None:
    """The quantization to run with: the checkpoint's, or the option's (fp8 and int8 quantize a
    float checkpoint at load). An option that contradicts the checkpoint is an error."""
    stored = hf_config.get("quantization_config")
    if stored:
        config = QuantConfig.from_checkpoint(stored)
        if option is not None and option != config.method:
            raise ValueError(f"quantization: {option!r} was asked for, but the checkpoint is quantized with "
                             f"{config.method!r} (quantization_config in config.json); leave the option out "
                             f"or pass {config.method!r}")
    elif option in CHECKPOINT_METHODS:
        raise ValueError(f"quantization: {option!r} needs a {option} checkpoint, and config.json has no "
                         f"quantization_config; make one with `tritonllm quantize`, or use "
                         f"{' or '.join(LOAD_TIME_METHODS)}, which quantize a float checkpoint at load")
    elif option is not None:
        config = QuantConfig(option)
    else:
        return None
    if world_size > 1:
        raise ValueError(f"quantization: {config.method} models run without tensor or pipeline parallelism "
                         f"for now (tensor_parallel_size x pipeline_parallel_size is {world_size})")
    return config
