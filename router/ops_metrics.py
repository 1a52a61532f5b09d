"""Gauges for autoscalers and alert rules, read at scrape time.

``weir_queue_depth`` is per class and pool over all models; a model's
StatefulSet is scaled on its own demand, so this adds the per-model view
(deploy/k8s_scaling.py's ScaledObjects, deploy/prometheus/ rules), and each worker's
drain state, which "draining too long" alerts on.  Nothing here is touched
on the request path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from router.worker_link import WorkerReport
from shared.config import ModelConfig


class ModelQueues(Protocol):
    """What the gauges read of the lifecycle (router.core.RouterCore)."""

    def served_models(self) -> list[ModelConfig]: ...

    def queued_by_model(self) -> dict[tuple[str, str], int]: ...


class LinkedWorkers(Protocol):
    """What the gauges read of the worker link (router.worker_link.WorkerLink)."""

    def reports(self) -> list[WorkerReport]: ...


class OpsCollector:
    def __init__(self, core: ModelQueues, link: LinkedWorkers) -> None:
        self.core = core
        self.link = link

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "weir_model_queue_depth", "Queued requests per model and pool (all classes)", labels=["model", "pool"]
        )
        queued = self.core.queued_by_model()
        models = self.core.served_models()
        for m in models:  # every model served, 0 before its first request
            for pool in ("short", "long"):
                depth.add_metric([m.name, pool], queued.get((m.name, pool), 0))
        ready = GaugeMetricFamily(
            "weir_model_ready_workers", "Linked workers that take new work, per model", labels=["model"]
        )
        counts = {m.name: 0 for m in models}
        draining = GaugeMetricFamily(
            "weir_worker_draining",
            "1 while the worker drains (SIGTERM or POST /admin/workers/{id}/drain)",
            labels=["worker", "model"],
        )
        left = GaugeMetricFamily(
            "weir_worker_drain_left_seconds",
            "Time left of a draining worker's router.drain_timeout_s",
            labels=["worker", "model"],
        )
        for w in sorted(self.link.reports(), key=lambda w: w.worker_id):
            wid, model = w.worker_id, w.model
            if w.drain_left_s is None:
                if model in counts:
                    counts[model] += 1
                draining.add_metric([wid, model], 0)
            else:
                draining.add_metric([wid, model], 1)
                left.add_metric([wid, model], w.drain_left_s)
        for model, n in counts.items():
            ready.add_metric([model], n)
        yield depth
        yield ready
        yield draining
        yield left
