"""The router's Prometheus metrics.

Per-request metrics are observed on label-bound children cached in dicts (a
``labels()`` lookup costs more than the observation).  State that already
lives elsewhere -- queue depths, reservations, worker stats -- is read at
scrape time by a collector instead of being mirrored on every event.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

# Latency buckets from sub-millisecond (sim, overhead) to minutes (long generations).
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "weir_requests", "Requests finished, by model, class and outcome",
            ["model", "klass", "outcome"], registry=r,
        )
        self.rejected = Counter(
            "weir_rejected", "Requests refused, by class, pool and reason",
            ["klass", "pool", "reason"], registry=r,
        )
        self.tokens = Counter("weir_output_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram(
            "weir_time_to_first_token_seconds", "Arrival at the router to first token",
            ["model", "klass"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "weir_request_duration_seconds", "Arrival at the router to last token",
            ["model", "klass"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_wait = Histogram(
            "weir_queue_wait_seconds", "Arrival to dispatch to a worker",
            ["klass", "pool"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.worker_events = Counter(
            "weir_worker_events", "Worker registrations and losses", ["worker", "event"], registry=r,
        )
        self.bad_frames = Counter(
            "weir_malformed_frames", "ZeroMQ frames dropped as undecodable", ["socket"], registry=r,
        )
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels):
        """Cached ``metric.labels(*labels)``."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def add_state_collector(self, snapshot: Callable[[], dict]) -> None:
        self.registry.register(_StateCollector(snapshot))


class _StateCollector:
    """Gauges read from the router's live state at scrape time."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        snap = self._snapshot()
        depth = GaugeMetricFamily("weir_queue_depth", "Queued requests", labels=["klass", "pool"])
        oldest = GaugeMetricFamily("weir_queue_oldest_wait_seconds", "Oldest queued request's wait", labels=["klass", "pool"])
        for q in snap.get("queues", []):
            depth.add_metric([q["class"], q["pool"]], q["queued"])
            oldest.add_metric([q["class"], q["pool"]], q["oldest_wait_s"])
        gauges = {
            name: GaugeMetricFamily(f"weir_worker_{name}", doc, labels=["worker", "model", "pool"])
            for name, doc in (
                ("capacity_tokens", "KV capacity reported by the engine"),
                ("reserved_tokens", "KV tokens reserved by the router's ledger"),
                ("running", "Requests dispatched and not finished"),
                ("healthy", "1 if the worker is alive and accepting work"),
                ("engine_running", "Requests running inside the engine (its own report)"),
                ("engine_waiting", "Requests waiting inside the engine (its own report)"),
                ("kv_usage", "Fraction of KV blocks in use (engine's report)"),
                ("preemptions", "Engine preemptions since start"),
                ("aborts", "Requests aborted in the engine since start"),
                ("gpu_used_bytes", "GPU memory used (NVML; 0 without a GPU)"),
                ("gpu_total_bytes", "GPU memory total (NVML; 0 without a GPU)"),
            )
        }
        for w in snap.get("workers", []):
            labels = [w["id"], w["model"], w["pool"]]
            for name, g in gauges.items():
                if name in w:
                    g.add_metric(labels, float(w[name]))
        yield depth
        yield oldest
        yield from gauges.values()
