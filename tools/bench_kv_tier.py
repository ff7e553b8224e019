"""The second KV tier (`kv_offloading_size`) on multi-turn chat: TTFT with and without the tier, and
vLLM's, when the KV cache holds half the conversations' working set. A tool, not a test.

    python -m tools.bench_kv_tier [--conversations 32] [--turns 8] [--concurrency 1] [--kv-fraction 0.5] [--tier-gib 1]
        [--modes off,tier,vllm,vllm-tier] [--vllm-python .venv-vllm/bin/python] [--dtype bfloat16]

Every conversation shares one system prompt; turn t of a conversation is the previous turn's prompt,
its answer (the engine's own `--output-tokens` greedy tokens) and a new user message, so each turn
extends the last one's prefix. The turns go round: conversation 0's turn 1, 1's, ... (with
`--concurrency` N, N conversations' turns at once, the next N when they are answered), then every
turn 2, and so on. The KV cache is sized to `--kv-fraction` of the working set (the last turns'
tokens, the system prompt counted once): while the later conversations of a round run, the
earlier ones' history is evicted, and the next round finds it again only in the second tier, or
recomputes it. TTFT: from a request's add to its first token, the median over the turns after
the first (the first has nothing to find). Each mode runs in its
own process (vLLM's in its venv); prints a markdown table with the prefix-cache hit rates and the
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SYSTEM = ("You are the support assistant of a large online retailer. Follow the policies below. Refunds "
          "are possible within thirty days of delivery when the item is unused. Shipping costs are "
          "refunded only for damaged or wrong items. Be concise, friendly and precise. ")
TOPICS = ["a late parcel", "a broken lamp", "a refund", "a wrong size", "a missing invoice", "a gift card",
          "an address change", "a double charge"]


def token_ids(tokenizer, text: str, length: int) -> list[int]:
    """`length` tokens of `text` repeated (so every message has exactly its length)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return (ids * (length // len(ids) + 1))[:length]


def workload(args) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt's tokens and each conversation's user messages (token ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    system = token_ids(tokenizer, SYSTEM, args.system_tokens)
    users = [[token_ids(tokenizer, f"Customer {c}, turn {t}: I am writing about {TOPICS[(c + t) % len(TOPICS)]} "
                        f"from order {1000 + 37 * c + t}. ", args.user_tokens) for t in range(args.turns)]
             for c in range(args.conversations)]
    return system, users


def working_set_tokens(args) -> int:
    per_conversation = args.turns * (args.user_tokens + args.output_tokens)
    return args.system_tokens + args.conversations * per_conversation


def run_turns(llm, params_class, args, system, users) -> dict:
    """The rounds of turns, `--concurrency` conversations' at once; per turn after the first the
    seconds to the first token."""
    engine = llm.llm_engine
    history = [list(system) for _ in users]
    params = params_class(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    ttfts: list[float] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        for wave in range(0, len(users), args.concurrency):
            added, first, done = {}, {}, {}
            for c in range(wave, min(wave + args.concurrency, len(users))):
                history[c] += users[c][turn]
                added[c] = time.perf_counter()
                engine.add_request(f"c{c}t{turn}", {"prompt_token_ids": list(history[c])}, params)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    c = int(output.request_id[1:].split("t")[0])
                    if c not in first and len(output.outputs[0].token_ids):
                        first[c] = time.perf_counter()
                    if output.finished:
                        done[c] = list(output.outputs[0].token_ids)
            for c, answer in done.items():
                history[c] += answer
            if turn:
                ttfts += [first[c] - added[c] for c in added]
    return {"seconds": time.perf_counter() - start, "ttft_p50": statistics.median(ttfts),
            "ttft_mean": statistics.fmean(ttfts)}


def counters(metrics) -> dict[str, float]:
    """vLLM's prefix-cache counters from get_metrics() (ours and vLLM's: names with or without _total)."""
    wanted = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
              "external_prefix_cache_hits")
    values = dict.fromkeys(wanted, 0.0)
    for metric in metrics:
        name = metric.name.removeprefix("vllm:").removesuffix("_total")
        if name in values:
            values[name] += float(getattr(metric, "value", 0.0) or 0.0)
    return values


def run_ours(args, tier: bool) -> dict:
    from backend import LLM, SamplingParams

    system, users = workload(args)
    kv_bytes = int(args.kv_fraction * working_set_tokens(args) * bytes_per_token(args))
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=kv_bytes, seed=0,
              kv_offloading_size=args.tier_gib if tier else None)
    result = run_turns(llm, SamplingParams, args, system, users)
    result.update(counters(llm.get_metrics()), kv_blocks=llm.llm_engine.kv_cache.num_blocks)
    return result


def run_vllm(args, tier: bool) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    from vllm import LLM, SamplingParams

    system, users = workload(args)
    kv_bytes = int(args.kv_fraction * working_set_tokens(args) * bytes_per_token(args))
    extra = {"kv_offloading_size": args.tier_gib} if tier else {}
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=kv_bytes, seed=0, disable_log_stats=False, **extra)
    result = run_turns(llm, SamplingParams, args, system, users)
    result.update(counters(llm.get_metrics()))
    return result


def bytes_per_token(args) -> int:
    """One token's keys and values over every layer in `--dtype` (from the model's config)."""
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as file:
        config = json.load(file)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = 4 if args.dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * element


MODES = {"off": ("ours", False), "tier": ("ours", True), "vllm": ("vllm", False), "vllm-tier": ("vllm", True)}


def child(args) -> None:
    engine, tier = MODES[args.child]
    result = (run_ours if engine == "ours" else run_vllm)(args, tier)
    with open(args.result, "w", encoding="utf-8") as file:
        json.dump(result, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="conversations whose turns run at once (1: one after another, as chat turns come)")
    parser.add_argument("--kv-fraction", type=float, default=0.5, help="KV cache / working set")
    parser.add_argument("--tier-gib", type=float, default=1.0, help="kv_offloading_size of the tier modes")
    parser.add_argument("--modes", default="off,tier", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from tools.prepare_model import prepare_model

        args.model = str(prepare_model())
    if args.child:
        return child(args)
    working = working_set_tokens(args)
    print(f"{args.conversations} conversations x {args.turns} turns, {args.system_tokens}-token system prompt, "
          f"{args.user_tokens}-token user turns, {args.output_tokens}-token answers, concurrency {args.concurrency}, "
          f"{args.dtype}: working set "
          f"{working} tokens, KV cache {args.kv_fraction:g} of it ({working * bytes_per_token(args) * args.kv_fraction / 2**20:.0f} MiB), "
          f"tier {args.tier_gib:g} GiB")
    results = {}
    for mode in args.modes.split(","):
        python = args.vllm_python if MODES[mode][0] == "vllm" else sys.executable
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            command = [python, "-m", "tools.bench_kv_tier", "--child", mode, "--result", result.name,
                       *[a for a in sys.argv[1:]], "--model", args.model]
            completed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if completed.returncode:
                errors = [line for line in completed.stderr.splitlines() if "Error" in line] or ["(no error line)"]
                print(f"{mode}: failed ({completed.returncode}): {errors[-1].strip()}")
                continue
            with open(result.name, encoding="utf-8") as file:
                results[mode] = json.load(file)
    print("| mode | TTFT p50 ms | TTFT mean ms | total s | prefix-cache hits | tier hits (of its queries) |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        device = r["prefix_cache_hits"] / max(r["prefix_cache_queries"], 1)
        tier = (f"{r['external_prefix_cache_hits'] / r['external_prefix_cache_queries']:.0%}"
                if r["external_prefix_cache_queries"] else "-")
        print(f"| {mode} | {r['ttft_p50'] * 1000:.0f} | {r['ttft_mean'] * 1000:.0f} | {r['seconds']:.1f} "
              f"| {device:.0%} | {tier} |")
    for a, b in (("off", "tier"), ("vllm", "tier"), ("vllm-tier", "tier"), ("vllm", "vllm-tier")):
        if a in results and b in results:
            print(f"TTFT p50 {a} / {b} = {results[a]['ttft_p50'] / results[b]['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
