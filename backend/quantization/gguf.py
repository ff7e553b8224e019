"""GGUF models (llama.cpp's format) run as they are stored: Q4_0, Q4_1 and Q8_0 weights stay in their
blocks in memory (the raw bytes, [N, K / 32 * block bytes] uint8) and are dequantized on each call.

    Q4_0  18 bytes per 32 weights: float16 d, 16 bytes of nibbles; w = d * (q - 8)
    Q4_1  20 bytes: float16 d, float16 m, 16 bytes of nibbles; w = d * q + m
    Q8_0  34 bytes: float16 d, 32 int8; w = d * q
(a block's byte j holds weight j in its low nibble and weight j + 16 in its high one)

Other tensor types (F32, F16, K-quants, ...) are dequantized once at load by the `gguf` package.
A fused layer (q/k/v, gate/up) keeps its blocks when all its parts share one block type.

`LLM(model="x.gguf")` (or a folder holding one .gguf) works through a side folder in the cache:
config.json, tokenizer and generation config read from the GGUF metadata by transformers, next to a
link to the file. llama.cpp stores Llama's q and k rows permuted for its RoPE; they are put back
in Hugging Face's order as they load (rows are independent in block formats, so blocks move whole).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGMLQuantizationType values
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # per 32 weights
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
# transformers' model_type for a GGUF -> the architecture we run
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Where a GGUF architecture (general.architecture) names a layer's tensors otherwise.
GEMMA_LAYER_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
ARCHITECTURE_LAYER_NAMES = {
    "gemma2": GEMMA_LAYER_NAMES, "gemma3": GEMMA_LAYER_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # stored fused, as Phi-3's checkpoints
}
NORMS_PLUS_ONE = ("gemma2", "gemma3")  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
FUSED_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


# -- the block formats --------------------------------------------------------------------------------
def dequantize(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [..., B * block bytes] -> float32 [..., B * 32] (the gguf package's arithmetic)."""
    b = blocks.view(*blocks.shape[:-1], -1, BLOCK_BYTES[qtype])
    d = b[..., :2].contiguous().view(torch.float16).float()
    if qtype == Q8_0:
        w = d * b[..., 2:].view(torch.int8).float()
    else:
        nibbles = b[..., 4:] if qtype == Q4_1 else b[..., 2:]
        q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1)
        if qtype == Q4_0:
            w = d * (q.to(torch.int8) - 8).float()
        else:
            w = d * q.float() + b[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(*blocks.shape[:-1], -1)


class GGUFLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, qtype: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        row_bytes = in_features // 32 * BLOCK_BYTES[qtype]
        self.weight = nn.Parameter(torch.empty(out_features, row_bytes, dtype=torch.uint8), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.qtype).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {TYPE_NAMES[self.qtype]}"


class GGUFEmbedding(nn.Module):
    """Token embeddings in blocks: only the looked-up rows are dequantized."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype, self.dtype = qtype, dtype
        row_bytes = embedding_dim // 32 * BLOCK_BYTES[qtype]
        self.weight = nn.Parameter(torch.empty(num_embeddings, row_bytes, dtype=torch.uint8), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight[input_ids], self.qtype).to(self.dtype)


# -- the file -----------------------------------------------------------------------------------------
def gguf_file(model_path: str) -> Path:
    files = sorted(Path(model_path).glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"model: {model_path!r} must hold exactly one .gguf file (found {len(files)})")
    return files[0]


def architecture(reader) -> str:
    """The file's general.architecture (llama.cpp's name: "llama", "qwen3", "gemma2", ...)."""
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def hf_name(name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> Hugging Face's (None: not a weight we load, e.g. rope_freqs)."""
    parts = name.split(".")
    layer_names = {**LAYER_NAMES, **ARCHITECTURE_LAYER_NAMES.get(arch, {})}
    if parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[-1]}"
    if parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[-1]}"
    return None


def module_name(hf: str) -> str:
    """Hugging Face weight name -> our module holding it (q/k/v, gate/up fused)."""
    parts = hf.removeprefix("model.").split(".")[:-1]
    parts[-1] = FUSED_MODULES.get(parts[-1], parts[-1])
    return ".".join(parts)


def block_types(path: Path, tie_word_embeddings: bool) -> dict[str, int]:
    """Our modules whose weights stay in blocks -> their block type: those whose parts all share one
    of Q4_0, Q4_1, Q8_0 (a tied lm_head follows the embeddings)."""
    from gguf import GGUFReader

    types: dict[str, set[int]] = {}
    reader = GGUFReader(path)
    arch = architecture(reader)
    for tensor in reader.tensors:
        hf = hf_name(tensor.name, arch)
        if hf is not None and hf.endswith(".weight"):
            types.setdefault(module_name(hf), set()).add(int(tensor.tensor_type))
    if tie_word_embeddings and "embed_tokens" in types:
        types["lm_head"] = types["embed_tokens"]
    return {name: next(iter(t)) for name, t in types.items() if len(t) == 1 and next(iter(t)) in BLOCK_BYTES}


def iterate_weights(model_path: str, num_heads: int, num_kv_heads: int, tie_word_embeddings: bool):
    """(Hugging Face name, tensor) for each weight: uint8 blocks for block-kept modules, float32
    for everything else, with llama.cpp's changes undone (Llama's q/k row order, Gemma's norms + 1)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    path = gguf_file(model_path)
    kept = block_types(path, tie_word_embeddings)
    reader = GGUFReader(path)
    arch = architecture(reader)
    for tensor in reader.tensors:
        hf = hf_name(tensor.name, arch)
        if hf is None:
            continue
        if module_name(hf) in kept and hf.endswith(".weight"):
            weight = torch.from_numpy(np.array(tensor.data))
        else:
            weight = torch.from_numpy(np.array(gguf_dequantize(tensor.data, tensor.tensor_type)))  # a copy: writable
        kind = tensor.name.split(".")[-2]
        if arch in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
            weight = unpermute_rows(weight, num_heads if kind == "attn_q" else num_kv_heads)
        if arch in NORMS_PLUS_ONE and tensor.name.endswith("norm.weight"):
            weight = weight - 1
        yield hf, weight


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (each head's two rotary halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# -- a model folder for a .gguf -----------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("TRITONLLM_CACHE", Path.home() / ".cache" / "tritonllm")) / "gguf"


def gguf_model_folder(model: str) -> Path | None:
    """For a .gguf file (or a folder with one and no config.json): a folder with its config,
    tokenizer and a link to it, made once and cached. None for any other model path."""
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf")):
        path = gguf_file(model)
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / key / path.stem
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        staging = Path(scratch) / path.stem
        write_model_folder(path, staging)
        try:
            staging.rename(folder)  # atomic: a half-written folder never looks ready
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's finished copy
                raise
    return folder


def metadata_config(path: Path) -> dict:
    """Config fields llama.cpp stores that transformers' GGUF reader leaves at their defaults: the
    head size (when it is not hidden / heads) and Gemma 2's soft caps."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = architecture(reader)
    found = {}
    for key, name in (("attention.key_length", "head_dim"), ("attn_logit_softcapping", "attn_logit_softcapping"),
                      ("final_logit_softcapping", "final_logit_softcapping")):
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            found[name] = field.parts[field.data[0]].tolist()[0]
    return found


def write_model_folder(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    if config.get("model_type") not in ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {config.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    config["architectures"] = [ARCHITECTURES[config["model_type"]]]
    config.update(metadata_config(path))
    config["quantization_config"] = {"quant_method": "gguf"}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    if tokenizer.chat_template:  # where older readers (and Triton's tooling) look for it
        tokenizer_config["chat_template"] = tokenizer.chat_template
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
                                                encoding="utf-8")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    (out / "model.gguf").symlink_to(path)
