"""Speculative decoding's speed-up on a repetitive workload: chat requests that ask the model to repeat
a piece of code with one change, or to quote a paragraph and summarise it, where prompt-lookup (ngram)
drafts are often right. Runs the offline engine with and without `speculative_config` at each
concurrency (max_num_seqs; the requests all arrive at once) and prints output tokens per second,
the speed-up and the share of draft tokens accepted. Greedy: in float32 both runs produce the same
tokens.

    python -m tools.bench_spec --dtype bfloat16 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import json
import time

from backend import LLM, SamplingParams

SNIPPETS = [
    ("fibonacci", "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"),
    ("is_prime", "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
                 "        if n % d == 0:\n            return False\n    return True\n"),
    ("word_counts", "def word_counts(text):\n    counts = {}\n    for word in text.lower().split():\n"
                    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n"),
    ("flatten", "def flatten(items):\n    result = []\n    for item in items:\n        if isinstance(item, list):\n"
                "            result.extend(flatten(item))\n        else:\n            result.append(item)\n    return result\n"),
    ("mean", "def mean(values):\n    if not values:\n        raise ValueError('mean of nothing')\n"
             "    return sum(values) / len(values)\n"),
    ("clamp", "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
              "        return high\n    return value\n"),
]
PARAGRAPHS = [
    "Continuous batching lets a serving engine admit new requests at every step instead of waiting for a "
    "whole batch to finish. Paged attention stores keys and values in fixed-size blocks, so memory is "
    "allocated on demand and shared between sequences.",
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens and wrote the weather in a worn leather book.",
]


def conversations(count: int) -> list[list[dict]]:
    """`count` chat requests: code to repeat with a function renamed, or a paragraph to quote."""
    requests = []
    for i in range(count):
        if i % 4 == 3:
            text = PARAGRAPHS[(i // 4) % len(PARAGRAPHS)]
            content = f"{text}\n\nQuote the paragraph above word for word, then summarise it in one sentence."
        else:
            name, code = SNIPPETS[i % len(SNIPPETS)]
            content = (f"Repeat this code exactly, but rename the function `{name}` to `my_{name}`:\n\n"
                       f"```python\n{code}```")
        requests.append([{"role": "user", "content": content}])
    return requests


def run(llm: LLM, requests: list[list[dict]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.chat(requests, SamplingParams(temperature=0, max_tokens=max_tokens))
    elapsed = time.perf_counter() - start
    token_ids = [o.outputs[0].token_ids for o in outputs]
    return elapsed, sum(map(len, token_ids)), token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated max_num_seqs values")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--speculative-config", default=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}))
    args = parser.parse_args()
    requests = conversations(args.requests)
    print(f"{args.requests} requests, greedy, up to {args.max_tokens} tokens, {args.dtype}; "
          f"speculative_config {args.speculative_config}")
    print("| concurrency | output tokens | tok/s without | tok/s with | speed-up | draft tokens accepted "
          "| tokens per verify step | identical outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for concurrency in map(int, args.concurrency.split(",")):
        results = {}
        for speculative in (None, args.speculative_config):
            llm = LLM(args.model, dtype=args.dtype, max_num_seqs=concurrency, speculative_config=speculative)
            run(llm, requests[:1], 8)  # warm-up
            before = {m.name: m.value for m in llm.get_metrics()}
            results[speculative] = run(llm, requests, args.max_tokens)
            after = {m.name: m.value for m in llm.get_metrics()}
            counts = {k.split("spec_decode_num_")[1]: after[k] - before[k] for k in after if "spec_decode" in k}
            del llm
        (base_time, num_tokens, base_ids), (spec_time, _, spec_ids) = results[None], results[args.speculative_config]
        # float32 is token-exact; bfloat16 rounds verification chunks and decodes differently, so
        # near-ties may break the other way (as they do between batch sizes).
        same = sum(a == b for a, b in zip(base_ids, spec_ids))
        accepted = counts["accepted_tokens"] / max(counts["draft_tokens"], 1)
        per_step = (counts["accepted_tokens"] + counts["drafts"]) / max(counts["drafts"], 1)
        print(f"| {concurrency} | {num_tokens} | {num_tokens / base_time:.1f} | {num_tokens / spec_time:.1f} | "
              f"{base_time / spec_time:.2f}x | {accepted:.0%} ({counts['accepted_tokens']:.0f} of "
              f"{counts['draft_tokens']:.0f}) | {per_step:.2f} | {same} of {len(requests)} |", flush=True)


if __name__ == "__main__":
    main()
