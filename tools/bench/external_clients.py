"""Other programs as the client of the served modes, each given the bench's workload and read back
into the figures the bench reports for every client: `--client vllm-bench` runs vLLM's own
`vllm bench serve` from the vLLM venv, `--client aiperf` NVIDIA's aiperf (a second opinion, from
its own venv, tools/setup_aiperf.sh). Both live in venvs of their own, so this module only runs them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.servers import vllm_environment

VLLM_COMMAND = Path(__file__).with_name("vllm_scripts") / "vllm_command.py"


def run_vllm_bench_client(urls: dict, args, concurrency: int, tokenizer: str, cache_salt: str | None) -> dict:
    """One `vllm bench serve` run against an OpenAI-compatible server; its figures in our names."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [args.vllm_python, str(VLLM_COMMAND), "bench", "serve", "--backend", "openai",
                   "--base-url", urls["openai"], "--endpoint", "/v1/completions", "--model", urls["model"],
                   "--tokenizer", tokenizer, "--dataset-name", "random",
                   "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                   "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                   "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(args.seed),
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                   "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        if cache_salt is not None:
            command += ["--extra-body", json.dumps({"cache_salt": cache_salt})]
        if args.goodput:
            command += ["--goodput", *(f"{key}:{limit:g}" for key, limit in args.goodput)]
        subprocess.run(command, check=True, env=vllm_environment(args), stdout=sys.stderr)
        figures = json.loads((Path(tmp) / "result.json").read_text())
    summary = {"output_tokens_per_s": figures["output_throughput"],
               "request_throughput": figures["request_throughput"], "seconds": figures["duration"],
               "input_tokens_per_s": figures.get("total_input_tokens", 0) / figures["duration"],
               "client": "vllm bench serve"}
    if args.goodput:
        summary["goodput"] = figures.get("request_goodput")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in (50, 90, 99):
            value = figures.get(f"p{p}_{metric}_ms", figures.get(f"median_{metric}_ms") if p == 50 else None)
            summary[f"{'e2e' if metric == 'e2el' else metric}_p{p}_ms"] = value
    return summary


# -- aiperf ----------------------------------------------------------------------------------------
EXPORT = "profile_export_aiperf.json"

# Our names for aiperf's record metrics. aiperf's `inter_token_latency` is per request,
# (E2E - TTFT) / (tokens - 1): what vLLM and this bench call TPOT. Its `inter_chunk_latency`
# is every gap between streamed chunks: our ITL.
METRICS = {"ttft": "time_to_first_token", "tpot": "inter_token_latency", "itl": "inter_chunk_latency",
           "e2e": "request_latency"}
# --goodput's objectives (vLLM's names) in aiperf's: its objective on inter_token_latency is per
# request, as vLLM's tpot is.
AIPERF_GOODPUT_NAMES = {"ttft": "time_to_first_token", "tpot": "inter_token_latency", "e2el": "request_latency"}


def aiperf_command(aiperf: str, url: str, model: str, tokenizer: str, *, input_len: int, output_len: int,
                   num_prompts: int, concurrency: int, request_rate: float, seed: int,
                   artifact_dir: str, cache_salt: str | None = None,
                   goodput: list[tuple[str, float]] | None = None) -> list[str]:
    """`aiperf profile` with vllm-bench's workload: random-token prompts of exactly `input_len`,
    `output_len` tokens out (ignore_eos; the server's default temperature, as `vllm bench serve`
    leaves it), streamed from /v1/completions; with `goodput` objectives ((key, ms), vLLM's keys),
    aiperf's goodput as well."""
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
    if goodput:  # one argument: "time_to_first_token:2000 inter_token_latency:150"
        command += ["--goodput", " ".join(f"{AIPERF_GOODPUT_NAMES[key]}:{limit:g}" for key, limit in goodput)]
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
    if "goodput" in export:  # only when asked for (--goodput)
        summary["goodput"] = avg("goodput")
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
                                 cache_salt=cache_salt, goodput=args.goodput)
        subprocess.run(command, check=True, env=env, stdout=sys.stderr)
        return figures_from_export(json.loads((Path(tmp) / EXPORT).read_text()))
