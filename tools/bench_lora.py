"""Multi-LoRA throughput: the fixed workload (128 in / 128 out per prompt) with its requests spread
round-robin over N random adapters (all of q/k/v/o/gate/up/down, one rank), against the base model
alone, offline, on one engine each. Prints both throughputs and the ratio (the issue's bar: 0.7x).

    python -m tools.bench_lora [--num-prompts 64] [--num-adapters 4] [--rank 16] [--dtype auto]

The adapters are written straight in peft's format (adapter_config.json + adapter_model.safetensors)
from the model's config, with random A and B, into a temporary folder. Runs alternate base / LoRA
`--repeats` times (the median is reported) so that a busy machine skews both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, hf_config: dict, rank: int, seed: int) -> str:
    from safetensors.torch import save_file

    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    kv = (hf_config.get("num_key_value_heads") or heads) * head_dim
    intermediate = hf_config["intermediate_size"]
    shapes = {"self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (heads * head_dim, hidden),
              "mlp.gate_proj": (hidden, intermediate), "mlp.up_proj": (hidden, intermediate),
              "mlp.down_proj": (intermediate, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for module, (num_in, num_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, num_in, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(num_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "use_rslora": False, "use_dora": False}))
    return str(folder)


def run(args, workload, loras) -> float:
    """Output tokens per second of one engine over the workload; loras: one per request (or None)."""
    from backend import LLM, SamplingParams

    options = json.loads(args.engine_args)
    if loras is not None:
        options.update(enable_lora=True, max_loras=args.max_loras or args.num_adapters, max_lora_rank=args.rank)
    llm = LLM(args.model, dtype=args.dtype, **options)
    warm = [prompt[::-1] for prompt in workload.prompts[:2]]  # no prefix shared with the measured prompts
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4), lora_request=None if loras is None else loras[:2])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.shutdown()
    del llm
    return tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=None, help="slots (default: --num-adapters)")
    parser.add_argument("--repeats", type=int, default=1, help="base / LoRA pairs to run")
    parser.add_argument("--engine-args", default="{}", help="more LLM(...) arguments, as JSON")
    args = parser.parse_args(argv)

    from backend import LoRARequest
    from backend.engine.engine import load_tokenizer
    from backend.worker.model_loader import load_hf_config
    from tools.bench.workloads import make_workload
    from tools.prepare_model import prepare_model

    args.model = args.model or str(prepare_model())
    hf_config = load_hf_config(args.model)
    workload = make_workload("fixed", load_tokenizer(args.model), args.num_prompts,
                             input_len=args.input_len, output_len=args.output_len)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as root:
        adapters = [LoRARequest(f"adapter{i}", i + 1, write_random_adapter(Path(root) / f"adapter{i}", hf_config,
                                                                         args.rank, seed=i))
                    for i in range(args.num_adapters)]
        loras = [adapters[i % len(adapters)] for i in range(len(workload.prompts))]
        base_runs, lora_runs = [], []
        for _ in range(args.repeats):
            base_runs.append(run(args, workload, None))
            lora_runs.append(run(args, workload, loras))
    base, lora = statistics.median(base_runs), statistics.median(lora_runs)
    print(f"fixed workload: {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, dtype {args.dtype}")
    print(f"base model alone                      {base:8.1f} output tok/s  (runs: {', '.join(f'{v:.1f}' for v in base_runs)})")
    print(f"{args.num_adapters} adapters (rank {args.rank}, all 7 projections) {lora:8.1f} output tok/s  "
          f"(runs: {', '.join(f'{v:.1f}' for v in lora_runs)})")
    print(f"ratio LoRA / base                     {lora / base:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
