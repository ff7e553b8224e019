"""`python -m tools.bench_kv_routing`: prefix routing by the replicas' KV events against first-block
hashing, on a multi-tenant workload over two Triton replicas on this machine.

Each tenant has a system prompt of its own; every request is one of them plus a question, shuffled.
Two scenarios: `distinct` (the system prompts differ from their first token) and `shared-preamble`
(every tenant's system prompt starts with the same preamble, longer than the first blocks today's
router hashes, as when all tenants share a policy or tool list). Each scenario runs the workload
through a fresh frontend per routing: least-outstanding, prefix (first-block hashing), prefix with
KV events (`--kv-events-endpoint`, each replica publishing with `kv_events_config`). Reported: the
prefix-cache hit rate over both replicas (their vllm:prefix_cache_* counters), the requests each
replica served, throughput and TTFT. Each run gets fresh prompts, so none hits another's cache.

    python -m tools.bench_kv_routing --tenants 8 --concurrency 8 --kv-cache-memory-bytes 134217728
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.report import fmt
from tools.bench.servers import wait_http
from tools.bench.workloads import Workload, text_tokens
from tools.bench_router import routed_run, row
from tools.triton_server import TritonServer, free_port, write_model_repository

RUNS = (("least-outstanding", False), ("prefix", False), ("prefix", True))
SCENARIOS = ("distinct", "shared-preamble")


def start_replicas(args, model: str, work: Path) -> list[tuple[TritonServer, str]]:
    """Two replicas, each publishing KV events on a loopback port of its own: (server, endpoint)."""
    replicas = []
    for index in range(2):
        folder = work / f"replica{index}"
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        engine = {"model": model, "dtype": args.dtype, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                  "max_model_len": 2048, "kv_events_config": {"enable_kv_cache_events": True, "endpoint": endpoint}}
        repository = write_model_repository(folder / "repository", engine)
        replicas.append((TritonServer(repository, folder, http_port=free_port(), grpc_port=free_port(),
                                      metrics_port=free_port(), log_file=folder / "triton.log",
                                      extra_args=["--model-control-mode=explicit", "--load-model=llm"]).start(),
                         endpoint))
    for server, _ in replicas:
        server.wait_ready(600)
    return replicas


def start_frontend(model: str, replicas: list[tuple[TritonServer, str]], routing: str,
                   events: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "openai_frontend", "--port", str(port), "--model", model,
               "--routing", routing, "--log-level", "warning"]
    for server, endpoint in replicas:
        command += ["--triton-url", server.grpc_url]
        if events:
            command += ["--kv-events-endpoint", f"{server.grpc_url}={endpoint}"]
    process = subprocess.Popen(command, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/health", 300, process)
    return process, f"http://127.0.0.1:{port}"


def tenant_workload(tokenizer, args, scenario: str, seed: int) -> Workload:
    rng = random.Random(seed)
    preamble = text_tokens(tokenizer, rng, args.preamble_len) if scenario == "shared-preamble" else []
    systems = [preamble + text_tokens(tokenizer, rng, args.system_len - len(preamble)) for _ in range(args.tenants)]
    prompts = [system + text_tokens(tokenizer, rng, rng.randint(16, 32))
               for system in systems for _ in range(args.requests_per_tenant)]
    rng.shuffle(prompts)
    return Workload(scenario, prompts, [args.output_len] * len(prompts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_kv_routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=128 << 20,
                        help="per replica (SmolLM2 float32: about 5.5 of the default tenants' system prompts)")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=512, help="tokens of each tenant's system prompt")
    parser.add_argument("--preamble-len", type=int, default=128,
                        help="shared-preamble: tokens all tenants' system prompts start with")
    parser.add_argument("--requests-per-tenant", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--scenario", choices=SCENARIOS, action="append", help="default: both")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer
    from tools.prepare_model import prepare_model
    model = str(Path(args.model).expanduser()) if args.model else str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    model_name = Path(model).name
    results: dict = {"args": vars(args)}
    replicas = start_replicas(args, model, Path(tempfile.mkdtemp(prefix="bench-kv-routing-")))
    servers = [server for server, _ in replicas]
    header = f"{'run':<34}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'failed':>7}"
    seed = 0
    try:
        for scenario in args.scenario or SCENARIOS:
            print(f"\n{scenario}: {args.tenants} tenants x {args.requests_per_tenant} requests, system prompts of "
                  f"{args.system_len} tokens{f' ({args.preamble_len} shared)' if scenario != 'distinct' else ''}, "
                  f"{args.output_len} out, concurrency {args.concurrency}, 2 replicas\n{header}  prefix-cache hits",
                  flush=True)
            for routing, events in RUNS:
                seed += 1
                label = f"{routing}{' + KV events' if events else ''}"
                frontend, url = start_frontend(model, replicas, routing, events)
                warmup = Workload("warm-up", [text_tokens(tokenizer, random.Random(-seed), 40) for _ in range(4)], [2] * 4)
                summary = routed_run(servers, frontend, url, model_name, tenant_workload(tokenizer, args, scenario, seed),
                                     args.concurrency, seed, warmup)  # the warm-up lets the event subscriptions settle
                results[f"{scenario}/{label}"] = summary
                print(row(label, summary, f"{fmt(summary['prefix_cache_hit_rate'], 3)}  "
                                          f"(requests per replica {summary['requests_per_replica']})"), flush=True)
    finally:
        for server in servers:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
