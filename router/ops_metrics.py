"""Gauges for autoscalers and alert rules, read at scrape time.

``weir_queue_depth`` is per class and pool over all models; a model's
StatefulSet is scaled on its own demand, so this adds the per-model view
(deploy/k8s.py's ScaledObjects, deploy/prometheus/ rules), and each worker's
drain state, which "draining too long" alerts on.  Nothing here is touched
on the request path.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from router.core import RouterCore
from router.worker_link import WorkerLink


class OpsCollector:
    def __init__(self, core: RouterCore, link: WorkerLink) -> None:
        self.core = core
        self.link = link

    def describe(self):
        return []

    def collect(self):
        depth = GaugeMetricFamily("weir_model_queue_depth", "Queued requests per model and pool (all classes)",
                                  labels=["model", "pool"])
        queued = self.core.policy.queued_by_model()
        for m in self.core.cfg.models:  # every configured model, 0 before its first request
            for pool in ("short", "long"):
                depth.add_metric([m.name, pool], queued.get((m.name, pool), 0))
        ready = GaugeMetricFamily("weir_model_ready_workers", "Linked workers that take new work, per model",
                                  labels=["model"])
        counts = {m.name: 0 for m in self.core.cfg.models}
        draining = GaugeMetricFamily("weir_worker_draining", "1 while the worker drains (SIGTERM or "
                                     "POST /admin/workers/{id}/drain)", labels=["worker", "model"])
        left = GaugeMetricFamily("weir_worker_drain_left_seconds", "Time left of a draining worker's "
                                 "router.drain_timeout_s", labels=["worker", "model"])
        now = self.link.clock()  # the clock drain deadlines are set on
        for wid, w in sorted(self.link.workers.items()):
            model = w.reg.model
            if w.drain_deadline is None:
                if model in counts:
                    counts[model] += 1
                draining.add_metric([wid, model], 0)
            else:
                draining.add_metric([wid, model], 1)
                left.add_metric([wid, model], max(0.0, w.drain_deadline - now))
        for model, n in counts.items():
            ready.add_metric([model], n)
        yield depth
        yield ready
        yield draining
        yield left
