"""One metrics registry per engine, named as vLLM's Prometheus metrics.

`LLM.get_metrics()` returns its snapshot, and the Triton model exports the same values on Triton's
metrics port, so vLLM dashboards work with either. Counters are named without `_total`, as
prometheus_client (and so vLLM's `get_metrics`) names them; exporters add the suffix.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Latency buckets in seconds (vLLM's, shortened).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)


@dataclass
class Metric:
    """A reading: `value` for counters and gauges; sum/count/buckets for histograms."""
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    description: str
    value: float = 0.0
    buckets: tuple[float, ...] = ()
    bucket_counts: list[int] = field(default_factory=list)  # cumulative, one per bucket, then +Inf
    sum: float = 0.0
    count: int = 0
    labels: dict[str, str] = field(default_factory=dict)  # an info gauge's labels (vllm:lora_requests_info)


class MetricsRegistry:
    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()

    def _add(self, metric: Metric) -> Metric:
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, description: str) -> Metric:
        return self._add(Metric(name, "counter", description))

    def gauge(self, name: str, description: str) -> Metric:
        return self._add(Metric(name, "gauge", description))

    def histogram(self, name: str, description: str, buckets: tuple[float, ...]) -> Metric:
        return self._add(Metric(name, "histogram", description, buckets=buckets,
                                bucket_counts=[0] * (len(buckets) + 1)))

    def inc(self, metric: Metric, amount: float = 1.0) -> None:
        with self._lock:
            metric.value += amount

    def set(self, metric: Metric, value: float) -> None:
        metric.value = value

    def set_info(self, metric: Metric, labels: dict[str, str], value: float) -> None:
        with self._lock:
            metric.labels, metric.value = dict(labels), value

    def observe(self, metric: Metric, value: float) -> None:
        with self._lock:
            first = bisect.bisect_left(metric.buckets, value)
            for i in range(first, len(metric.bucket_counts)):
                metric.bucket_counts[i] += 1
            metric.sum += value
            metric.count += 1

    def snapshot(self) -> list[Metric]:
        with self._lock:
            return [Metric(m.name, m.kind, m.description, m.value, m.buckets,
                           list(m.bucket_counts), m.sum, m.count, dict(m.labels)) for m in self._metrics.values()]


class EngineMetrics:
    """The engine's metrics, created once; attribute names follow the metric names."""

    def __init__(self, enable_lora: bool = False) -> None:
        r = self.registry = MetricsRegistry()
        self.num_requests_running = r.gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = r.gauge("vllm:num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = r.gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.num_preemptions = r.counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = r.counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = r.counter("vllm:generation_tokens", "Generation tokens processed.")
        self.request_success = r.counter("vllm:request_success", "Requests that finished (stop or length).")
        self.prefix_cache_queries = r.counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = r.counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_decode_num_drafts = r.counter("vllm:spec_decode_num_drafts", "Speculative drafts verified (one per request and step).")
        self.spec_decode_num_draft_tokens = r.counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_decode_num_accepted_tokens = r.counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self.time_to_first_token = r.histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.inter_token_latency = r.histogram("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        # vLLM's info gauge: labels running_lora_adapters, waiting_lora_adapters (comma-separated
        # names) and max_lora; the value is the time they last changed.
        self.lora_requests_info = r.gauge("vllm:lora_requests_info", "Running stats on LoRA requests.") \
            if enable_lora else None
        self.e2e_request_latency = r.histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
