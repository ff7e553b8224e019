"""Decode speed of the model families at one shape: tiny-but-not-trivial random models (built from
transformers' config classes, nothing downloaded) through the offline LLM, paired runs, each
family's decode tok/s and its ratio to Llama's. A family that reuses the fast ops runs at Llama's
speed; one that takes the torch paths (GeGLU, sliding windows and soft caps for now) shows it.

    python -m tools.bench_families --families llama,qwen3,gemma2 --dtype bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)


def build(family: str, folder: Path) -> None:
    import transformers as t

    config = {"llama": t.LlamaConfig, "qwen3": t.Qwen3Config, "mistral": t.MistralConfig,
              "gemma2": t.Gemma2Config, "gemma3": t.Gemma3TextConfig}[family](**SHAPE)
    architecture = "Gemma3ForCausalLM" if family == "gemma3" else type(config).__name__.replace("Config", "ForCausalLM")
    torch.manual_seed(0)
    getattr(t, architecture)._from_config(config).save_pretrained(folder)


def decode_rate(folder: Path, dtype: str, num_seqs: int, output_len: int) -> float:
    """Output tokens per second of num_seqs requests decoding together: a run of output_len + 1
    tokens less a run of 1 (the prefill), on a warm engine."""
    from backend import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              max_num_seqs=num_seqs, enable_prefix_caching=False)
    prompts = [[(7 * i + j) % 8000 + 3 for j in range(16)] for i in range(num_seqs)]

    def timed(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start

    timed(2)  # warm-up
    prefill = timed(1)
    return num_seqs * output_len / (timed(output_len + 1) - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="llama,qwen3")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    families = args.families.split(",")
    rates: dict[str, list[float]] = {f: [] for f in families}
    with tempfile.TemporaryDirectory() as scratch:
        for family in families:
            build(family, Path(scratch) / family)
        for _ in range(args.repeats):  # paired: each repeat runs every family once, in turn
            for family in families:
                rates[family].append(decode_rate(Path(scratch) / family, args.dtype, args.num_seqs, args.output_len))
    baseline = sorted(rates[families[0]])[len(rates[families[0]]) // 2]
    print(f"decode tok/s, {args.dtype}, {args.num_seqs} sequences x {args.output_len} tokens, shape {SHAPE}")
    for family in families:
        median = sorted(rates[family])[len(rates[family]) // 2]
        runs = ", ".join(f"{r:.1f}" for r in rates[family])
        print(f"{family:8s} median {median:8.1f}  ratio to {families[0]} {median / baseline:.3f}  runs [{runs}]")


if __name__ == "__main__":
    main()
