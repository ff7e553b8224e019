"""Every supported architecture against Hugging Face transformers: tiny random models built from
transformers' own config classes, every parameter perturbed after init (norm weights and biases
included, so a dropped term shows), greedy float32 tokens through the offline `LLM` identical to
`generate`. Prompts run longer than the sliding windows, in chunks smaller than the prompts."""

from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from tests.utils.models import (PROMPTS, SHAPE, VOCAB, WINDOW, assert_greedy_matches_hf, assert_tensor_parallel_matches_hf,
                                causal_lm_class, copy_tokenizer, hf_greedy_logprobs, tiny_model)
from tests.utils.serve import Serve

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


def phi4_mini_rope(head_dim: int, partial: float) -> dict:
    half = int(head_dim * partial) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.3 * i for i in range(half)],
            "original_max_position_embeddings": 64}


def family(name: str, **overrides):
    """The transformers config of one test case."""
    import transformers as t

    cases = {
        "llama-untied": (t.LlamaConfig, dict(head_dim=64, tie_word_embeddings=False)),
        "llama-tied-bias": (t.LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
        "llama3-rope": (t.LlamaConfig, dict(head_dim=64, rope_parameters=LLAMA3_ROPE)),
        "mistral-window": (t.MistralConfig, dict(head_dim=64, sliding_window=WINDOW)),
        "qwen2-yarn": (t.Qwen2Config, dict(rope_parameters=YARN_ROPE)),
        "qwen3": (t.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
        "qwen3-bias": (t.Qwen3Config, dict(head_dim=32, attention_bias=True)),
        "gemma": (t.GemmaConfig, dict(head_dim=32)),
        "gemma2": (t.Gemma2Config, dict(head_dim=32, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=8, initializer_range=0.05,
                                         attn_logit_softcapping=0.5, final_logit_softcapping=1.0)),
        "gemma3": (t.Gemma3TextConfig, dict(head_dim=32, num_hidden_layers=3, sliding_window=WINDOW, initializer_range=0.05,
                                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                "rope_theta": 10000.0}})),
        "phi3": (t.Phi3Config, dict(tie_word_embeddings=False, pad_token_id=0)),
        "phi4-mini": (t.Phi3Config, dict(tie_word_embeddings=True, pad_token_id=0, original_max_position_embeddings=64,
                                         rope_parameters=phi4_mini_rope(16, 0.75))),
        "olmo2": (t.Olmo2Config, dict(attention_bias=True, pad_token_id=0)),
        "granite": (t.GraniteConfig, dict(attention_bias=True, embedding_multiplier=3.0, attention_multiplier=0.2,
                                          residual_multiplier=0.7, logits_scaling=2.5)),
    }
    config_class, options = cases[name]
    return config_class(**{**SHAPE, **options, **overrides})


FAMILIES = ["llama-untied", "llama-tied-bias", "llama3-rope", "mistral-window", "qwen2-yarn", "qwen3", "gemma",
            "gemma2", "gemma3", "phi3", "phi4-mini", "olmo2", "granite"]


def tiny_family(name: str, path, **overrides) -> torch.nn.Module:
    """A random model of the family saved to path, every parameter perturbed; the reference in
    float32, eager attention (tests/utils/models.py)."""
    return tiny_model(path, family(name, **overrides), perturb="all", attn_implementation="eager")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_hf(tmp_path, name):
    assert_greedy_matches_hf(tiny_family(name, tmp_path), tmp_path, name)


@pytest.mark.parametrize("name", ["qwen3-bias", "phi3"])
def test_tensor_parallel_family_matches_hf(tmp_path, name):
    """tp=2 over gloo: per-head q/k norms replicated, q/k/v biases split with their heads, o_proj's
    bias added once (rank 0's); Phi-3's fused qkv_proj / gate_up_proj split before sharding."""
    assert_tensor_parallel_matches_hf(tiny_family(name, tmp_path), tmp_path, name)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    tiny_family("llama-untied", tmp_path)
    config = (tmp_path / "config.json").read_text().replace("LlamaForCausalLM", "MambaForCausalLM")
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"MambaForCausalLM.*not supported.*Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)


def test_longrope_past_the_original_context(tmp_path):
    """Phi-4-mini's longrope switches to its long factors past original_max_position_embeddings
    (64 here): positions from there on rotate with them, as Hugging Face's forward does with a KV
    cache. (Hugging Face's `generate` instead recomputes the whole sequence with the long factors
    once it crosses, which a paged cache does not; the tokens after the crossing differ from it.)"""
    from transformers import DynamicCache

    model = tiny_family("phi4-mini", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    prompt, max_tokens = PROMPTS[1] + PROMPTS[0] * 3, 30  # 55 + 30 positions: crosses 64
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    cache, expected = DynamicCache(config=model.config), []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
        for position in range(len(prompt), len(prompt) + max_tokens):
            expected.append(int(logits.argmax()))
            logits = model(torch.tensor([[expected[-1]]]), past_key_values=cache,
                           position_ids=torch.tensor([[position]])).logits[0, -1]
    assert ours[0].outputs[0].token_ids == expected


# -- served: tritonllm serve (Triton's llm model and the OpenAI frontend) ------------------------------------
@pytest.fixture
def serve(request, tmp_path, model_path):
    """`tritonllm serve --model DIR` on a tiny random model of the family `request.param`, with
    SmolLM2's tokenizer and chat template: yields (frontend URL, model folder, reference model)."""
    folder = tmp_path / f"tiny-{request.param}"
    model = tiny_family(request.param, folder, vocab_size=49152)
    copy_tokenizer(model_path, folder)
    with Serve(str(folder), tmp_path / "work", kv_cache_bytes=8 << 20, max_model_len=256, api_key=None,
               start_timeout=300, stop_timeout=60) as served:
        yield served.url, folder, model


@pytest.mark.parametrize("serve", ["gemma2", "qwen3"], indirect=True)
def test_served_family_answers_through_the_openai_sdk(serve):
    """A sliding-window family (Gemma 2, a prompt longer than its window) and a full-attention one
    (Qwen3) served: the OpenAI SDK gets the offline engine's greedy text, whose tokens are Hugging
    Face's; chat (the tokenizer's template) answers."""
    from openai import OpenAI

    url, folder, model = serve
    prompt, max_tokens = PROMPTS[1], 8
    offline = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    offline.shutdown()
    assert expected.outputs[0].token_ids == hf_greedy_logprobs(model, prompt, max_tokens)[0]
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    completion = client.completions.create(model=folder.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected.outputs[0].text
    assert completion.usage.prompt_tokens == len(prompt) and completion.usage.completion_tokens == max_tokens
    chat = client.chat.completions.create(model=folder.name, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi!"}])
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.prompt_tokens > 3


# -- GGUF ------------------------------------------------------------------------------------------------------
GGUF_CASES = {  # family -> (llama.cpp architecture, our tiny shape's changes for what transformers' reader keeps)
    "qwen3": ("qwen3", dict(head_dim=128, tie_word_embeddings=False)),  # its reader keeps Qwen3Config's head_dim
    "gemma2": ("gemma2", dict(head_dim=32, sliding_window=WINDOW)),  # the default soft caps, query_pre_attn_scalar
    "phi3": ("phi3", dict(tie_word_embeddings=False, pad_token_id=0)),
}


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A GPT-2 style byte-level BPE vocabulary of VOCAB tokens: two specials, the 256 byte symbols,
    then merges of letter pairs."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # GPT-2 shows them as chr(256 + n)
    symbols = [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [f"{a} {b}" for a in letters for b in letters][:VOCAB - 2 - len(symbols)]
    return ["<|bos|>", "<|eos|>", *symbols, *(m.replace(" ", "") for m in merges)], merges


def write_gguf(model, arch: str, path) -> None:
    """The model as llama.cpp's converter writes it: gguf-py's own Hugging Face -> GGUF tensor
    names, Gemma's norms + 1, 2-D weights in Q8_0 blocks, a small byte-level BPE tokenizer."""
    import gguf
    from gguf.quants import quantize

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    tokens, merges = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "gemma2" and name.endswith("norm.weight"):
            data = data + 1
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            writer.add_tensor(target, quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_family_matches_transformers(tmp_path, monkeypatch, name):
    """A GGUF written with the gguf package from a tiny random model: the engine's tokens are those
    of transformers' own GGUF loader (which dequantizes the Q8_0 blocks the engine runs as they are)."""
    from transformers import AutoModelForCausalLM

    from backend.quantization import gguf as engine_gguf

    monkeypatch.setattr(engine_gguf, "cache_dir", lambda: tmp_path / "cache")
    arch, options = GGUF_CASES[name]
    model = tiny_model(tmp_path / "hf", family(name, **options), perturb="all")
    file = tmp_path / f"tiny-{name}.gguf"
    write_gguf(model, arch, file)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.float32).eval()
    llm = LLM(str(file), dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert isinstance(llm.llm_engine.runner.model.layers[0].self_attn.qkv_proj, engine_gguf.GGUFLinear)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for output, prompt in zip(outputs, PROMPTS):
        assert output.outputs[0].token_ids == hf_greedy_logprobs(reference, prompt, 8)[0], name


# -- config.json as the hub's checkpoints spell it (transformers 4.x) -----------------------------------------
V4_FORMS = {  # family -> (the v4 spelling's changes, the keys it drops)
    "gemma3": ({"rope_theta": 10000.0, "rope_local_base_freq": 10.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "sliding_window_pattern": 3}, ("rope_parameters", "layer_types")),
    "gemma2": ({"rope_theta": 10000.0}, ("rope_parameters", "layer_types")),
    "qwen2-yarn": ({"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 64}},
                   ("rope_parameters",)),
    "phi4-mini": ({"rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                   "rope_scaling": {k: v for k, v in phi4_mini_rope(16, 0.75).items()
                                    if k not in ("rope_theta", "partial_rotary_factor")}}, ("rope_parameters",)),
}


@pytest.mark.parametrize("name", list(V4_FORMS))
def test_v4_config_spelling_gives_the_same_model(name):
    """RoPE bases, scaling and per-layer windows read from transformers 4.x's spelling (rope_theta
    beside rope_scaling, rope_local_base_freq, sliding_window_pattern, no layer_types) equal those
    of the v5 spelling the exactness tests use."""
    from backend.models import model_args

    config = family(name)
    v5 = {**config.to_dict(), "architectures": [causal_lm_class(config).__name__]}
    changes, dropped = V4_FORMS[name]
    v4 = {**{k: v for k, v in v5.items() if k not in dropped}, **changes}
    assert model_args(v4) == model_args(v5)
