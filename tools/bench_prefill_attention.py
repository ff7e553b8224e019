"""One layer's attention for a long prefill chunk on the CPU: our C++ kernel
(`cpu_ops.prefill_attention`) against today's `flash_prefill` (torch's flash op over the chunk's
own keys, then over its prefix gathered from the paged cache) and, for a fresh chunk, torch's flash
op alone on contiguous keys. Prints a markdown table with ratios; a tool, not a test.

    python -m tools.bench_prefill_attention [--cases 2000:0,2048:5952] [--dtype float32,bfloat16]
        [--heads 9 --kv-heads 3 --head-dim 64] [--rounds 5]

A case is `tokens:cached`: a chunk of `tokens` queries after `cached` positions (2048:5952 is the
last chunk of an 8,000-token prompt). The cache's blocks (16 positions) are shuffled, as a long-running
engine's are. ms a call (the median of alternating rounds) and the attention's GFLOP/s (4 x D per
visible score: q.k and p.v).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from backend.ops import attention, cpu_ops
from backend.ops.attention import PrefillSpan

BLOCK_SIZE = 16


def make_case(tokens: int, cached: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    context = tokens + cached
    num_blocks = -(-context // BLOCK_SIZE)
    cache = torch.randn(2, kv_heads, num_blocks, BLOCK_SIZE, head_dim, dtype=dtype)
    table = torch.randperm(num_blocks).to(torch.int32)
    query = torch.randn(tokens, heads, head_dim, dtype=dtype)
    positions = torch.arange(cached, context)
    slots = table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    key = cache[0].reshape(kv_heads, -1, head_dim)[:, slots].transpose(0, 1).contiguous()
    value = cache[1].reshape(kv_heads, -1, head_dim)[:, slots].transpose(0, 1).contiguous()
    return query, key, value, cache, PrefillSpan(0, tokens, context, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="2000:0,2048:5952")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    scale = args.head_dim ** -0.5
    print(f"{torch.get_num_threads()} threads, {args.heads} query heads over {args.kv_heads} KV heads of "
          f"{args.head_dim}, blocks of {BLOCK_SIZE} shuffled\n")
    print("| dtype | chunk | ours ms | flash_prefill ms | flash op alone ms | ours GFLOP/s | flash_prefill / ours |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for case in args.cases.split(","):
            tokens, cached = map(int, case.split(":"))
            query, key, value, cache, span = make_case(tokens, cached, args.heads, args.kv_heads, args.head_dim, dtype)
            runs = {
                "ours": partial(cpu_ops.prefill_attention, query, cache, span.block_table, span.context_len, scale),
                "flash_prefill": partial(attention.flash_prefill, query, key, value, cache, span, scale),
            }
            if cached == 0:
                q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                runs["flash op"] = partial(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                                           q, k, v, 0.0, True, scale=scale)
            ours, theirs = runs["ours"]().float(), runs["flash_prefill"]().float()
            error = (ours - theirs).abs().max().item()
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            scores = args.heads * (tokens * cached + tokens * (tokens + 1) / 2)
            gflops = 4 * args.head_dim * scores / ms["ours"] / 1e6
            alone = f"{ms['flash op']:.1f}" if "flash op" in ms else ""
            print(f"| {dtype_name} | {tokens:,} after {cached:,} (max diff {error:.1e}) | {ms['ours']:.1f} | "
                  f"{ms['flash_prefill']:.1f} | {alone} | {gflops:.0f} | {ms['flash_prefill'] / ms['ours']:.2f}x |")


if __name__ == "__main__":
    main()
