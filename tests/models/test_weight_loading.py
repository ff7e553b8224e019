"""Checkpoint loading: a family's mapping routes Hugging Face names to the decoder's parameters, each
layer's loaders shard them per tensor rank and pipeline stage, and the shared decoder and loader
name no family's weights."""

from __future__ import annotations

import ast
import re

import pytest
import torch

from backend.layers.sharding import Part, output_rows, packed
from backend.models import build_model, model_args
from backend.models.loading import load_weights
from backend.worker.parallel_state import ParallelState
from tests.utils import ROOT
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 16, 4, 1, 4, 24, 37


def llama_config(**changes) -> dict:
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=HIDDEN,
                  intermediate_size=INTERMEDIATE, num_hidden_layers=3, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_bias=True)
    config.update(changes)
    return config


def llama_checkpoint(num_layers: int = 3, tied: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        for name, rows in (("q_proj", HEADS * HEAD_DIM), ("k_proj", KV_HEADS * HEAD_DIM), ("v_proj", KV_HEADS * HEAD_DIM)):
            shapes[f"{layer}.self_attn.{name}.weight"] = (rows, HIDDEN)
            shapes[f"{layer}.self_attn.{name}.bias"] = (rows,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN, HEADS * HEAD_DIM)
        shapes[f"{layer}.self_attn.o_proj.bias"] = (HIDDEN,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{layer}.mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{layer}.mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{layer}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.self_attn.rotary_emb.inv_freq"] = (HEAD_DIM // 2,)  # older checkpoints: skipped
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def loaded(config: dict, weights: dict[str, torch.Tensor], parallel: ParallelState):
    model = build_model(model_args(config), parallel)
    load_weights(model, weights.items())
    return model


def test_tensor_rank_takes_its_heads_columns_and_vocabulary_slice():
    """tp=2, rank 1: its q heads, the one KV head replicated, o_proj's input columns (the bias on rank
    0 only), its half of gate/up and of down's columns, its slice of the padded vocabulary."""
    weights = llama_checkpoint()
    model = loaded(llama_config(), weights, ParallelState(rank=1, tp_size=2))
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    w = {name.removeprefix("model.layers.1."): tensor for name, tensor in weights.items()}
    for suffix in ("weight", "bias"):
        expected = torch.cat([w[f"self_attn.q_proj.{suffix}"].chunk(2)[1], w[f"self_attn.k_proj.{suffix}"],
                              w[f"self_attn.v_proj.{suffix}"]])
        assert torch.equal(getattr(attn.qkv_proj, suffix), expected)
    assert torch.equal(attn.o_proj.weight, w["self_attn.o_proj.weight"].chunk(2, dim=1)[1])
    assert torch.equal(attn.o_proj.bias, torch.zeros(HIDDEN))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([w["mlp.gate_proj.weight"].chunk(2)[1],
                                                           w["mlp.up_proj.weight"].chunk(2)[1]]))
    assert torch.equal(mlp.down_proj.weight, w["mlp.down_proj.weight"].chunk(2, dim=1)[1])
    per_rank = -(-VOCAB // 2)
    assert torch.equal(model.embed_tokens.weight[:VOCAB - per_rank], weights["model.embed_tokens.weight"][per_rank:])
    assert torch.equal(model.embed_tokens.weight[VOCAB - per_rank:], torch.zeros(2 * per_rank - VOCAB, HIDDEN))
    rank0 = loaded(llama_config(), weights, ParallelState(rank=0, tp_size=2))
    assert torch.equal(rank0.layers[1].self_attn.o_proj.bias, w["self_attn.o_proj.bias"])


def test_checkpoint_storing_fused_layers_loads_the_same():
    """Phi-3 stores qkv_proj and gate_up_proj fused: split into parts, each rank gets the same shard."""
    weights = llama_checkpoint()
    fused = dict(weights)
    for i in range(3):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for suffix in ("weight", "bias"):
            fused[f"{attn}.qkv_proj.{suffix}"] = torch.cat([fused.pop(f"{attn}.{p}.{suffix}")
                                                            for p in ("q_proj", "k_proj", "v_proj")])
        fused[f"{mlp}.gate_up_proj.weight"] = torch.cat([fused.pop(f"{mlp}.gate_proj.weight"),
                                                          fused.pop(f"{mlp}.up_proj.weight")])
    parallel = ParallelState(rank=1, tp_size=2)
    separate, joined = loaded(llama_config(), weights, parallel), loaded(llama_config(), fused, parallel)
    for (name, a), (_, b) in zip(separate.named_parameters(), joined.named_parameters()):
        assert torch.equal(a, b), name


def test_pipeline_stage_loads_only_its_layers_and_a_tied_head():
    """pp=2, the last stage (layer 2 of 3) without the embedding: its tied head loads the embedding."""
    weights = llama_checkpoint(tied=True)
    model = loaded(llama_config(tie_word_embeddings=True), weights, ParallelState(rank=1, pp_size=2))
    assert len(model.layers) == 1 and model.embed_tokens is None
    assert torch.equal(model.layers[0].input_layernorm.weight, weights["model.layers.2.input_layernorm.weight"])
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_missing_and_unexpected_weights_are_refused():
    weights = llama_checkpoint()
    del weights["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks weights: \['layers.0.self_attn.qkv_proj.weight'\]"):
        loaded(llama_config(), weights, ParallelState())
    weights = llama_checkpoint()
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="unexpected weight 'layers.0.mlp.extra.weight'"):
        loaded(llama_config(), weights, ParallelState())


def test_mixtral_experts_route_to_each_experts_packed_layer():
    config = llama_config(architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=1,
                          num_hidden_layers=1, attention_bias=False)
    weights = {name: t for name, t in llama_checkpoint(num_layers=1).items()
               if ".mlp." not in name and not name.endswith("_proj.bias")}
    for expert in range(2):
        for name, shape in (("w1", (INTERMEDIATE, HIDDEN)), ("w3", (INTERMEDIATE, HIDDEN)), ("w2", (HIDDEN, INTERMEDIATE))):
            weights[f"model.layers.0.block_sparse_moe.experts.{expert}.{name}.weight"] = torch.randn(shape)
    weights["model.layers.0.block_sparse_moe.gate.weight"] = torch.randn(2, HIDDEN)
    model = loaded(config, weights, ParallelState())
    expert = model.layers[0].mlp.experts[1]
    prefix = "model.layers.0.block_sparse_moe.experts.1"
    assert torch.equal(expert.gate_up_proj.weight, torch.cat([weights[f"{prefix}.w1.weight"],
                                                              weights[f"{prefix}.w3.weight"]]))
    assert torch.equal(expert.down_proj.weight, weights[f"{prefix}.w2.weight"])


def test_packed_parts_share_one_copy_only_when_equal():
    """A tensor every part carries whole (GPTQ's g_idx) is written once; a differing copy is refused."""
    load = packed([Part(4, 4, output_rows(ParallelState())), Part(2, 2, output_rows(ParallelState()))], 1)
    param = torch.empty(8)
    load(param, torch.arange(8.0), 1)
    load(param, torch.arange(8.0), 0)
    assert torch.equal(param, torch.arange(8.0))
    with pytest.raises(ValueError, match="copies of a shared tensor differ"):
        load(param, torch.zeros(8), 0)


FAMILY_NAMES = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "sinks", "experts",
                "block_sparse_moe", "shared_experts", "router", "w1", "w2", "w3", "rotary_emb"}


@pytest.mark.parametrize("path", ["backend/models/decoder.py", "backend/models/loading.py"])
def test_shared_decoder_and_loader_name_no_family_weights(path):
    """Family checkpoint names live in the family files and the layers that own the parameters."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node)}
    strings = [node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    found = {name for text in strings for name in FAMILY_NAMES if re.search(rf"\b{name}\b", text)}
    assert not found, f"{path} names family weights: {sorted(found)}"


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_packed_dim_of_quantized_tensors_is_their_formats_output_dim(method):
    """The packed loader finds where a part goes from the shapes: the dim each format declares."""
    from backend.quantization import awq, gptq
    from backend.quantization.config import QuantConfig
    from backend.layers.sharding import packed_dim

    layout, config = (awq, QuantConfig("awq", 4, 32, sym=False)) if method == "awq" else (gptq, QuantConfig("gptq", 4, 32))
    whole = layout.tensor_shapes(64, 96, config)  # q/k/v of 64 + 16 + 16 outputs
    part = layout.tensor_shapes(64, 16, config)
    for name, dim in layout.FUSED_DIMS.items():
        assert packed_dim(torch.empty(whole[name][0]), torch.empty(part[name][0])) == dim, name
