"""Mixture-of-experts speed on the CPU at a tiny-but-not-trivial shape (8 experts, top-2):

1. the MoE layer's routed experts as the engine runs them (in bfloat16 at a few tokens one C++ call,
   `backend/csrc/cpu_moe.cpp`; else grouped by expert, one GEMM per expert on plain linears), the
   grouped path on oneDNN-packed linears, and a per-token loop over the chosen experts on those,
   from a prefill chunk down to a single decode;
2. decode throughput of a random Mixtral through the offline LLM against a dense Llama of the same
   active parameters per token (its MLP as wide as top-k experts together), paired runs.

    python -m tools.bench_moe --dtype bfloat16 --repeats 3
    python -m tools.bench_moe --threads 1   # on a shared machine: fewer stalls at thread barriers
    python -m tools.bench_moe --threads 1 --num-seqs '' --num-tokens 64,48,32,24,16   # the kernel's crossover
    python -m tools.bench_moe --threads 1 --clock cpu   # on a loaded host: CPU seconds, not wall seconds
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


NUM_EXPERTS, TOP_K = 8, 2
SHAPE = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
EXPERT_INTERMEDIATE = 768


clock = time.perf_counter  # --clock cpu: time.process_time


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def layer_timings(dtype: torch.dtype, num_tokens: int, repeats: int) -> dict[str, float]:
    """Seconds per call (median) on num_tokens tokens of: the layer's routed experts as the engine
    runs them ("layer": the C++ kernel where it takes the batch, else grouped on plain linears), the
    grouped path on oneDNN-packed linears ("grouped") and the per-token loop on those ("loop")."""
    import copy

    from backend.ops import cpu_ops
    from backend.layers.moe import MoEArgs, SparseMoE, grouped_experts, per_token_experts
    from backend.worker.parallel_state import ParallelState

    torch.manual_seed(0)
    moe = MoEArgs(num_experts=NUM_EXPERTS, top_k=TOP_K, intermediate_size=EXPERT_INTERMEDIATE,
                  sparse_layers=(True,), norm_topk_prob=True)
    layer = SparseMoE(SHAPE["hidden_size"], moe, ParallelState())
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.05)
    layer = layer.to(dtype).eval()
    packed = copy.deepcopy(layer.experts)
    for expert in packed:  # as pack_linears packs experts the kernel does not run
        if expert.gate_up_proj.weight.dtype in (torch.bfloat16, torch.float32) and cpu_ops.onednn_packing():
            expert.gate_up_proj = cpu_ops.PackedLinear(expert.gate_up_proj, num_tokens, gated=True)
            expert.down_proj = cpu_ops.PackedLinear(expert.down_proj, num_tokens)
    cpu_ops.pack_linears(layer, num_tokens)
    x = torch.randn(num_tokens, SHAPE["hidden_size"], dtype=dtype)
    weights, ids = layer.gate(x)
    runs = {"layer": lambda: layer.routed_experts(x, weights, ids),
            "grouped": lambda: grouped_experts(x, weights, ids, packed),
            "loop": lambda: per_token_experts(x, weights, ids, packed)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up
            for name, run in runs.items():
                start = clock()
                run()
                times[name].append(clock() - start)
    return {name: median(values[1:]) for name, values in times.items()}


def decode_rate(folder: Path, dtype: str, num_seqs: int, output_len: int) -> float:
    """Output tokens per second (of `clock`) of num_seqs requests decoding together: a run of
    output_len + 1 tokens less a run of 1 (the prefill), on a warm engine (tools/bench_families'
    measure, on this file's clock)."""
    from backend import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              max_num_seqs=num_seqs, enable_prefix_caching=False)
    prompts = [[(7 * i + j) % 8000 + 3 for j in range(16)] for i in range(num_seqs)]

    def timed(max_tokens: int) -> float:
        start = clock()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return clock() - start

    timed(2)  # warm-up
    prefill = timed(1)
    rate = num_seqs * output_len / (timed(output_len + 1) - prefill)
    llm.shutdown()
    return rate


def build(kind: str, folder: Path) -> None:
    import transformers as t

    if kind == "mixtral":
        config = t.MixtralConfig(**SHAPE, intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=NUM_EXPERTS,
                                 num_experts_per_tok=TOP_K)
        model_class = t.MixtralForCausalLM
    else:  # the same active parameters: one MLP as wide as the top-k experts together
        config = t.LlamaConfig(**SHAPE, intermediate_size=TOP_K * EXPERT_INTERMEDIATE)
        model_class = t.LlamaForCausalLM
    torch.manual_seed(0)
    model_class._from_config(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-tokens", default="256,32,16,4,1", help="the layer's batch sizes, comma-separated")
    parser.add_argument("--num-seqs", default="1,4", help="decode batch sizes, comma-separated")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU seconds, not wall seconds (with --threads 1 on a shared, "
                             "loaded host: time spent waiting for a core is not counted)")
    args = parser.parse_args()
    if args.clock == "cpu":
        global clock
        clock = time.process_time
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"MoE layer, {NUM_EXPERTS} experts top-{TOP_K}, hidden {SHAPE['hidden_size']}, expert intermediate "
          f"{EXPERT_INTERMEDIATE}, {args.dtype}: the engine's path (C++ kernel at a few bfloat16 tokens, else "
          f"grouped by expert), grouped by expert on oneDNN-packed linears, a per-token loop over experts")
    for num_tokens in (int(n) for n in args.num_tokens.split(",")):
        t = layer_timings(dtype, num_tokens, 5 * max(args.repeats, 3))  # cheap: more repeats, steadier medians
        print(f"  {num_tokens:4d} tokens  layer {t['layer'] * 1e3:7.3f} ms  grouped (oneDNN) {t['grouped'] * 1e3:7.3f} ms  "
              f"loop {t['loop'] * 1e3:7.3f} ms  speed-up layer {t['loop'] / t['layer']:6.2f}x  "
              f"grouped {t['loop'] / t['grouped']:6.2f}x")

    kinds = ("dense", "mixtral")
    with tempfile.TemporaryDirectory() as scratch:
        for kind in kinds:
            build(kind, Path(scratch) / kind)
        for num_seqs in (int(n) for n in args.num_seqs.split(",") if n):
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(args.repeats):  # paired: each repeat runs both, in turn
                for kind in kinds:
                    rates[kind].append(decode_rate(Path(scratch) / kind, args.dtype, num_seqs, args.output_len))
            dense, mixtral = median(rates["dense"]), median(rates["mixtral"])
            print(f"decode tok/s ({args.clock} clock), {args.dtype}, {num_seqs} sequences x {args.output_len} tokens: dense (MLP "
                  f"{TOP_K * EXPERT_INTERMEDIATE}) {dense:8.1f}  Mixtral ({NUM_EXPERTS}x{EXPERT_INTERMEDIATE}, "
                  f"top-{TOP_K}) {mixtral:8.1f}  dense / MoE {dense / mixtral:.2f}x  "
                  f"runs dense [{', '.join(f'{r:.1f}' for r in rates['dense'])}] "
                  f"MoE [{', '.join(f'{r:.1f}' for r in rates['mixtral'])}]")


if __name__ == "__main__":
    main()
