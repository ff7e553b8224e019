"""Offline throughput: `LLM.generate` against Hugging Face transformers on the same prompts.

Workload (issue #2 / #8): N prompts of 112-144 tokens, 128 tokens out each, greedy, ignore_eos.
HF sequential runs `generate` one prompt at a time (on a subset, since it is slow: its rate is per
token and does not depend on how many prompts it sees); HF static batch pads all prompts into one
`generate` call. Prints absolute output tokens/s and ratios; writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import random
import time

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when if so "
         "what can no said who more about up its out into them then time than some only could new "
         "like other these two may first any do now such after most made over also did many before "
         "must through back years where much your way well down should because each just those "
         "people how too little state good very make world still own see men work long here get both "
         "between life being under never day same another know while last might us great old year "
         "off come since against go came right used take three kernel cache token model batch").split()


def make_prompts(tokenizer, count: int, seed: int, min_len: int = 112, max_len: int = 144) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        target = rng.randint(min_len, max_len)
        text = " ".join(rng.choice(WORDS) for _ in range(target * 2))
        prompts.append(tokenizer(text).input_ids[:target])
    return prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-sequential-prompts", type=int, default=4,
                        help="prompts HF generates one by one (0 skips it)")
    parser.add_argument("--hf-batch", action="store_true", help="also run HF static batch on all prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures to this file")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from backend import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = {"engine": {"output_tokens_per_s": generated / elapsed, "seconds": elapsed,
                          "startup_s": startup, "dtype": str(engine.runner.dtype),
                          "prompts": len(prompts), "output_tokens": generated}}
    print(f"tritonllm LLM.generate: {generated} tokens in {elapsed:.1f} s = "
          f"{generated / elapsed:.1f} out tok/s ({engine.runner.dtype}, start-up {startup:.1f} s)")
    del llm

    if args.hf_sequential_prompts or args.hf_batch:
        model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=engine.runner.dtype).eval()
        pad = engine.tokenizer.pad_token_id or 0
    if args.hf_sequential_prompts:
        subset = prompts[:args.hf_sequential_prompts]
        start = time.perf_counter()
        with torch.inference_mode():
            for prompt in subset:
                model.generate(torch.tensor([prompt]), max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                               do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
        rate = len(subset) * args.output_len / elapsed
        results["hf_sequential"] = {"output_tokens_per_s": rate, "prompts": len(subset)}
        print(f"HF sequential ({len(subset)} prompts): {rate:.1f} out tok/s; "
              f"tritonllm / HF sequential = {results['engine']['output_tokens_per_s'] / rate:.1f}x")
    if args.hf_batch:
        longest = max(map(len, prompts))
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
        rate = len(prompts) * args.output_len / elapsed
        results["hf_static_batch"] = {"output_tokens_per_s": rate, "prompts": len(prompts)}
        print(f"HF static batch ({len(prompts)} prompts): {rate:.1f} out tok/s; "
              f"tritonllm / HF static batch = {results['engine']['output_tokens_per_s'] / rate:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
