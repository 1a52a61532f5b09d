"""Gauges for autoscalers and alert rules, read at scrape time.

``weir_queue_depth`` is per class and pool over all models; a model's
StatefulSet is scaled on its own demand, so this adds the per-model view
(deploy/k8s_scaling.py's ScaledObjects, deploy/prometheus/ rules), and the
workers ready per model.  (Each worker's drain state: router.observe.worker_series.)  Nothing here is touched
on the request path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from router.observe.worker_report import LinkReports
from shared.config import ModelConfig


class QueuedByModel(Protocol):
    """What the gauges read of the lifecycle (router.lifecycle.core.RouterCore)."""

    def served_models(self) -> list[ModelConfig]: ...

    def queued_by_model(self) -> dict[tuple[str, str], int]: ...


class OpsCollector:
    def __init__(self, core: QueuedByModel, link: LinkReports) -> None:
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
        for w in self.link.reports():
            if w.drain_left_s is None and w.model in counts:
                counts[w.model] += 1
        for model, n in counts.items():
            ready.add_metric([model], n)
        yield depth
        yield ready
