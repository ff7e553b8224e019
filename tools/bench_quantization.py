"""Offline throughput and weight memory of one model in each weight format, on the same prompts:

    python -m tools.bench_quantization [--awq DIR] [--gptq DIR] [--gguf FILE] [--num-prompts 16] ...

Rows: the float model in float32 and bfloat16, int8 and fp8 quantized at load, and the AWQ / GPTQ /
GGUF checkpoints given (make AWQ and GPTQ ones with `tritonllm quantize`), each in bfloat16 and
float32 (`--dtypes`). Prints a markdown table: output tokens/s (all prompts at once, greedy,
ignore_eos), the weights' bytes, and those of the decoder's linear layers alone.
"""

from __future__ import annotations

import argparse
import gc
import time


def measure(model: str, dtype: str, engine_args: dict, prompts: list[list[int]], output_len: int) -> dict:
    from backend import LLM, SamplingParams
    from backend.quantization import weight_bytes

    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=256 << 20, **engine_args)
    network = llm.llm_engine.runner.model
    linears = sum(p.numel() * p.element_size() for name, p in network.named_parameters()
                  if any(k in name for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tok_s": tokens / elapsed, "weights": weight_bytes(network), "linears": linears}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="float HF model folder (default: the prepared SmolLM2)")
    parser.add_argument("--awq", help="an AWQ checkpoint of the model")
    parser.add_argument("--gptq", help="a GPTQ checkpoint of the model")
    parser.add_argument("--gguf", help="a .gguf of the model")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="activation dtypes for the checkpoints")
    parser.add_argument("--rows", default=None, help="only these rows, e.g. float,int8,gguf (default: all)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from backend.model_paths import resolve_model_path
    from tools.prepare_model import prepare_model
    from tools.bench.workloads import make_workload

    model = resolve_model_path(args.model) if args.model else str(prepare_model())
    workload = make_workload("fixed", AutoTokenizer.from_pretrained(model), args.num_prompts,
                             input_len=args.input_len, output_len=args.output_len)
    dtypes = args.dtypes.split(",")
    rows = [("float", model, "float32", {}), ("float", model, "bfloat16", {}),
            ("int8", model, "bfloat16", {"quantization": "int8"}), ("fp8", model, "bfloat16", {"quantization": "fp8"}),
            ("fp8 KV cache", model, "bfloat16", {"kv_cache_dtype": "fp8"})]
    for name, path in (("awq", args.awq), ("gptq", args.gptq), ("gguf", args.gguf)):
        rows += [(name, path, dtype, {}) for dtype in dtypes] if path else []
    print(f"{args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out; greedy, all at once\n")
    print("| weights | activations | output tok/s | weight MB | decoder linears MB |")
    print("|---|---|---:|---:|---:|")
    for name, path, dtype, engine_args in rows:
        if args.rows and name not in args.rows.split(","):
            continue
        result = measure(path, dtype, engine_args, workload.prompts, args.output_len)
        print(f"| {name} | {dtype} | {result['tok_s']:.1f} | {result['weights'] / 1e6:.1f} | "
              f"{result['linears'] / 1e6:.1f} |", flush=True)
        gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
