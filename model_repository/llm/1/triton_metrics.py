"""Copy the engine's metrics (vLLM's names) to Triton's metrics port through pb_utils.MetricFamily.

The engine keeps cumulative readings; Triton's counters only move forward, so each update applies
the difference since the previous reading. Counters
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
A labelled series (`vllm:request_success_total{finished_reason="stop"}`) is one more Metric of its
name's family. An info gauge (`vllm:lora_requests_info`) carries its reading's labels: each new set
of labels is a new series whose value is the time it was set, and the latest series is the current
state (as vLLM exports it).

A histogram is exported as Prometheus lays one out, `<name>_bucket{le=...}`, `<name>_sum` and
`<name>_count`, each a counter moved by the engine's cumulative readings, not through Triton's
histogram kind: that kind takes one value per `observe()`, and every call is a round trip between
the stub and tritonserver (two histograms see every generated token, so two round trips a token
beside the response's one). Here an update costs one call per bucket that moved. The series'
names, labels and values are the ones a histogram would show (`histogram_quantile` reads them
alike); only their `# TYPE` lines say counter.
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


def bound_label(bound: float) -> str:
    """A bucket's `le` as prometheus_client (so vLLM) writes it: 0.5, 1.0, +Inf."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


class MetricsExporter:
    """`readings` come from `engine.get_metrics()`, first and every update."""

    def __init__(self, readings: list, labels: dict[str, str]) -> None:
        self.families: dict[str, object] = {}  # by exported name: one family for all of a name's series
        self.series: dict[tuple, object] = {}  # (exported name, labels) -> a Triton Metric
        self.previous: dict[str, object] = {}  # by reading key
        self.labels = labels
        # pb_utils gains MetricFamily only once the stub runs, so look the kinds up here.
        self.kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
        self.update(readings)

    def _series(self, name: str, kind: str, description: str, labels: dict[str, str]):
        key = (name, tuple(sorted(labels.items())))
        if key not in self.series:
            family = self.families.get(name)
            if family is None:
                family = self.families[name] = keep_forever(pb_utils.MetricFamily(
                    name=name, description=description, kind=self.kinds[kind]))
            self.series[key] = keep_forever(family.Metric(labels={**self.labels, **labels}))
        return self.series[key]

    def update(self, readings: list) -> None:
        for reading in readings:
            before = self.previous.get(reading.key)
            if reading.kind == "histogram":
                self._update_histogram(reading, before)
            else:
                metric = self._series(exported_name(reading), reading.kind, reading.description, reading.labels)
                if reading.kind == "gauge":
                    if before is None or reading.value != before.value:  # each call is an IPC round trip
                        metric.set(reading.value)
                else:
                    increase = reading.value - (before.value if before else 0.0)
                    if increase > 0:
                        metric.increment(increase)
            self.previous[reading.key] = reading

    def _update_histogram(self, reading, before) -> None:
        """Every series exists from the first update; later ones move only what changed."""
        if before is not None and reading.count == before.count:
            return
        bounds = [*reading.buckets, float("inf")]
        previous_counts = before.bucket_counts if before else [0] * len(bounds)
        for bound, count, previous in zip(bounds, reading.bucket_counts, previous_counts):
            metric = self._series(f"{reading.name}_bucket", "counter", reading.description,
                                  {**reading.labels, "le": bound_label(bound)})
            if count > previous:
                metric.increment(count - previous)
        for suffix, total, previous in (("_sum", reading.sum, before.sum if before else 0.0),
                                        ("_count", reading.count, before.count if before else 0)):
            metric = self._series(reading.name + suffix, "counter", reading.description, reading.labels)
            if total > previous:
                metric.increment(total - previous)

    def close(self) -> None:
        """Stop updating; the Triton objects stay alive (see the module's docstring)."""
        self.series.clear()
        self.families.clear()
