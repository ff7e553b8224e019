"""One metrics registry per engine, named as vLLM's Prometheus metrics.

`LLM.get_metrics()` returns its snapshot, and the Triton model exports the same values on Triton's
metrics port, so vLLM dashboards work with either. Counters are named without `_total`, as
prometheus_client (and so vLLM's `get_metrics`) names them; exporters add the suffix.

What is counted follows vLLM v1 (what Triton's vLLM backend exports); docs/triton.md lists it:
- `prompt_tokens` counts each sample's prompt once, at its first token (n samples of one prompt
  count it n times); `generation_tokens` every token appended to a sample.
- per sample, when its request ends (a cancelled request's samples included, as abort):
  `request_success{finished_reason=stop|length|abort}`, `request_prompt_tokens`,
  `request_generation_tokens`, `request_params_max_tokens`, and the latencies
  `e2e_request_latency`, `request_queue_time` (arrival to first scheduled), `request_prefill_time`
  (to first token), `request_decode_time` (first to last token) and `request_inference_time`
  (first scheduled to last token): a phase never reached lasts 0 s, so prefill + decode = inference.
- per user request: `request_params_n`.
- per sample and step: `time_to_first_token` at its first token; after that, `inter_token_latency`
  and `time_per_output_token` (the same values, as in vLLM v1).
- per sample at its first admission: `prefix_cache_queries` (its prompt tokens) and
  `prefix_cache_hits` (those found in the KV cache); with a second KV tier also
  `external_prefix_cache_queries` (the prompt tokens past those hits) and
  `external_prefix_cache_hits` (those loaded back from the tier), as vLLM counts its connector's.
- per step that sampled: `iteration_tokens_total`, the prompt tokens counted that step plus the
  tokens appended (its sum is prompt_tokens + generation_tokens).

Histograms keep cumulative bucket counts, sum and count, observed in order: what a Prometheus
histogram that observed the same values would show, so an exporter copies them as they are.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Latency buckets in seconds (vLLM's).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    bounds: list[int] = []
    power = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * power > limit:
                return tuple(bounds)
            bounds.append(mantissa * power)
        power *= 10


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
    # A series' labels (vllm:request_success's finished_reason), or an info gauge's current ones
    # (vllm:lora_requests_info, whose labels change while its key stays its name).
    labels: dict[str, str] = field(default_factory=dict)
    key: str = ""  # unique in the registry: the name, plus the labels of a labelled series


class MetricsRegistry:
    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()

    def _add(self, metric: Metric) -> Metric:
        if not metric.key:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(metric.labels.items()))
            metric.key = metric.name + (f"{{{labels}}}" if labels else "")
        self._metrics[metric.key] = metric
        return metric

    def counter(self, name: str, description: str, labels: dict[str, str] | None = None) -> Metric:
        return self._add(Metric(name, "counter", description, labels=dict(labels or {})))

    def gauge(self, name: str, description: str) -> Metric:
        return self._add(Metric(name, "gauge", description))

    def info_gauge(self, name: str, description: str) -> Metric:
        return self._add(Metric(name, "gauge", description, key=name))

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

    def observe(self, metric: Metric, value: float, times: int = 1) -> None:
        with self._lock:
            first = bisect.bisect_left(metric.buckets, value)
            for i in range(first, len(metric.bucket_counts)):
                metric.bucket_counts[i] += times
            metric.sum += value * times
            metric.count += times

    def snapshot(self) -> list[Metric]:
        """Copies of every reading."""
        with self._lock:
            return [Metric(m.name, m.kind, m.description, m.value, m.buckets, list(m.bucket_counts), m.sum,
                           m.count, dict(m.labels), m.key) for m in self._metrics.values()]


class EngineMetrics:
    """The engine's metrics, created once; attribute names follow the metric names."""

    def __init__(self, enable_lora: bool = False, max_model_len: int = 2048) -> None:
        r = self.registry = MetricsRegistry()
        self.num_requests_running = r.gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = r.gauge("vllm:num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = r.gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.num_preemptions = r.counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = r.counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = r.counter("vllm:generation_tokens", "Generation tokens processed.")
        self.request_success = {reason: r.counter("vllm:request_success", "Samples that finished, by reason.",
                                                  {"finished_reason": reason})
                                for reason in FINISH_REASONS}
        self.prefix_cache_queries = r.counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = r.counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # The second KV tier (kv_offloading_size) as vLLM counts its KV connector's: the prompt
        # tokens past the prefix cache's hits, and those of them loaded back from the tier.
        self.external_prefix_cache_queries = r.counter("vllm:external_prefix_cache_queries",
                                                       "Prompt tokens looked up in the second KV tier.")
        self.external_prefix_cache_hits = r.counter("vllm:external_prefix_cache_hits",
                                                    "Prompt tokens loaded back from the second KV tier.")
        self.spec_decode_num_drafts = r.counter("vllm:spec_decode_num_drafts", "Speculative drafts verified (one per request and step).")
        self.spec_decode_num_draft_tokens = r.counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_decode_num_accepted_tokens = r.counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self.iteration_tokens = r.histogram("vllm:iteration_tokens_total", "Tokens per engine step.",
                                            ITERATION_TOKENS_BUCKETS)
        self.time_to_first_token = r.histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.inter_token_latency = r.histogram("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.time_per_output_token = r.histogram("vllm:time_per_output_token_seconds",
                                                 "Time per output token after the first.", ITL_BUCKETS)
        # vLLM's info gauge: labels running_lora_adapters, waiting_lora_adapters (comma-separated
        # names) and max_lora; the value is the time they last changed.
        self.lora_requests_info = r.info_gauge("vllm:lora_requests_info", "Running stats on LoRA requests.") \
            if enable_lora else None
        self.e2e_request_latency = r.histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                                               REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = r.histogram("vllm:request_queue_time_seconds",
                                              "Time from arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = r.histogram("vllm:request_prefill_time_seconds",
                                                "Time from first scheduled to first token.", REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = r.histogram("vllm:request_decode_time_seconds",
                                               "Time from first token to last token.", REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = r.histogram("vllm:request_inference_time_seconds",
                                                  "Time from first scheduled to last token.", REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = r.histogram("vllm:request_prompt_tokens", "Prompt tokens per sample.",
                                                 token_buckets)
        self.request_generation_tokens = r.histogram("vllm:request_generation_tokens",
                                                     "Generated tokens per sample.", token_buckets)
        self.request_params_n = r.histogram("vllm:request_params_n", "The n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = r.histogram("vllm:request_params_max_tokens",
                                                     "The max_tokens request parameter.", token_buckets)
