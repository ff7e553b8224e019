"""Time to first token with and without prefix caching, on requests sharing a ~1,000-token system
prompt (issue #5's benchmark). Requests arrive one after another, as chat turns do; prints the
mean TTFT of each mode and their ratio."""

from __future__ import annotations

import argparse
import statistics
import time

from backend import LLM, SamplingParams

SYSTEM = ("You are the support assistant of a large online retailer. Follow the policies below. "
          "Refunds are possible within thirty days of delivery when the item is unused. Shipping "
          "costs are refunded only for damaged or wrong items. Be concise and friendly. ")


def ttft(llm: LLM, prompts: list[str]) -> list[float]:
    engine = llm.llm_engine
    times = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    results = {}
    for caching in (False, True):
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching)
        system = SYSTEM * 30
        tokens = len(llm.get_tokenizer()(system).input_ids)
        prompts = [f"{system}\nCustomer {i}: where is my order number {1000 + i}?" for i in range(args.requests)]
        ttft(llm, prompts[:1])  # warm-up (and, with caching, the first fill of the cache)
        results[caching] = statistics.mean(ttft(llm, prompts[1:]))
        print(f"prefix caching {'on ' if caching else 'off'}: mean TTFT {results[caching] * 1000:.1f} ms "
              f"({tokens}-token shared system prompt, {args.requests - 1} requests)")
        del llm
    print(f"TTFT without / with prefix caching = {results[False] / results[True]:.1f}x")


if __name__ == "__main__":
    main()
