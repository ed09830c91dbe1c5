"""Prometheus metrics for /metrics, through prometheus-client (text format 0.0.4).

One CollectorRegistry per app (not the process-global one), so several apps
in one process (tests) each count their own. Queue depth and decisions in
flight are read from the workers at scrape time (a custom collector); the rest
are counters and histograms updated as requests and decisions finish.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _QueueCollector:
    def __init__(self, manager):
        self.manager = manager

    def describe(self):
        return []

    def collect(self):
        in_flight = GaugeMetricFamily("gmlx_decisions_in_flight", "Decisions running now, per model",
                                      labels=["model"])
        queued = GaugeMetricFamily("gmlx_decisions_queued", "Decisions waiting in the queue, per model",
                                   labels=["model"])
        contexts = GaugeMetricFamily("gmlx_model_contexts", "llama.cpp contexts serving the model",
                                     labels=["model"])
        per: dict[str, list[int]] = {}
        for (mid, _), slot in list(self.manager.slots.items()):
            row = per.setdefault(mid, [0, 0, 0])
            if slot.worker is not None and slot.state == "ready":
                snap = slot.worker.snapshot()
                row[0] += snap["in_flight"]
                row[1] += snap["waiting"]
                row[2] += snap["parallel"]
        for mid in self.manager.cfg.models:
            row = per.get(mid, [0, 0, 0])
            in_flight.add_metric([mid], row[0])
            queued.add_metric([mid], row[1])
            contexts.add_metric([mid], row[2])
        yield in_flight
        yield queued
        yield contexts


class Metrics:
    def __init__(self, manager):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("gmlx_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.decision_seconds = Histogram("gmlx_decision_seconds", "Decision latency on the worker (leaving the "
                                          "queue to answer), by model and outcome", ["model", "outcome"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("gmlx_decision_request_seconds", "Decision request latency as the "
                                         "server sees it (body read to response), by model",
                                         ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("gmlx_queue_wait_seconds", "Time decisions waited in the queue, by model",
                                    ["model"], buckets=WAIT_BUCKETS, registry=r)
        self.tokens = Counter("gmlx_tokens_evaluated", "Prompt and output tokens of answered decisions",
                              ["model", "kind"], registry=r)
        self.cached = Counter("gmlx_cached_tokens", "Prompt tokens taken from the prefix cache", ["model"],
                              registry=r)
        self.rejected = Counter("gmlx_rejected", "Decisions answered 503 (overloaded, loading, draining) "
                                "or 504 (timeout)", ["model", "code"], registry=r)
        self.load_seconds = Gauge("gmlx_model_load_seconds", "Time llama.cpp took to load the model",
                                  ["model", "profile"], registry=r)
        r.register(_QueueCollector(manager))

    # -- hooks --------------------------------------------------------------
    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def rejection(self, model: str | None, status: int) -> None:
        if status in (503, 504):
            self.rejected.labels(model or "", str(status)).inc()

    def model_loaded(self, model: str, profile: str | None, seconds: float) -> None:
        self.load_seconds.labels(model, profile or "").set(seconds)

    def job_hook(self, model: str) -> Callable[[Any, str], None]:
        def done(job, outcome: str) -> None:
            if job.started is not None:
                self.queue_wait.labels(model).observe(max(0.0, job.started - job.submitted))
                end = job.finished if job.finished is not None else None
                if end is None:
                    import time

                    end = time.monotonic()
                self.decision_seconds.labels(model, outcome).observe(max(0.0, end - job.started))
            body = job.result
            if outcome == "served" and body:
                usage = body.get("usage") or {}
                self.tokens.labels(model, "input").inc(int(usage.get("input_tokens") or 0))
                self.tokens.labels(model, "output").inc(int(usage.get("output_tokens") or 0))
                self.cached.labels(model).inc(int(usage.get("cached_tokens") or 0))

        return done

    def render(self) -> bytes:
        return generate_latest(self.registry)
