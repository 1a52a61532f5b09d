"""One linked worker as operators see it: what the views, the gauges and the
per-worker series read of the worker link (router.fleet.worker_link builds it)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from shared import protocol as p


class WorkerReport(NamedTuple):
    """One linked worker as operators see it: a copy, read at the time asked."""

    worker_id: str
    model: str
    engine: str  # "vllm" | "sim"
    gpu: p.GpuInfo  # as registered (a heartbeat's own reading is ``stats.gpu``)
    stats: p.WorkerStats  # its engine's last report
    drain_left_s: float | None  # time left of its drain (None: it takes new work)

    @property
    def draining(self) -> bool:
        return self.drain_left_s is not None


class LinkReports(Protocol):
    """What the gauges (router.observe.ops_metrics) and the per-worker series
    (router.observe.worker_series) read of the worker link (router.fleet.worker_link.WorkerLink)."""

    def reports(self) -> list[WorkerReport]: ...
