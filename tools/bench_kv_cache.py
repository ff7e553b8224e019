"""The 8-bit KV cache (kv_cache_dtype fp8 / fp8_e5m2) against the float cache: accuracy, decode
speed at long positions and memory. Prints markdown tables with ratios; a tool, not a test.

    python -m tools.bench_kv_cache accuracy [--dtype bfloat16] [--max-tokens 32]
    python -m tools.bench_kv_cache kernel [--context 8192] [--seqs 4] [--dtype float32,bfloat16]
                                         [--layers 1] [--layout random|ascending|descending]
    python -m tools.bench_kv_cache decode [--context 8000] [--seqs 4] [--max-tokens 32] [--dtype float32,bfloat16]

accuracy: greedy tokens of each prompt (tests/utils/prompts.py and a held-out text) with each cache:
the share of tokens before each prompt's first difference from the float cache's, and the log-prob
error: the float cache's greedy continuation scored under each cache (teacher forced, prompt
logprobs), |logprob - float's| over those tokens, mean and max.
kernel: one layer's decode attention (SmolLM2's 9 query heads over 3 KV heads of 64) for `--seqs`
sequences at `--context` positions on random blocks, the C++ kernel over each cache; ms a call,
the median of alternating rounds (bfloat16 where decodes run on AMX: with and without it).
`--layers 30` gives each of 30 layers its own cache (on huge pages, as the engine's) and calls them
in turn, as a step does: past the last-level cache, the blocks come from memory. `--layout` orders
each sequence's blocks: random, ascending (a fresh engine's) or descending (what the least recently
used blocks were before new blocks of a step were put in ascending order).
decode: the engine: `--seqs` distinct prompts of `--context` tokens, then `--max-tokens` greedy tokens
each; the median step in which every sequence decodes (prefills are left out; rounds after the first
find the prompts in the prefix cache), the median of alternating rounds. With one sequence the
weights' reads (~270 MB a step in bfloat16) bound what a smaller cache can save; with several,
attention's share grows.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

KV_DTYPES = ("auto", "fp8", "fp8_e5m2")


def prompts() -> list[str]:
    from tests.utils.prompts import PROMPTS

    return list(PROMPTS)


def accuracy(args) -> None:
    from backend import LLM, SamplingParams

    texts = prompts()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results, float_tokens, float_scores = {}, None, None
    for kv in KV_DTYPES:
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=256 << 20, seed=0)
        outputs = llm.generate(texts, greedy)
        tokens = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
        if float_tokens is None:
            float_tokens = tokens
        # The float cache's sequences, teacher forced: each continuation token's logprob under this cache.
        scored = llm.generate([{"prompt_token_ids": t} for t in float_tokens],
                              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        scores = [[next(iter(entry.values())).logprob if entry else 0.0 for entry in o.prompt_logprobs][-args.max_tokens:]
                  for o in scored]
        if float_scores is None:
            float_scores = scores
        errors = [abs(a - b) for ours, theirs in zip(scores, float_scores) for a, b in zip(ours, theirs)]
        agreed = sum(common_prefix(ours, theirs) - (len(theirs) - args.max_tokens)
                     for ours, theirs in zip(tokens, float_tokens))
        results[kv] = dict(agreed=agreed / (args.max_tokens * len(texts)), mean=statistics.fmean(errors),
                           max=max(errors), blocks=llm.llm_engine.runner.num_blocks)
        del llm
        gc.collect()
    print(f"\n{len(texts)} prompts, {args.max_tokens} greedy tokens each, {args.dtype} activations\n")
    print("| kv_cache_dtype | greedy tokens before the first difference | logprob error mean | max | blocks in 256 MiB |")
    print("|---|---:|---:|---:|---:|")
    for kv, r in results.items():
        print(f"| {kv} | {r['agreed']:.1%} | {r['mean']:.4f} | {r['max']:.3f} | {r['blocks']} |")


def common_prefix(ours: list[int], theirs: list[int]) -> int:
    count = 0
    while count < min(len(ours), len(theirs)) and ours[count] == theirs[count]:
        count += 1
    return count


def kernel(args) -> None:
    import torch

    from backend.core.kv_memory import resident_zeros
    from backend.kernels.reference import quantize_kv
    from backend.ops import cpu_ops

    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = blocks_per_seq * args.seqs + 8
    layers = "one layer" if args.layers == 1 else f"{args.layers} layers in turn"
    print(f"\ndecode attention, {layers}: {args.seqs} sequences x {args.context} positions, {heads} heads over "
          f"{kv_heads} KV heads of {dim}, {args.layout} blocks; ms a layer (median of {args.rounds} alternating rounds)\n")
    # Where bfloat16 decodes run on AMX, each cache is timed with and without (alternating).
    amx_modes = [True, False] if cpu_ops.decode_on_amx() else [False]
    print("| activations | cache | kernel | KV bytes read a layer | ms | GB/s | speed-up vs the float cache |")
    print("|---|---|---|---:|---:|---:|---:|")
    torch.manual_seed(0)
    order = {"random": torch.randperm(num_blocks), "ascending": torch.arange(num_blocks),
             "descending": torch.arange(num_blocks).flip(0)}[args.layout]
    tables = order[:blocks_per_seq * args.seqs].view(args.seqs, -1).to(torch.int32)
    rows = torch.arange(args.seqs, dtype=torch.int32)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        query = torch.randn(args.seqs, heads, dim, dtype=dtype)
        caches: dict[str, list[torch.Tensor]] = {"auto": [], "fp8": [], "fp8_e5m2": []}
        for _ in range(args.layers):
            values = torch.randn(2, kv_heads, num_blocks, block_size, dim)
            for kv, stored in (("auto", values.to(dtype)), ("fp8", quantize_kv(values, torch.float8_e4m3fn)),
                               ("fp8_e5m2", quantize_kv(values, torch.float8_e5m2))):
                cache = resident_zeros(stored.shape, stored.dtype) if args.layers > 1 else stored
                caches[kv].append(cache.copy_(stored))
        modes = amx_modes if dtype == torch.bfloat16 else [False]
        times: dict[tuple[str, bool], list[float]] = {(kv, amx): [] for kv in caches for amx in modes}
        for _ in range(args.rounds):
            for kv, amx in times:
                cpu_ops.decode_on_amx(amx)
                start = time.perf_counter()
                for _ in range(args.calls):
                    for cache in caches[kv]:
                        cpu_ops.paged_attention(query, cache, tables, rows, lens, dim ** -0.5)
                times[kv, amx].append((time.perf_counter() - start) / (args.calls * args.layers) * 1e3)
        cpu_ops.decode_on_amx(amx_modes[0])  # as it was
        base = statistics.median(times["auto", modes[0]])
        for kv, amx in times:
            ms = statistics.median(times[kv, amx])
            read = 2 * kv_heads * args.seqs * args.context * dim * caches[kv][0].element_size()
            on = "AMX" if amx else "vectors"
            print(f"| {dtype_name} | {kv} | {on} | {read / 2**20:.1f} MiB | {ms:.3f} | {read / ms / 1e6:.1f} | "
                  f"{base / ms:.2f}x |")
        del caches
        gc.collect()


def decode(args) -> None:
    from backend import LLM, SamplingParams

    print(f"\nengine decode: {args.seqs} prompt(s) of {args.context} tokens, then {args.max_tokens} greedy tokens "
          f"each; ms per decode step in which every sequence decodes (the median step of a round; the median of "
          f"{args.rounds} alternating rounds)\n")
    print("| activations | kv_cache_dtype | ms / step | speed-up vs the float cache |")
    print("|---|---|---:|---:|")
    for dtype in args.dtype.split(","):
        engines = {kv: LLM(args.model, dtype=dtype, kv_cache_dtype=kv, max_model_len=args.context + args.max_tokens + 16,
                           max_num_seqs=max(4, args.seqs), seed=0, kv_cache_memory_bytes=args.seqs << 29,  # room for all
                           # a prompt a step: the first prompts decode only a few tokens before all do
                           max_num_batched_tokens=args.context + args.seqs) for kv in ("auto", "fp8")}
        prompts = [[1000 + (7 * i + 13 * seq) % 20000 for i in range(args.context)] for seq in range(args.seqs)]
        times: dict[str, list[float]] = {kv: [] for kv in engines}
        for _ in range(args.rounds):
            for kv, llm in engines.items():
                times[kv].append(decode_step_ms(llm, prompts, args.max_tokens, SamplingParams))
                print(f"  {dtype} {kv}: {times[kv][-1]:.1f} ms/step", flush=True)
        base = statistics.median(times["auto"])
        for kv in engines:
            ms = statistics.median(times[kv])
            print(f"| {dtype} | {kv} | {ms:.1f} | {base / ms:.2f}x |")
        del engines
        gc.collect()


def decode_step_ms(llm, prompts: list[list[int]], max_tokens: int, sampling_params) -> float:
    """The requests stepped by hand: the median ms of the steps in which every one of them got a token
    (decodes only, but for the step that finishes the last prefill)."""
    engine = llm.llm_engine
    for prompt in prompts:
        engine.add_request(f"bench-{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                           sampling_params(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == len(prompts):
            steps.append((time.perf_counter() - start) * 1e3)
    return statistics.median(steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["accuracy", "kernel", "decode"])
    parser.add_argument("--model", default=None, help="HF model folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", default=None, help="activation dtype(s), comma-separated")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=None,
                        help="positions (default: kernel 8192; decode 8000, which leaves SmolLM2's 8,192 room to generate)")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--layers", type=int, default=1, help="kernel: caches called in turn, one per layer")
    parser.add_argument("--layout", choices=["random", "ascending", "descending"], default="random",
                        help="kernel: the order of each sequence's blocks")
    args = parser.parse_args()
    if args.model is None:
        from backend.model_paths import resolve_model_path

        args.model = resolve_model_path(None)
    if args.mode == "accuracy":
        args.dtype = args.dtype or "bfloat16"
        accuracy(args)
    elif args.mode == "kernel":
        args.dtype = args.dtype or "float32,bfloat16"
        args.context = args.context or 8192
        kernel(args)
    else:
        args.dtype = args.dtype or "float32,bfloat16"
        args.context = args.context or 8000
        decode(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
