"""The frontend's own Prometheus metrics (Triton exports the engine's on its metrics port): requests
by endpoint and status, their latency to the last byte (streams included), those in flight, and
per Triton replica whether it is ready, whether it is broken (stopped answering), its outstanding
requests and the requests sent to it."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ReplicaCollector:
    """Read at scrape time, so replicas that come and go need no bookkeeping here."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas

    def collect(self):
        ready = GaugeMetricFamily("tritonllm_frontend_replica_ready",
                                  "1 if the replica's llm model is loaded, its process answers and it is "
                                  "routed to.", labels=("replica",))
        broken = GaugeMetricFamily("tritonllm_frontend_replica_broken",
                                   "1 if Triton or the replica's llm model process stopped answering "
                                   "(a dead stub, a frozen server): its stalled requests are failed.",
                                   labels=("replica",))
        outstanding = GaugeMetricFamily("tritonllm_frontend_replica_outstanding_requests",
                                        "Requests sent to the replica and not finished.", labels=("replica",))
        sent = CounterMetricFamily("tritonllm_frontend_replica_requests",
                                   "Requests sent to the replica (retries included).", labels=("replica",))
        for replica in self.replicas.all():
            ready.add_metric([replica.url], float(replica.ready))
            broken.add_metric([replica.url], float(replica.broken is not None))
            outstanding.add_metric([replica.url], replica.outstanding)
            sent.add_metric([replica.url], replica.requests)
        return [ready, broken, outstanding, sent]


class FrontendMetrics:
    def __init__(self, replicas=None) -> None:
        self.registry = CollectorRegistry()
        if replicas is not None:
            self.registry.register(ReplicaCollector(replicas))
        self.requests = Counter("tritonllm_frontend_requests", "HTTP requests answered.",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("tritonllm_frontend_request_duration_seconds",
                                 "Time from request to the response's last byte.", ("endpoint",),
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("tritonllm_frontend_requests_in_flight", "HTTP requests being answered.",
                               registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware: counts every request under its route's path template."""

    def __init__(self, app, metrics: FrontendMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def send_and_record(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - start)
