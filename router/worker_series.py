"""The per-worker series of /metrics, written as text (router.exposition).

They are most of the page with a large fleet: the policy's view of each
worker (capacity, reservations, dispatches, health), its engine's last
heartbeat (engine queue, KV use, counters, NVML readings) and its drain
state.  Names, labels and values are what operators' rules and dashboards
read (deploy/prometheus/, deploy/grafana/, docs/operating.md).  The policy's
snapshot and the linked workers' reports are taken when the source starts --
both are copies -- so the lines are one consistent reading, written over as
many loop turns as router.exposition's slices need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from router.exposition import header, label_text, number
from router.worker_link import WorkerReport
from shared.protocol import GpuInfo, WorkerStats

# The policy's (router.policy.Policy.snapshot), for every worker it places on.
_POLICY_GAUGES = (
    ("capacity_tokens", "KV capacity reported by the engine"),
    ("reserved_tokens", "KV tokens reserved by the router's ledger"),
    ("running", "Requests dispatched and not finished"),
    ("healthy", "1 if the worker is alive and accepting work"),
)
# The engine's own report (its last heartbeat), for linked workers.
_ENGINE_GAUGES: tuple[tuple[str, str, Callable[[WorkerStats], float]], ...] = (
    ("engine_running", "Requests running inside the engine (its own report)", lambda s: s.running),
    ("engine_waiting", "Requests waiting inside the engine (its own report)", lambda s: s.waiting),
    ("kv_usage", "Fraction of KV blocks in use (engine's report)", lambda s: s.kv_usage),
    ("preemptions", "Engine preemptions since start", lambda s: s.preemptions_total),
    ("aborts", "Requests aborted in the engine since start", lambda s: s.aborts_total),
    ("gpu_used_bytes", "GPU memory used (NVML; 0 without a GPU)", lambda s: s.gpu_used_bytes),
    ("gpu_total_bytes", "GPU memory total (NVML; 0 without a GPU)", lambda s: s.gpu_total_bytes),
)
# NVML readings from the workers' heartbeats (names an HPA or alert rule uses);
# a worker without a GPU has no samples but weir_gpu_present 0, never a 0 reading.
_GPU_GAUGES: tuple[tuple[str, str, Callable[[GpuInfo], float | None]], ...] = (
    ("gpu_present", "1 if the worker reports a GPU (NVML), 0 if it has none", lambda g: g.present),
    ("gpu_utilization_percent", "GPU utilisation, percent (NVML)", lambda g: g.utilization_percent),
    ("gpu_memory_used_bytes", "GPU memory used (NVML)", lambda g: g.used_bytes),
    ("gpu_memory_total_bytes", "GPU memory total (NVML)", lambda g: g.total_bytes),
    ("gpu_temperature_celsius", "GPU temperature, degrees Celsius (NVML)", lambda g: g.temperature_c),
    ("gpu_power_watts", "GPU power draw, watts (NVML)", lambda g: g.power_w),
)


class FleetReads(Protocol):
    """What the series read: the policy's snapshot (router.core_reads.CoreView)."""

    def scheduler_snapshot(self) -> dict[str, Any]: ...


class LinkReports(Protocol):
    """And the worker link's reports (router.worker_link.WorkerLink)."""

    def reports(self) -> list[WorkerReport]: ...


class WorkerSeries:
    """Every per-worker family; ``text`` is a router.exposition.TextSource."""

    def __init__(self, core: FleetReads, link: LinkReports) -> None:
        self.core = core
        self.link = link
        self._labels: dict[tuple[str, ...], str] = {}  # label values -> label text, kept across scrapes

    def _label(self, names: list[str], values: tuple[str, ...]) -> str:
        text = self._labels.get(values)
        if text is None:
            text = self._labels[values] = label_text(names, values)
        return text

    def text(self) -> Iterator[str]:
        workers = self.core.scheduler_snapshot()["workers"]
        reports = sorted(self.link.reports(), key=lambda r: r.worker_id)
        if len(self._labels) > 4 * (len(workers) + len(reports)) + 64:
            self._labels.clear()  # workers that left: forget their labels, not per scrape
        linked = {r.worker_id: r for r in reports}
        three = ["worker", "model", "pool"]
        placed = [(self._label(three, (w["id"], w["model"], w["pool"])), w) for w in workers]
        for name, doc in _POLICY_GAUGES:
            family = "weir_worker_" + name
            yield header(family, doc, "gauge")
            for labels, w in placed:
                yield f"{family}{labels} {number(w[name])}\n"
        engines = [(labels, r) for labels, w in placed if (r := linked.get(w["id"])) is not None]
        for name, doc, read in _ENGINE_GAUGES:
            family = "weir_worker_" + name
            yield header(family, doc, "gauge")
            for labels, r in engines:
                yield f"{family}{labels} {number(read(r.stats))}\n"
        two = ["worker", "model"]
        gpus = [
            (self._label(two, (w["id"], w["model"])), r.stats.gpu if r.stats.gpu is not None else r.gpu)
            for _, w in placed
            if (r := linked.get(w["id"])) is not None
        ]
        for name, doc, reading in _GPU_GAUGES:
            family = "weir_" + name
            yield header(family, doc, "gauge")
            for labels, g in gpus:
                v = reading(g)
                if v is not None and (g.present or name == "gpu_present"):  # no GPU: only weir_gpu_present 0
                    yield f"{family}{labels} {number(v)}\n"
        yield from self._drains(reports)

    def _drains(self, reports: list[WorkerReport]) -> Iterator[str]:
        """Each linked worker's drain state: "draining too long" alerts on these."""
        two = ["worker", "model"]
        labelled = [(self._label(two, (r.worker_id, r.model)), r.drain_left_s) for r in reports]
        family = "weir_worker_draining"
        yield header(family, "1 while the worker drains (SIGTERM or POST /admin/workers/{id}/drain)", "gauge")
        for labels, left in labelled:
            yield f"{family}{labels} {'0.0' if left is None else '1.0'}\n"
        family = "weir_worker_drain_left_seconds"
        yield header(family, "Time left of a draining worker's router.drain_timeout_s", "gauge")
        for labels, left in labelled:
            if left is not None:
                yield f"{family}{labels} {number(left)}\n"
