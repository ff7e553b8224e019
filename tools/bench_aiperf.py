"""`tritonllm bench --client aiperf`: NVIDIA's aiperf as a second-opinion client for the served
modes. Builds its command line for the bench's workload and reads its JSON export
(profile_export_aiperf.json) into the figures the bench reports for every client.

aiperf lives in a venv of its own (tools/setup_aiperf.sh), so this module only runs it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXPORT = "profile_export_aiperf.json"

# Our names for aiperf's record metrics. aiperf's `inter_token_latency` is per request,
# (E2E - TTFT) / (tokens - 1): what vLLM and this bench call TPOT. Its `inter_chunk_latency`
# is every gap between streamed chunks: our ITL.
METRICS = {"ttft": "time_to_first_token", "tpot": "inter_token_latency", "itl": "inter_chunk_latency",
           "e2e": "request_latency"}


def aiperf_command(aiperf: str, url: str, model: str, tokenizer: str, *, input_len: int, output_len: int,
                   num_prompts: int, concurrency: int, request_rate: float, seed: int,
                   artifact_dir: str, cache_salt: str | None = None) -> list[str]:
    """`aiperf profile` with vllm-bench's workload: random-token prompts of exactly `input_len`,
    `output_len` tokens out (ignore_eos; the server's default temperature, as `vllm bench serve`
    leaves it), streamed from /v1/completions."""
    command = [aiperf, "profile", "--model", model, "--tokenizer", tokenizer, "--url", url,
               "--endpoint-type", "completions", "--streaming",
               "--isl", str(input_len), "--isl-stddev", "0", "--osl", str(output_len), "--osl-stddev", "0",
               "--prompt-corpus", "random", "--random-seed", str(seed),
               "--extra-inputs", "ignore_eos:true",
               # max_tokens: the field /v1/completions has always had (aiperf sends
               # max_completion_tokens otherwise). Server token counts: re-tokenizing the text of
               # random tokens does not give back their number.
               "--use-legacy-max-tokens", "--use-server-token-count",
               "--request-count", str(num_prompts), "--concurrency", str(concurrency),
               "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--no-auto-plot",
               "--export-level", "summary", "--artifact-dir", artifact_dir]
    if cache_salt is not None:
        command += ["--extra-inputs", f"cache_salt:{cache_salt}"]
    if not math.isinf(request_rate):  # Poisson arrivals (aiperf's default pattern) under the concurrency cap
        command += ["--request-rate", str(request_rate)]
    return command


def figures_from_export(export: dict) -> dict:
    """aiperf's summary export in the bench's names and units (tokens/s, requests/s, ms)."""
    def avg(name):
        return export.get(name, {}).get("avg")

    summary = {"output_tokens_per_s": avg("output_token_throughput"),
               "request_throughput": avg("request_throughput"),
               "input_tokens_per_s": avg("input_token_throughput"),
               "seconds": avg("benchmark_duration"),
               "requests": (avg("request_count") or 0) + (avg("error_request_count") or 0),
               "failed": avg("error_request_count") or 0,  # absent from the export when none failed
               "client": f"aiperf {export.get('aiperf_version', '')}".strip()}
    for ours, theirs in METRICS.items():
        for p in (50, 90, 99):
            summary[f"{ours}_p{p}_ms"] = export.get(theirs, {}).get(f"p{p}")
    return summary


def run_aiperf_client(urls: dict, args, concurrency: int, tokenizer: str, cache_salt: str | None = None) -> dict:
    """One `aiperf profile` run against an OpenAI-compatible server; its figures in our names."""
    # aiperf 0.13 in HF offline mode looks every tokenizer up in the hub cache, so a local folder
    # fails ("Repo id must be in the form ..."); without it a local folder is read from disk.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with tempfile.TemporaryDirectory() as tmp:
        command = aiperf_command(args.aiperf, urls["openai"], urls["model"], tokenizer,
                                 input_len=args.input_len, output_len=args.output_len,
                                 num_prompts=args.num_prompts, concurrency=concurrency,
                                 request_rate=args.request_rate, seed=args.seed, artifact_dir=tmp,
                                 cache_salt=cache_salt)
        subprocess.run(command, check=True, env=env, stdout=sys.stderr)
        return figures_from_export(json.loads((Path(tmp) / EXPORT).read_text()))
