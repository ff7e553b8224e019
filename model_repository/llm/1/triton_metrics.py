"""Copy the engine's metrics (vLLM's names) to Triton's metrics port through pb_utils.MetricFamily.

The engine keeps cumulative readings; Triton's metrics only move forward (counters increment,
histograms observe), so each update applies the difference since the previous reading. Counters
get Prometheus' `_total` suffix, as vLLM exports them: `vllm:prompt_tokens_total`.

The families and metrics are never deleted, on purpose. Triton (2.51, up to core's 2026 "metrics
storage" fix) counts references to a Prometheus series per MetricFamily object, but two families of
one name share one Prometheus family, and two metrics with the same labels one series. During a
reload the new instance of the model starts before the old one is finalized (Triton loads the new
version first, and an unload waits for in-flight requests), so both hold the same series; deleting
the old instance's metrics freed the series the new instance still wrote to: tritonserver died in
prometheus::Histogram::Observe under the Python backend's Metric::Observe, or its heap was
corrupted (issue 31). Kept alive for the life of the stub process, the series outlives
every instance, and the next instance's counters continue where the last one's stopped.
An info gauge (`vllm:lora_requests_info`) carries its reading's labels: each new set of labels is a new
series whose value is the time it was set, and the latest series is the current state (as vLLM
exports it).
"""

from __future__ import annotations

import ctypes

import triton_python_backend_utils as pb_utils

# Every MetricFamily and Metric ever made by this process, with one reference each that is never
# released: not even interpreter shutdown may send Triton their delete requests (see above).
_NEVER_DELETED: list = []


def keep_forever(obj):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _NEVER_DELETED.append(obj)
    return obj

def exported_name(metric) -> str:
    return metric.name + "_total" if metric.kind == "counter" else metric.name


class MetricsExporter:
    def __init__(self, readings: list, labels: dict[str, str]) -> None:
        self.families = {}
        self.metrics = {}
        self.previous = {}
        self.labels = labels
        self.info_series: dict[tuple, object] = {}  # (name, labels) -> an info gauge's series
        # pb_utils gains MetricFamily only once the stub runs, so look the kinds up here.
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        for reading in readings:
            family = keep_forever(pb_utils.MetricFamily(
                name=exported_name(reading), description=reading.description, kind=kinds[reading.kind]))
            self.families[reading.name] = family
            if reading.kind == "histogram":
                metric = family.Metric(labels=labels, buckets=list(reading.buckets))
            else:
                metric = family.Metric(labels=labels)
            self.metrics[reading.name] = keep_forever(metric)
            self.previous[reading.name] = None
        self.update(readings)

    def update(self, readings: list) -> None:
        for reading in readings:
            metric = self.metrics.get(reading.name)
            if metric is None:
                continue
            before = self.previous[reading.name]
            if reading.labels:
                key = (reading.name, tuple(sorted(reading.labels.items())))
                if key not in self.info_series:
                    self.info_series[key] = keep_forever(
                        self.families[reading.name].Metric(labels={**self.labels, **reading.labels}))
                metric = self.info_series[key]
            if reading.kind == "gauge":
                if before is None or reading.value != before.value:  # each call is an IPC round trip
                    metric.set(reading.value)
            elif reading.kind == "counter":
                increase = reading.value - (before.value if before else 0.0)
                if increase > 0:
                    metric.increment(increase)
            else:
                for value in new_observations(before, reading):
                    metric.observe(value)
            self.previous[reading.name] = reading

    def close(self) -> None:
        """Stop updating; the Triton objects stay alive (see the module's docstring)."""
        self.metrics.clear()
        self.families.clear()


def new_observations(before, after) -> list[float]:
    """Values that, observed, move a histogram from `before` to `after` (None: empty).

    The engine's histogram holds only bucket counts and a sum, so the exact values are gone. Each
    new observation is placed inside its own bucket, all at the same relative position, chosen so
    that their sum equals the engine's: bucket counts, count and sum all come out exact.
    """
    counts = [c - (before.bucket_counts[i] if before else 0) for i, c in enumerate(after.bucket_counts)]
    # bucket_counts are cumulative (one per bound, then +Inf); per-bucket counts are differences.
    per_bucket = [counts[0]] + [counts[i] - counts[i - 1] for i in range(1, len(counts))]
    bounds = [0.0, *after.buckets]
    spans = []  # (low, high) per new observation; high None for the +Inf bucket
    for i, count in enumerate(per_bucket):
        high = after.buckets[i] if i < len(after.buckets) else None
        spans += [(bounds[i], high)] * max(count, 0)
    if not spans:
        return []
    total = after.sum - (before.sum if before else 0.0)
    low_sum = sum(low for low, _ in spans)
    high_sum = sum(low if high is None else high for low, high in spans)
    share = 1.0 if high_sum <= low_sum else min(1.0, max(1e-9, (total - low_sum) / (high_sum - low_sum)))
    unbounded = sum(1 for _, high in spans if high is None)
    overflow = max(0.0, total - high_sum) / unbounded if unbounded else 0.0
    return [low + max(overflow, 1e-6) if high is None else low + share * (high - low) for low, high in spans]
