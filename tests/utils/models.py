"""Tiny random models built from transformers' own config classes, and Hugging Face as their
reference: one builder (`tiny_model`) for every test that needs a model other than SmolLM2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from backend import LLM, SamplingParams

# SmolLM2's KV cache block in float32: 30 layers, keys and values, blocks of 16, 3 KV heads of 64.
BLOCK_BYTES_FP32 = 2 * 30 * 16 * 3 * 64 * 4
# SmolLM2's tokenizer and chat template, for a tiny model over its vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# The model families' shared shape (tests/models/: test_model_families.py, test_moe.py, test_gpt_oss_deepseek.py).
VOCAB = 384
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3)
WINDOW = 16  # shorter than the longer prompts
PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(n)] for i, n in enumerate([6, 37])]


def causal_lm_class(config) -> type:
    """The ForCausalLM class of a transformers config (Gemma3TextConfig -> Gemma3ForCausalLM)."""
    import transformers

    name = type(config).__name__.removesuffix("Config").removesuffix("Text")
    return getattr(transformers, f"{name}ForCausalLM")


def tiny_model(path, config, perturb: str | None = None, attn_implementation: str | None = None) -> torch.nn.Module:
    """A random model of `config` (seed 0) saved to `path`; the reference model, in eval mode.

    perturb: "all" moves every parameter off its init (1-D ones, norm weights and biases, by 0.3;
    the rest by 0.02) and DeepSeek's routing-correction buffer, so a dropped term shows;
    "qkv_bias" draws the q/k/v projections' biases (zero at init) so a dropped bias shows.
    attn_implementation: the reference's attention ("eager" where sdpa lacks a feature, softcaps)."""
    torch.manual_seed(0)
    model_class = causal_lm_class(config)
    if attn_implementation is None:
        model = model_class(config)
    else:
        model = model_class._from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        if perturb == "all":
            for param in model.parameters():
                param.add_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.02))
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):  # DeepSeek's: a buffer, zero at init
                    buffer.add_(torch.randn_like(buffer) * 0.3)
        elif perturb == "qkv_bias":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.5)
        elif perturb is not None:
            raise ValueError(f"perturb: 'all', 'qkv_bias' or None, not {perturb!r}")
    model.eval().save_pretrained(path)
    return model


def copy_tokenizer(source, folder) -> str:
    """A tiny model over SmolLM2's vocabulary gets its tokenizer and chat template: `folder`."""
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, Path(folder) / name)
    return str(folder)


def hf_greedy_logprobs(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Hugging Face's greedy tokens and each one's log-probability."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [step[0].float().log_softmax(-1)[t].item() for step, t in zip(out.logits, tokens)]


def assert_greedy_matches_hf(model, path, name: str, max_tokens: int = 12) -> None:
    """Our float32 greedy tokens and their log-probabilities against Hugging Face's, for PROMPTS.
    Chunks of 16 tokens: prompts longer than a window are prefilled across several steps."""
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=16, max_num_seqs=4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1))
    for output, prompt in zip(outputs, PROMPTS):
        completion = output.outputs[0]
        tokens, logprobs = hf_greedy_logprobs(model, prompt, max_tokens)
        assert completion.token_ids == tokens, name
        # Log-probabilities see what greedy tokens cannot: a final soft cap, Granite's logits scaling.
        ours = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        assert ours == pytest.approx(logprobs, abs=1e-4), name


def assert_tensor_parallel_matches_hf(model, path, name: str, max_tokens: int = 8) -> None:
    """tp=2 over gloo: our greedy tokens for PROMPTS against Hugging Face's."""
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
              tensor_parallel_size=2)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.shutdown()
    for output, prompt in zip(outputs, PROMPTS):
        assert output.outputs[0].token_ids == hf_greedy_logprobs(model, prompt, max_tokens)[0], name
