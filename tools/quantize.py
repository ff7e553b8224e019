"""`tritonllm quantize`: a float Llama-family checkpoint -> an AWQ or GPTQ checkpoint in the layouts
the ecosystem writes (AutoAWQ's GEMM, GPTQ's v1 "gptq" format; see backend/quantization/awq.py and
gptq.py), with config.json's quantization_config, safetensors and the tokenizer files, so that
tritonllm, vLLM and transformers read it.

Both walk the decoder layer by layer on a built-in calibration text (tools/calibration_data.py):

- AWQ (activation-aware, after AutoAWQ, simplified): for each group of linears sharing an input
  (q/k/v after the input norm, gate/up after the post-attention norm, down after up; o after v when
  heads are not grouped), per-input-channel scales s = mean|x|^a / mean|w|^(1-a) are searched over a
  grid of a, each candidate judged by the error of the group's outputs once W * s is quantized; the
  best s is folded into the weights and divided out of the preceding norm or linear. Then each
  weight's clipping range is searched per group (not q/k), and the weights are rounded to nearest.
  The next layer's inputs come from the float layer, as in AutoAWQ. With `search=False` this is
  plain round-to-nearest in AWQ's layout (the baseline AWQ improves on).
- GPTQ: the GPTQ algorithm (Frantar et al.): the columns of each weight are quantized one at a time
  and each one's error is spread over the columns not yet quantized through the inverse Hessian of
  the layer's inputs (H = 2 X^T X / n, dampened by 1% of its mean diagonal), in blocks of 128 with
  lazy updates; q/k/v, then o, then gate/up, then down, each seeing the inputs the already-quantized
  ones produce. Act-order (`desc_act`, on by default: on SmolLM2 it is what makes GPTQ beat
  round-to-nearest, see docs/quantization.md) quantizes columns by decreasing Hessian diagonal and
  writes g_idx accordingly.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a command runs, not when `tritonllm` builds its parser
    import torch
    from torch import nn

    from tools.quantize_algorithms import Quantized

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


# -- the walk over the layers ------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def calibration_ids(tokenizer, num_samples: int, length: int, text: str) -> torch.Tensor:
    """num_samples windows of length tokens, spread evenly over the text (repeated if short)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < length + num_samples:
        ids = ids + ids
    stride = max(1, (len(ids) - length) // max(1, num_samples - 1))
    return torch.tensor([ids[i * stride:i * stride + length] for i in range(num_samples)])


def first_layer_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The hidden states entering layer 0, and the keyword arguments the model passes its layers."""
    captured = {}

    def grab(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = kwargs
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured["hidden"], captured["kwargs"]


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict,
              record: list[str] = ()) -> tuple[torch.Tensor, dict]:
    """The layer's output, and the input rows [n, in] of each linear named in record."""
    inputs: dict[str, torch.Tensor] = {}
    handles = [layer.get_submodule(name).register_forward_pre_hook(
        lambda module, args, name=name: inputs.__setitem__(name, args[0].reshape(-1, args[0].shape[-1])))
        for name in record]
    try:
        out = layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return (out[0] if isinstance(out, tuple) else out), inputs


def quantize_model(model_dir: str, method: str, output: str, bits: int = 4, group_size: int = 128,
                   sym: bool | None = None, desc_act: bool = True, search: bool = True,
                   num_samples: int = 16, length: int = 256, grid: int = 20, calibration_text: str | None = None,
                   dequantized_output: str | None = None) -> Path:
    """Quantize model_dir into output; returns output. calibration_text: default, the built-in one.
    dequantized_output: also write the float model the checkpoint decodes to (for measuring the
    quantization error)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.quantize_algorithms import LINEARS, SEQUENTIAL, awq_layer, hessian, quantize_gptq, quantize_rtn

    if method not in ("awq", "gptq"):
        raise ValueError(f"method: awq or gptq (got {method!r})")
    if bits not in ((4,) if method == "awq" else (4, 8)):
        raise ValueError(f"bits: {method} writes {'4' if method == 'awq' else '4 or 8'} bits (got {bits})")
    sym = (method == "gptq") if sym is None else sym
    if method == "awq" and (sym or group_size == -1):
        raise ValueError("awq: AutoAWQ's layout has zero points (asymmetric) and groups (group_size > 0)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    widths = {config.hidden_size, config.intermediate_size}
    if group_size != -1 and any(width % group_size for width in widths):
        raise ValueError(f"group_size: {group_size} does not divide the layers' input widths {sorted(widths)}; "
                         f"pick one that does (e.g. 64 or 32), or -1 for one group per row")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        if calibration_text is None:
            from tools.calibration_data import CALIBRATION_TEXT as calibration_text
        hidden, kwargs = first_layer_inputs(model, calibration_ids(tokenizer, num_samples, length, calibration_text))
        quantized: dict[str, Quantized] = {}
        for index, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{index}."
            if method == "awq":
                float_out, inputs = run_layer(layer, hidden, kwargs, LINEARS)
                if search:
                    awq_layer(layer, inputs, bits, group_size, grid)
                for name in LINEARS:
                    quantized[prefix + name] = quantize_rtn(layer.get_submodule(name).weight, bits, group_size)
                hidden = float_out
            else:
                for names in SEQUENTIAL:  # each group sees the inputs the quantized ones before it produce
                    _, inputs = run_layer(layer, hidden, kwargs, names)
                    for name in names:
                        linear = layer.get_submodule(name)
                        group = group_size if group_size != -1 else linear.in_features
                        result = quantize_gptq(linear.weight, hessian(inputs[name]), bits, group, sym, desc_act)
                        linear.weight.copy_(result.dequantized())
                        quantized[prefix + name] = result
                hidden, _ = run_layer(layer, hidden, kwargs)
    quant_config = ({"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                     "version": "gemm"} if method == "awq" else
                    {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                     "sym": sym, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
                     "checkpoint_format": "gptq"})
    write_checkpoint(model, quantized, method, bits, quant_config, model_dir, Path(output))
    if dequantized_output:
        write_checkpoint(model, quantized, None, bits, None, model_dir, Path(dequantized_output))
    return Path(output)


def write_checkpoint(model: nn.Module, quantized: dict[str, Quantized], method: str | None, bits: int,
                     quant_config: dict | None, model_dir: str, output: Path) -> None:
    """method None: the float checkpoint the quantized one decodes to (weights in float32)."""
    from safetensors.torch import save_file

    from backend.quantization import awq, gptq

    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module = name.rsplit(".", 1)[0]
        if module in quantized and name.endswith(".weight"):
            result = quantized[module]
            if method is None:
                tensors[name] = result.dequantized()
            elif method == "awq":
                tensors[module + ".qweight"] = awq.pack(result.q.t())
                tensors[module + ".qzeros"] = awq.pack(result.zeros)
                tensors[module + ".scales"] = result.scales.half()
            else:
                tensors[module + ".qweight"] = gptq.pack_weight(result.q.t(), bits)
                tensors[module + ".qzeros"] = gptq.pack_zeros(result.zeros, bits)
                tensors[module + ".scales"] = result.scales.half()
                tensors[module + ".g_idx"] = result.g_idx.int()
        else:
            tensors[name] = tensor.half()  # the ecosystem's float16 for what stays float
    output.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(output / "model.safetensors"),
              metadata={"format": "pt"})
    for file in Path(model_dir).iterdir():
        if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_FILES) \
                and not file.name.endswith(".index.json"):
            shutil.copy2(file, output / file.name)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float16" if method else "float32"
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="float HF model folder (default: the prepared SmolLM2)")
    parser.add_argument("--method", choices=("awq", "gptq"), required=True)
    parser.add_argument("--bits", type=int, default=4, help="4 (awq, gptq) or 8 (gptq)")
    parser.add_argument("--group-size", type=int, default=128, help="inputs per scale and zero; -1: per row")
    parser.add_argument("--output", required=True, help="folder to write the checkpoint to")
    parser.add_argument("--desc-act", action=argparse.BooleanOptionalAction, default=True,
                        help="gptq: act-order, columns by decreasing Hessian diagonal (default: on)")
    parser.add_argument("--asym", action="store_true", help="gptq: zero points per group (default: symmetric)")
    parser.add_argument("--no-search", action="store_true", help="awq: plain round-to-nearest, no scale/clip search")
    parser.add_argument("--calibration-samples", type=int, default=16, help="sequences of the built-in text")
    parser.add_argument("--calibration-length", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--calibration-file", default=None, help="a text file to calibrate on (default: built-in)")
    parser.add_argument("--dequantized-output", default=None,
                        help="also write the float model the checkpoint decodes to (for measuring its error)")


def run(args) -> int:
    model = args.model
    if model is None:
        from tools.prepare_model import prepare_model
        model = str(prepare_model())
    path = quantize_model(model, args.method, args.output, bits=args.bits, group_size=args.group_size,
                          sym=False if args.asym else None, desc_act=args.desc_act, search=not args.no_search,
                          num_samples=args.calibration_samples, length=args.calibration_length,
                          calibration_text=Path(args.calibration_file).read_text(encoding="utf-8") if args.calibration_file else None,
                          dequantized_output=args.dequantized_output)
    print(path)
    return 0
