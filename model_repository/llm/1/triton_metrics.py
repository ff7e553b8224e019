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
A labelled series (`vllm:request_success_total{finished_reason="stop"}`) is one more Metric of its
name's family. An info gauge (`vllm:lora_requests_info`) carries its reading's labels: each new set
of labels is a new series whose value is the time it was set, and the latest series is the current
state (as vLLM exports it). Histograms observe the values the engine observed (the registry hands
them over with `take_observations`), so Triton's sums and buckets are the engine's.
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
    """`readings` come from `engine.get_metrics(take_observations=True)`, first and every update."""

    def __init__(self, readings: list, labels: dict[str, str]) -> None:
        self.families: dict[str, object] = {}  # by name: one family for all of a name's series
        self.series: dict[tuple, object] = {}  # (name, labels) -> a Triton Metric
        self.previous: dict[str, object] = {}  # by reading key
        self.labels = labels
        # pb_utils gains MetricFamily only once the stub runs, so look the kinds up here.
        self.kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                      "histogram": pb_utils.MetricFamily.HISTOGRAM}
        self.update(readings)

    def _series(self, reading):
        key = (reading.name, tuple(sorted(reading.labels.items())))
        if key not in self.series:
            family = self.families.get(reading.name)
            if family is None:
                family = self.families[reading.name] = keep_forever(pb_utils.MetricFamily(
                    name=exported_name(reading), description=reading.description, kind=self.kinds[reading.kind]))
            labels = {**self.labels, **reading.labels}
            if reading.kind == "histogram":
                metric = family.Metric(labels=labels, buckets=list(reading.buckets))
            else:
                metric = family.Metric(labels=labels)
            self.series[key] = keep_forever(metric)
        return self.series[key]

    def update(self, readings: list) -> None:
        for reading in readings:
            metric = self._series(reading)
            before = self.previous.get(reading.key)
            if reading.kind == "gauge":
                if before is None or reading.value != before.value:  # each call is an IPC round trip
                    metric.set(reading.value)
            elif reading.kind == "counter":
                increase = reading.value - (before.value if before else 0.0)
                if increase > 0:
                    metric.increment(increase)
            else:
                for value in reading.observations:
                    metric.observe(value)
            self.previous[reading.key] = reading

    def close(self) -> None:
        """Stop updating; the Triton objects stay alive (see the module's docstring)."""
        self.series.clear()
        self.families.clear()
