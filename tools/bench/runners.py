"""One function per mode, each measuring one run on the workload: tritonllm's LLM in this process,
Hugging Face `generate`, vLLM's LLM in the vLLM venv, and a server (already started) driven by the
chosen client at each concurrency."""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tools.bench import cpu_usage
from tools.bench.clients import MetricsWatcher, openai_requests, triton_requests
from tools.bench.external_clients import run_aiperf_client, run_vllm_bench_client
from tools.bench.report import RequestRecord, counters_difference, progress, run_counters, summarize
from tools.bench.servers import vllm_environment
from tools.bench.workloads import Workload, resolved_model, warm_up_prompts

VLLM_OFFLINE = Path(__file__).with_name("vllm_scripts") / "vllm_offline.py"


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
    records_list = list(records.values())
    flop = linear_flop(engine.runner.model, sum(r.input_tokens for r in records_list),
                       sum(r.output_tokens for r in records_list), len(records_list))
    return {**summarize(records_list, elapsed), "startup_s": startup,
            "dtype": str(engine.runner.dtype).removeprefix("torch."), "peak_kv_usage": peak_kv,
            "linear_gflops": flop / elapsed / 1e9, "fma_peak_gflops": fma_peak(engine.runner),
            **counters_difference(before, after)}


def fma_peak(runner) -> float | None:
    """This CPU's measured float32 FMA peak on the engine's threads, GFLOP/s, for a float32 run
    (None for other dtypes, whose peak differs, and off the CPU)."""
    import torch

    from backend.ops import cpu_ops

    on_cpu = runner.device.type == "cpu" and runner.dtype == torch.float32
    return cpu_ops.fma_peak_gflops() if on_cpu and cpu_ops.available() else None


def linear_flop(model, prompt_tokens: int, output_tokens: int, requests: int) -> float:
    """The multiply-adds (x2) of a run's linear layers, a dense model's: every projection once per
    token fed in (the prompt, and each output token but a request's last), the LM head once per
    output token. Attention's own arithmetic is left out (a few % at these lengths), and so are
    MoE's experts' sparsity and LoRA: a figure for dense models, to set against the FMA peak."""
    body = head = 0
    for name, module in model.named_modules():
        shape = (getattr(module, "out_features", None), getattr(module, "in_features", None))
        if not all(isinstance(size, int) for size in shape) or any(True for _ in module.children()):
            continue
        if name.split(".")[-1] == "lm_head":
            head += shape[0] * shape[1]
        else:
            body += shape[0] * shape[1]
    return 2.0 * (body * (prompt_tokens + output_tokens - requests) + head * output_tokens)


def _hf_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    from backend.config import EngineConfig
    from backend.worker.model_loader import resolve_device, resolve_dtype
    from backend.model_paths import resolve_model_path

    config = EngineConfig(model=args.model, dtype=args.dtype)
    dtype = resolve_dtype(config, resolve_device(config))
    model = resolve_model_path(config.model) if config.model else resolved_model(args)
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval(), torch


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


def run_vllm_offline(args, workload: Workload) -> dict:
    """vLLM's LLM, every request added at once, run by the Python given with --vllm-python (its
    own venv); its per-request times to the first and last token as ours are measured."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"model": resolved_model(args), "dtype": args.dtype,
                                    "prompts": workload.prompts, "output_lens": workload.output_lens,
                                    "warm_up": warm_up_prompts(workload)}))
        subprocess.run([args.vllm_python, str(VLLM_OFFLINE), str(spec), str(result)], check=True,
                       env=vllm_environment(args))
        figures = json.loads(result.read_text())
    records = [RequestRecord(**record) for record in figures["records"]]
    return {**summarize(records, figures["seconds"]), "startup_s": figures["startup_s"]}


OFFLINE_RUNNERS = {"offline": run_offline, "hf-sequential": run_hf_sequential, "hf-batch": run_hf_batch,
                   "vllm-offline": run_vllm_offline}


def run_server_mode(mode: str, urls: dict, args, workload: Workload, salted: bool = True) -> list[dict]:
    """One run per concurrency against a running server: `triton` by gRPC, `openai` by the
    completions endpoint (this tool's client, `vllm bench serve` or aiperf); `salted`: each run
    sends a cache_salt of its own."""
    results = []
    for concurrency in args.concurrency:
        # One server answers every mode and concurrency of a dtype in turn, and the prompts repeat: a
        # salt of its own keeps each run from finding the previous run's prompts in the prefix cache.
        cache_salt = f"tritonllm-bench-{uuid.uuid4().hex}" if salted else None
        watcher = MetricsWatcher(urls.get("metrics"))
        before, cpu_before, clients_before = watcher.counters(), cpu_usage.snapshot(), cpu_usage.client_times()
        idle_before = cpu_usage.host_idle_s()
        if args.client == "vllm-bench" and mode == "openai":
            summary = run_vllm_bench_client(urls, args, concurrency, resolved_model(args), cache_salt)
        elif args.client == "aiperf" and mode == "openai":
            summary = run_aiperf_client(urls, args, concurrency, resolved_model(args), cache_salt)
        else:
            summary = asyncio.run(run_builtin_client(mode, urls, args, workload, concurrency, cache_salt, watcher))
        cpu_after, idle_after = cpu_usage.snapshot(), cpu_usage.host_idle_s()
        output_tokens = round(summary["output_tokens_per_s"] * summary["seconds"]) if summary.get("seconds") else 0
        summary.update(concurrency=concurrency, request_rate=args.request_rate,
                       cpu=cpu_usage.difference(cpu_before, cpu_after, output_tokens,
                                                   clients=(clients_before, cpu_usage.client_times()),
                                                   idle=(idle_before, idle_after)),
                       **counters_difference(before, watcher.counters()))
        results.append(summary)
    return results


async def run_builtin_client(mode: str, urls: dict, args, workload: Workload, concurrency: int,
                             cache_salt: str | None, watcher: MetricsWatcher) -> dict:
    """This tool's own client (Triton gRPC or OpenAI SSE), with the server's KV usage polled alongside."""
    task = asyncio.create_task(watcher.watch())
    if mode == "triton":
        records, elapsed = await triton_requests(urls["grpc"], workload, concurrency, args.request_rate, args.seed,
                                                 cache_salt)
    else:
        records, elapsed = await openai_requests(urls["openai"], urls["model"], workload, concurrency,
                                                 args.request_rate, args.seed, cache_salt)
    watcher.stopped = True
    await task
    return {**summarize(records, elapsed, dict(args.goodput or [])), "peak_kv_usage": watcher.peak_kv or None}
