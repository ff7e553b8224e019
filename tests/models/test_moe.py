"""Mixture-of-experts families against Hugging Face transformers (tiny random Mixtral, Qwen2-MoE,
Qwen3-MoE built from transformers' config classes, every parameter perturbed, routers included;
greedy float32 tokens through the offline `LLM` identical to `generate`; prompts longer than the
sliding windows), the checkpoint layouts experts load from, the router's scorings against
Hugging Face's DeepSeek-V3 router, tensor parallelism and int8 on expert weights."""

from __future__ import annotations

import pytest
import torch

# Imported at collection, before anything else can import Triton without the interpreter.
from backend.kernels import reference
from backend.kernels.fused_moe import align_by_expert, fused_moe

from backend import LLM, SamplingParams
from backend.layers.moe import (MoEArgs, Router, SparseMoE, grouped_experts, per_token_experts,
                                       sparse_layers)
from backend.worker.parallel_state import ParallelState
from tests.utils.kernels import on_torch_and_triton
from tests.utils.models import (PROMPTS, SHAPE, WINDOW, assert_tensor_parallel_matches_hf, copy_tokenizer,
                                hf_greedy_logprobs, tiny_model)
from tests.utils.triton import generate, llm_server, texts

MOE_SHAPE = dict(num_experts_per_tok=2, initializer_range=0.3)


def moe_family(name: str, **overrides):
    import transformers as t

    cases = {
        # 8 experts of 64, a window on every layer
        "mixtral": (t.MixtralConfig, dict(num_local_experts=8, sliding_window=WINDOW)),
        # a shared expert and its gate, top-k weights not renormalised, layer 1 dense, windows per layer_types
        "qwen2-moe": (t.Qwen2MoeConfig, dict(num_hidden_layers=3, num_experts=8, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                             use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
        # renormalised top-k, every other layer sparse (layer 1 of 0..2), q/k norms, biases
        "qwen3-moe": (t.Qwen3MoeConfig, dict(num_hidden_layers=3, num_experts=6, moe_intermediate_size=32,
                                             norm_topk_prob=True, decoder_sparse_step=2, head_dim=32,
                                             attention_bias=True, use_sliding_window=True, sliding_window=WINDOW)),
    }
    config_class, options = cases[name]
    return config_class(**{**SHAPE, **MOE_SHAPE, **options, **overrides})


MOE_FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe"]


def tiny_moe(name: str, path, **overrides) -> torch.nn.Module:
    """Every parameter perturbed, routers included; the reference in float32, eager attention."""
    return tiny_model(path, moe_family(name, **overrides), perturb="all", attn_implementation="eager")


def greedy_tokens(path, max_tokens=12, **options) -> list:
    """Our greedy completions (CompletionOutput: token ids and logprobs) of PROMPTS, float32."""
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=16, max_num_seqs=4, **options)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                       logprobs=1))
        return [output.outputs[0] for output in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_family_matches_hf(tmp_path, name):
    model = tiny_moe(name, tmp_path)
    max_tokens = 12
    for completion, prompt in zip(greedy_tokens(tmp_path, max_tokens), PROMPTS):
        tokens, logprobs = hf_greedy_logprobs(model, prompt, max_tokens)
        assert completion.token_ids == tokens, name
        ours = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        assert ours == pytest.approx(logprobs, abs=1e-4), name


def test_fused_expert_checkpoint_layout_loads_the_same(tmp_path):
    """transformers writes per-expert tensors; a checkpoint holding the fused 3D layout
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) gives the same model."""
    from safetensors.torch import load_file, save_file

    model = tiny_moe("qwen3-moe", tmp_path)
    expected = [c.token_ids for c in greedy_tokens(tmp_path, 6)]
    weights = load_file(str(tmp_path / "model.safetensors"))
    num_experts = model.config.num_experts
    fused = {}
    for name in list(weights):
        if ".experts.0.gate_proj." in name:
            prefix = name.split(".experts.")[0] + ".experts"
            pop = [weights.pop(f"{prefix}.{e}.{part}.weight") for e in range(num_experts)
                   for part in ("gate_proj", "up_proj", "down_proj")]
            fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(pop[3 * e:3 * e + 2]) for e in range(num_experts)])
            fused[f"{prefix}.down_proj"] = torch.stack([pop[3 * e + 2] for e in range(num_experts)])
    assert fused
    save_file({**weights, **fused}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert [c.token_ids for c in greedy_tokens(tmp_path, 6)] == expected


def test_moe_tensor_parallel_matches_hf(tmp_path):
    """tp=2 over gloo: every expert and the shared expert split along their intermediate dim, the
    router replicated, one all-reduce after the layer."""
    assert_tensor_parallel_matches_hf(tiny_moe("qwen2-moe", tmp_path), tmp_path, "qwen2-moe")


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_load_time_quantization_reaches_the_experts(tmp_path, method):
    """int8 / fp8 at load quantize every routed and shared expert's linears (the router and the
    shared expert's gate stay float): the model runs as its dequantized float checkpoint."""
    from safetensors.torch import load_file, save_file

    from backend.quantization import fp8, int8

    module = int8 if method == "int8" else fp8
    tiny_moe("qwen2-moe", tmp_path / "float")
    tensors = load_file(str(tmp_path / "float" / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = module.dequantize(*module.quantize(tensor), torch.float32)
    (tmp_path / "dequantized").mkdir()
    (tmp_path / "dequantized" / "config.json").write_text((tmp_path / "float" / "config.json").read_text())
    save_file(tensors, str(tmp_path / "dequantized" / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(tmp_path / "float"), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
              quantization=method)
    quantized_class = fp8.Fp8Linear if method == "fp8" else int8.Int8Linear
    modules = dict(llm.llm_engine.runner.model.named_modules())
    experts = [name for name in modules if name.endswith("_proj") and "mlp" in name]
    assert len(experts) == 2 * (8 + 1) * 2 + 2  # 2 sparse layers x (8 experts + shared) x 2 linears; 1 dense MLP
    assert all(isinstance(modules[name], quantized_class) for name in experts)
    assert not isinstance(modules["layers.0.mlp.shared_expert_gate"], quantized_class)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    quantized = llm.generate(PROMPTS, params)
    llm.shutdown()
    dequantized = LLM(str(tmp_path / "dequantized"), dtype="float32", skip_tokenizer_init=True,
                      kv_cache_memory_bytes=4 << 20).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in quantized] == [o.outputs[0].token_ids for o in dequantized]


def test_moe_family_served_through_the_triton_model(tmp_path, model_path):
    """A tiny Mixtral (SmolLM2's tokenizer) in a real tritonserver: the `llm` model's greedy text is
    the offline engine's, whose tokens are Hugging Face's."""
    folder = tmp_path / "tiny-mixtral"
    model = tiny_moe("mixtral", folder, vocab_size=49152)
    copy_tokenizer(model_path, folder)
    prompt, max_tokens = PROMPTS[1], 8
    offline = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    offline.shutdown()
    assert expected.outputs[0].token_ids == hf_greedy_logprobs(model, prompt, max_tokens)[0]
    engine_args = {"model": str(folder), "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_model_len": 256}
    # clean_exit=False: a clean exit is test_triton_model's to check; on a loaded machine this
    # stub's unload can outlast the fixture's --exit-timeout-secs=5.
    with llm_server(tmp_path / "work", engine_args, clean_exit=False) as server:
        [result] = generate(server, prompt, {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
                            exclude_input_in_output=True)
    assert texts(result) == [expected.outputs[0].text]


# -- the layer on its own -------------------------------------------------------------------------------------
def random_moe(moe: MoEArgs, hidden: int = 32) -> SparseMoE:
    torch.manual_seed(0)
    layer = SparseMoE(hidden, moe, ParallelState())
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    return layer


def test_grouped_experts_match_the_per_token_loop():
    moe = MoEArgs(num_experts=6, top_k=3, intermediate_size=16, sparse_layers=(True,), norm_topk_prob=True)
    layer = random_moe(moe)
    x = torch.randn(40, 32)
    weights, ids = layer.gate(x)
    ids[:30] = torch.tensor([0, 2, 5])  # uneven: expert 0, 2, 5 take most tokens, some none
    expected = per_token_experts(x, weights, ids, layer.experts)
    torch.testing.assert_close(grouped_experts(x, weights, ids, layer.experts), expected, atol=1e-5, rtol=1e-5)


def test_sigmoid_grouped_router_matches_deepseek_v3():
    """The "sigmoid" scoring with groups, correction bias, norm_topk_prob and routed scaling picks
    the experts and weights of Hugging Face's DeepSeek-V3 router."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    hf = DeepseekV3TopkRouter(config)
    moe = MoEArgs(num_experts=16, top_k=4, intermediate_size=8, sparse_layers=(True,), scoring="sigmoid",
                  norm_topk_prob=True, num_groups=4, topk_groups=2, correction_bias=True, routed_scaling_factor=2.5,
                  router_float32=True)
    ours = Router(32, moe)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32))
        hf.e_score_correction_bias.copy_(torch.randn(16) * 0.5)
        ours.weight.copy_(hf.weight)
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(20, 32)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    hf_order, order = hf_ids.sort(-1).indices, ids.sort(-1).indices
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_sparse_layer_selection():
    assert sparse_layers(4) == (True,) * 4
    assert sparse_layers(4, decoder_sparse_step=2) == (False, True, False, True)
    assert sparse_layers(4, mlp_only_layers=[0, 2]) == (False, True, False, True)
    assert sparse_layers(4, first_k_dense_replace=3) == (False, False, False, True)


# -- the fused Triton kernel (through the interpreter without a GPU) ---------------------------------------
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def uneven_routing(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Expert 1 in nearly every token's top-k, experts 0 and the last never, the rest scattered."""
    ids = torch.stack([torch.randperm(num_experts - 2)[:top_k] + 1 for _ in range(num_tokens)])
    ids[: num_tokens - 2, 0] = 1
    ids[: num_tokens - 2, 1:] = torch.where(ids[: num_tokens - 2, 1:] == 1, 2, ids[: num_tokens - 2, 1:])
    return ids


def test_fused_moe_kernel_aligns_each_expert_to_whole_tiles():
    ids = torch.tensor([[3, 1], [1, 0], [3, 1]])
    pairs, tiles, num_padded = align_by_expert(ids, num_experts=5, block_m=4)
    assert int(num_padded) == 12  # experts 0, 1, 3 one tile each; 2 and 4 none
    assert pairs[:12].tolist() == [3, 6, 6, 6, 1, 2, 5, 6, 0, 4, 6, 6]
    assert tiles[:3].tolist() == [0, 1, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (37, 2), (20, 3)])
def test_fused_moe_kernel_matches_reference_on_uneven_loads(dtype, num_tokens, top_k):
    torch.manual_seed(0)
    num_experts, hidden, intermediate = 8, 48, 40  # not powers of two: masked columns and K slices
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device=DEVICE) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, device=DEVICE) * 0.2).to(dtype)
    ids = uneven_routing(num_tokens, num_experts, top_k).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    expected = reference.fused_moe_reference(x, w13, w2, weights, ids)
    tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)  # a bfloat16 unit at |y| ~ 4-8
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), expected, **tolerance)


def test_moe_layer_on_the_kernel_matches_the_grouped_cpu_path():
    """SparseMoE through ops.fused_moe (experts stacked, their nn.Linear weights now views) gives
    the grouped path's output, shared expert included."""
    from backend import ops

    moe = MoEArgs(num_experts=8, top_k=2, intermediate_size=24, sparse_layers=(True,), norm_topk_prob=True,
                  shared_intermediate_size=16, shared_expert_gate=True)
    layer = random_moe(moe)
    x = torch.randn(21, 32)
    expected = layer(x)
    with ops.triton_kernels():
        out = layer(x)
    assert layer.stacked is not None
    assert layer.experts[3].gate_up_proj.weight.data_ptr() == layer.stacked[0][3].data_ptr()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_topk_softmax_router_matches_gpt_oss():
    """The "topk_softmax" scoring with a router bias (gpt-oss): top-k of the logits, softmax over them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3)
    torch.manual_seed(0)
    hf = GptOssTopKRouter(config)
    ours = Router(32, MoEArgs(num_experts=8, top_k=3, intermediate_size=8, sparse_layers=(True,),
                              scoring="topk_softmax", router_bias=True))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 32))
        hf.bias.copy_(torch.randn(8))
        ours.weight.copy_(hf.weight)
        ours.bias.copy_(hf.bias)
    x = torch.randn(20, 32)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


def test_transposed_interleaved_fused_layout_splits_per_expert():
    """gpt-oss's layout: gate_up_proj [E, H, 2I] with gate and up interleaved along 2I, down_proj
    [E, I, H], biases [E, 2I] / [E, H]: each expert's nn.Linear-shaped gate, up and down."""
    from backend.layers.moe import checkpoint_tensors

    moe = MoEArgs(num_experts=2, top_k=1, intermediate_size=3, sparse_layers=(True,), fused_transposed=True,
                  gate_up_interleaved=True, expert_bias=True)
    gate_up = torch.randn(2, 4, 6)
    pieces = dict(checkpoint_tensors("model.layers.0.mlp.experts.gate_up_proj", gate_up, moe))
    assert torch.equal(pieces["model.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :, 0::2].t())
    assert torch.equal(pieces["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, :, 1::2].t())
    bias = torch.randn(2, 6)
    pieces = dict(checkpoint_tensors("model.layers.0.mlp.experts.gate_up_proj_bias", bias, moe))
    assert torch.equal(pieces["model.layers.0.mlp.experts.0.up_proj.bias"], bias[0, 1::2])
    down = torch.randn(2, 3, 4)
    pieces = dict(checkpoint_tensors("model.layers.0.mlp.experts.down_proj", down, moe))
    assert torch.equal(pieces["model.layers.0.mlp.experts.1.down_proj.weight"], down[1].t())
    renamed = checkpoint_tensors("model.layers.2.block_sparse_moe.experts.5.w3.weight", down[0], moe)
    assert renamed[0][0] == "model.layers.2.mlp.experts.5.up_proj.weight"
    assert checkpoint_tensors("model.layers.0.mlp.router.bias", bias[0], moe)[0][0] == "model.layers.0.mlp.gate.bias"


def test_unsupported_moe_setups_are_refused_clearly(tmp_path):
    import json

    from backend.errors import EngineError
    from backend.models import check_parallel, model_args

    tiny_moe("qwen3-moe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide.*moe_intermediate_size \(32\)"):
        check_parallel(model_args(config), 3, 1)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="gptq checkpoints of mixture-of-experts models are not supported"):
        LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)


def test_moe_model_greedy_tokens_unchanged_on_triton_kernels(tmp_path):
    """A tiny Qwen2-MoE, float32: the same greedy tokens from the CPU's grouped path and from the
    Triton kernels, fused MoE included (through the interpreter, or on CUDA with its graphs), and
    both Hugging Face's."""

    model = tiny_moe("qwen2-moe", tmp_path, use_sliding_window=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def generate(device: str) -> list[list[int]]:
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
                  max_num_batched_tokens=32, max_num_seqs=4, device=device)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        finally:
            llm.shutdown()

    on_torch, on_triton = on_torch_and_triton(generate)
    assert on_triton == on_torch
    assert on_torch == [hf_greedy_logprobs(model, prompt, 6)[0] for prompt in PROMPTS]


# -- the CPU MoE kernel (backend/csrc/cpu_moe.cpp), bfloat16 at a few tokens -------------------------------------
def needs_cpu_moe_kernel():
    from backend.ops.cpu_ops import moe_kernel_available

    if not moe_kernel_available():
        pytest.skip("the CPU MoE kernel is not built here (no compiler, no AVX512-BF16, or TRITONLLM_CPU_KERNELS=0)")


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (4, 2), (13, 3), (37, 2)])
# 48, 40: partial vectors and blocks; 256, 200: enough work for the kernel to share it among torch's threads
@pytest.mark.parametrize("hidden,intermediate", [(64, 32), (48, 40), (256, 200)])
def test_cpu_moe_kernel_matches_reference_on_uneven_loads(num_tokens, top_k, hidden, intermediate):
    from backend.ops.cpu_ops import moe_experts

    needs_cpu_moe_kernel()
    torch.manual_seed(0)
    num_experts = 8
    x = torch.randn(num_tokens, hidden).bfloat16()
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden) * 1.6 / hidden ** 0.5).bfloat16()  # |y| ~ 4-8 whatever the shape
    w2 = (torch.randn(num_experts, hidden, intermediate) * 1.6 / intermediate ** 0.5).bfloat16()
    ids = uneven_routing(num_tokens, num_experts, top_k)
    weights = torch.rand(num_tokens, top_k)
    expected = reference.fused_moe_reference(x, w13, w2, weights, ids)
    out = moe_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, atol=6e-2, rtol=2e-2)  # a bfloat16 unit at |y| ~ 4-8
    # Mostly bit for bit: only the float32 sums' order differs from torch's GEMMs.
    assert (out == expected).float().mean() > 0.5


def test_moe_layer_runs_the_cpu_kernel_at_small_bfloat16_batches():
    """In bfloat16 the routed experts' linears stay unpacked (the kernel reads them), the kernel runs
    up to its crossover and the grouped path above it, on the same stacked weights, both matching
    the per-token loop; a layer whose experts carry biases keeps packed linears and the grouped path."""
    from backend.ops import cpu_ops
    from backend.layers import moe as moe_module

    needs_cpu_moe_kernel()
    moe = MoEArgs(num_experts=8, top_k=2, intermediate_size=64, sparse_layers=(True,), norm_topk_prob=True,
                  shared_intermediate_size=32)
    layer = random_moe(moe, hidden=64).to(torch.bfloat16)
    cpu_ops.pack_linears(layer, 4)
    assert type(layer.experts[0].gate_up_proj) is torch.nn.Linear
    assert type(layer.shared_expert.gate_up_proj) is not torch.nn.Linear or not cpu_ops.onednn_packing()
    largest = moe_module.CPU_KERNEL_MAX_PAIRS_PER_EXPERT * moe.num_experts // moe.top_k
    for num_tokens in (1, 5, largest, largest + 1, 3 * largest):
        x = torch.randn(num_tokens, 64).bfloat16()
        weights, ids = layer.gate(x)
        assert layer.cpu_kernel_takes(x, ids) == (num_tokens <= largest)
        expected = per_token_experts(x, weights, ids, layer.experts)
        # Outputs reach ~40 here, where a bfloat16 ulp is 0.25: two summation orders (which differ by
        # CPU: AMX, AVX512-BF16, AVX2) may round an output that cancels to near zero a few ulps of the
        # terms apart, so the absolute bound follows the output's scale. A dropped expert is off by ~10.
        atol = 4e-3 * expected.abs().max().item()
        torch.testing.assert_close(layer.routed_experts(x, weights, ids), expected, atol=atol, rtol=2e-2)
    assert layer.experts[3].gate_up_proj.weight.data_ptr() == layer.stacked[0][3].data_ptr()

    biased = random_moe(MoEArgs(num_experts=4, top_k=2, intermediate_size=32, sparse_layers=(True,),
                                expert_bias=True), hidden=64).to(torch.bfloat16)
    cpu_ops.pack_linears(biased, 4)
    x = torch.randn(3, 64).bfloat16()
    weights, ids = biased.gate(x)
    assert not biased.cpu_kernel_takes(x, ids)
    torch.testing.assert_close(biased.routed_experts(x, weights, ids), per_token_experts(x, weights, ids, biased.experts))
