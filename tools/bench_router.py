"""`python -m tools.bench_router`: one OpenAI frontend over one or two Triton replicas on this machine.

Two measurements, both streamed through /v1/completions with token-id prompts (`tritonllm bench`'s
client, tools/bench/clients.py), the frontend in a process of its own:

- scale-out: throughput and TTFT of the `fixed` workload against 1 replica and against 2
  (least-outstanding routing). Replicas on one machine share its cores, so the gain is bounded by
  what the cores have left: on a GPU host each replica would own a GPU.
- routing: 4 system prompts x 16 questions, shuffled, with round-robin, least-outstanding and
  prefix routing: the prefix-cache hit rate over both replicas (their vllm:prefix_cache_* counters),
  throughput and TTFT. Each run gets fresh system prompts, so none hits another's cache.

    python -m tools.bench_router --concurrency 8 --kv-cache-memory-bytes 67108864
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.clients import openai_requests, read_metrics
from tools.bench.report import counters_difference, fmt, run_counters, summarize
from tools.bench.servers import stop, wait_http
from tools.bench.workloads import Workload, make_workload, text_tokens
from tools.triton_server import TritonServer, free_port, write_model_repository

ROUTINGS = ("round-robin", "least-outstanding", "prefix")


def start_replicas(args, model: str, work: Path, count: int) -> list[TritonServer]:
    engine = {"model": model, "dtype": args.dtype, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
              "max_model_len": 2048}
    servers = []
    for index in range(count):
        folder = work / f"replica{index}"
        repository = write_model_repository(folder / "repository", engine)
        servers.append(TritonServer(repository, folder, http_port=free_port(), grpc_port=free_port(),
                                    metrics_port=free_port(), log_file=folder / "triton.log",
                                    extra_args=["--model-control-mode=explicit", "--load-model=llm"]).start())
    for server in servers:
        server.wait_ready(600)
    return servers


def start_frontend(model: str, replicas: list[TritonServer], routing: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "openai_frontend", "--port", str(port), "--model", model,
               "--routing", routing, "--log-level", "warning"]
    for replica in replicas:
        command += ["--triton-url", replica.grpc_url]
    process = subprocess.Popen(command, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/health", 300, process)
    return process, f"http://127.0.0.1:{port}"


def counters(replicas: list[TritonServer]) -> dict[str, float]:
    """The engine counters summed over the replicas (what the exporter has published)."""
    time.sleep(1.2)  # the llm model publishes its metrics every 0.5 s
    totals: dict[str, float] = {}
    for replica in replicas:
        for name, value in read_metrics(replica.metrics_url, timeout=10).items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def per_replica_requests(replicas: list[TritonServer]) -> list[int]:
    return [int(counters([replica]).get("vllm:request_success_total", 0)) for replica in replicas]


def system_prompt_workload(tokenizer, seed: int, output_len: int) -> Workload:
    rng = random.Random(seed)
    systems = [text_tokens(tokenizer, rng, 256) for _ in range(4)]
    prompts = [system + text_tokens(tokenizer, rng, rng.randint(16, 32)) for system in systems for _ in range(16)]
    rng.shuffle(prompts)
    return Workload("system-prompts", prompts, [output_len] * len(prompts))


def measure(url: str, model_name: str, workload: Workload, concurrency: int, seed: int) -> dict:
    records, elapsed = asyncio.run(openai_requests(url, model_name, workload, concurrency, float("inf"), seed))
    return summarize(records, elapsed)


def routed_run(replicas: list[TritonServer], frontend: subprocess.Popen, url: str, model_name: str,
               workload: Workload, concurrency: int, seed: int, warmup: Workload | None = None) -> dict:
    """`workload` through the frontend at `url` (after `warmup`, not counted), which is stopped after
    it: the run's summary with the replicas' prefix-cache hit rate and the requests each took."""
    try:
        if warmup is not None:
            measure(url, model_name, warmup, 2, seed)
        before, before_split = counters(replicas), per_replica_requests(replicas)
        summary = measure(url, model_name, workload, concurrency, seed)
    finally:
        stop(frontend)
    after, after_split = counters(replicas), per_replica_requests(replicas)
    summary.update(prefix_cache_hit_rate=counters_difference(run_counters(before), run_counters(after))["prefix_cache_hit_rate"],
                   requests_per_replica=[a - b for a, b in zip(after_split, before_split)])
    return summary


def row(label: str, summary: dict, extra: str = "") -> str:
    return (f"{label:<34}{summary['output_tokens_per_s']:>10.1f}{summary['request_throughput']:>8.2f}"
            f"{summary['ttft_p50_ms']:>10.0f}{summary['ttft_p90_ms']:>10.0f}{summary['failed']:>7}  {extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=96 << 20, help="per replica")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=48, help="scale-out workload size")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--skip", choices=("scale-out", "routing"), default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer
    from tools.prepare_model import prepare_model
    model = str(Path(args.model).expanduser()) if args.model else str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    model_name = Path(model).name
    results: dict = {"args": vars(args)}
    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    replicas = start_replicas(args, model, work, 2)
    header = f"{'run':<34}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'failed':>7}"
    try:
        if args.skip != "scale-out":
            warmup = make_workload("fixed", tokenizer, 2, seed=100, input_len=128, output_len=4)
            print(f"\nscale-out: {args.num_prompts} prompts of ~128 tokens, {args.output_len} out, "
                  f"concurrency {args.concurrency}\n{header}")
            for count in (1, 2):  # a seed each: the second run must not hit the first one's cache
                workload = make_workload("fixed", tokenizer, args.num_prompts, seed=count, input_len=128,
                                         output_len=args.output_len)
                frontend, url = start_frontend(model, replicas[:count], "least-outstanding")
                try:
                    measure(url, model_name, warmup, 2, 0)
                    summary = measure(url, model_name, workload, args.concurrency, 0)
                finally:
                    stop(frontend)
                results[f"replicas={count}"] = summary
                print(row(f"{count} replica{'s' if count > 1 else ''}", summary), flush=True)
        if args.skip != "routing":
            print(f"\nrouting: 4 system prompts (256 tokens) x 16 questions, {args.output_len} out, "
                  f"concurrency {args.concurrency}, 2 replicas\n{header}  prefix-cache hits")
            for seed, routing in enumerate(ROUTINGS, start=1):
                workload = system_prompt_workload(tokenizer, seed, args.output_len)
                frontend, url = start_frontend(model, replicas, routing)
                summary = routed_run(replicas, frontend, url, model_name, workload, args.concurrency, seed)
                results[f"routing={routing}"] = summary
                print(row(routing, summary, f"{fmt(summary['prefix_cache_hit_rate'], 3)}  "
                                            f"(requests per replica {summary['requests_per_replica']})"), flush=True)
    finally:
        for replica in replicas:
            replica.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
