"""The bench's own streaming clients, Triton gRPC and the OpenAI frontend's SSE: requests launched
at a rate under a concurrency cap, each timed token by token into a RequestRecord; and the reader of
a server's Prometheus page that watches KV usage and the counters meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.request

from tools.bench.report import RequestRecord, progress, run_counters
from tools.bench.workloads import Workload


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
            except Exception as error:  # counted, not fatal
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
                          cache_salt: str | None = None):
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
        params = {"temperature": 0, "max_tokens": out_len, "ignore_eos": True}
        if cache_salt is not None:
            params["cache_salt"] = cache_salt
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
                          seed: int, cache_salt: str | None = None):
    import httpx

    api_key = os.environ.get("OPENAI_API_KEY")  # as `vllm bench serve` and the openai SDK take it
    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def one_request(prompt, out_len, record, began):
            body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if cache_salt is not None:
                body["cache_salt"] = cache_salt
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


def read_metrics(url: str, timeout: float = 2.0) -> dict[str, float]:
    """A Prometheus page's vLLM metrics by name (`vllm:...`; vLLM's own `vllm_` spelling too), each
    summed over its labels."""
    values: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=timeout) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("vllm:") or line.startswith("vllm_"):
                name, _, value = line.rpartition(" ")
                key = name.split("{")[0].replace("vllm_", "vllm:", 1)
                values[key] = values.get(key, 0.0) + float(value)
    return values


class MetricsWatcher:
    """Polls a Prometheus endpoint for peak KV usage and the preemption count."""

    def __init__(self, url: str | None) -> None:
        self.url, self.peak_kv, self.stopped = url, 0.0, False

    async def watch(self) -> None:
        while not self.stopped and self.url:
            try:
                self.peak_kv = max(self.peak_kv, read_metrics(self.url).get("vllm:kv_cache_usage_perc", 0.0))
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
            return run_counters(read_metrics(self.url))
        except OSError:
            return None
