"""The policy's and the workers' series of /metrics, written as text (router.observe.exposition).

With a large fleet they are most of the page: the queues and the policy's
decisions, then per worker the policy's view (capacity, reservations,
dispatches, health), its engine's last heartbeat (engine queue, KV use,
counters, NVML readings) and its drain state.  Names, labels and values are
what operators' rules and dashboards read (deploy/prometheus/,
deploy/grafana/, docs/operating.md).  One policy snapshot and one copy of the
linked workers' reports are taken when the source starts, so the lines are
one consistent reading, written over as many loop turns as
router.observe.exposition's slices need; per worker nothing is allocated but its
lines (a scrape's garbage sets off the interpreter's full collections).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from router.observe.exposition import TextCollector, header, label_text, number
from router.observe.worker_report import LinkReports, WorkerReport
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


class SchedulerReads(Protocol):
    """What the series read: the policy's snapshot (router.lifecycle.reads.RouterCoreReads)."""

    def scheduler_snapshot(self) -> dict[str, Any]: ...


class WorkerSeries(TextCollector):
    """The queues', the policy's and every per-worker family; ``text`` is a router.observe.exposition.TextSource."""

    def __init__(self, core: SchedulerReads, link: LinkReports) -> None:
        self.core = core
        self.link = link
        # label text by worker id, with the (model, pool) it was built for; kept across scrapes
        self._three: dict[str, tuple[str, str, str]] = {}
        self._two: dict[str, tuple[str, str]] = {}

    def _labels3(self, w: dict[str, Any]) -> str:
        """``{model=..,pool=..,worker=..}`` of a policy snapshot's worker."""
        wid, model, pool = w["id"], w["model"], w["pool"]
        got = self._three.get(wid)
        if got is None or got[0] != model or got[1] != pool:
            got = self._three[wid] = (model, pool, label_text(["worker", "model", "pool"], [wid, model, pool]))
        return got[2]

    def _labels2(self, wid: str, model: str) -> str:
        """``{model=..,worker=..}``."""
        got = self._two.get(wid)
        if got is None or got[0] != model:
            got = self._two[wid] = (model, label_text(["worker", "model"], [wid, model]))
        return got[1]

    def text(self) -> Iterator[str]:
        snap = self.core.scheduler_snapshot()
        workers: list[dict[str, Any]] = snap["workers"]
        reports = self.link.reports()
        if len(self._three) + len(self._two) > 4 * (len(workers) + len(reports)) + 64:
            self._three.clear()  # workers that left: forget their labels, not per scrape
            self._two.clear()
        yield from _queues(snap)
        linked = {r.worker_id: r for r in reports}
        for name, doc in _POLICY_GAUGES:
            family = "weir_worker_" + name
            yield header(family, doc, "gauge")
            for w in workers:
                yield f"{family}{self._labels3(w)} {number(w[name])}\n"
        for name, doc, read in _ENGINE_GAUGES:
            family = "weir_worker_" + name
            yield header(family, doc, "gauge")
            for w in workers:
                r = linked.get(w["id"])
                if r is not None:
                    yield f"{family}{self._labels3(w)} {number(read(r.stats))}\n"
        for name, doc, reading in _GPU_GAUGES:
            family = "weir_" + name
            yield header(family, doc, "gauge")
            for w in workers:
                r = linked.get(w["id"])
                if r is None:
                    continue
                g = r.stats.gpu if r.stats.gpu is not None else r.gpu
                v = reading(g)
                if v is not None and (g.present or name == "gpu_present"):  # no GPU: only weir_gpu_present 0
                    yield f"{family}{self._labels2(w['id'], w['model'])} {number(v)}\n"
        yield from self._drains(linked)

    def _drains(self, linked: dict[str, WorkerReport]) -> Iterator[str]:
        """Each linked worker's drain state: "draining too long" alerts on these."""
        ids = sorted(linked)
        family = "weir_worker_draining"
        yield header(family, "1 while the worker drains (SIGTERM or POST /admin/workers/{id}/drain)", "gauge")
        for wid in ids:
            r = linked[wid]
            yield f"{family}{self._labels2(wid, r.model)} {'0.0' if r.drain_left_s is None else '1.0'}\n"
        family = "weir_worker_drain_left_seconds"
        yield header(family, "Time left of a draining worker's router.drain_timeout_s", "gauge")
        for wid in ids:
            r = linked[wid]
            if r.drain_left_s is not None:
                yield f"{family}{self._labels2(wid, r.model)} {number(r.drain_left_s)}\n"


def _queues(snap: dict[str, Any]) -> Iterator[str]:
    """Queue depth and oldest wait per class and pool, and the policy's decision counters."""
    queues = snap.get("queues", [])
    for family, key, doc in (
        ("weir_queue_depth", "queued", "Queued requests"),
        ("weir_queue_oldest_wait_seconds", "oldest_wait_s", "Oldest queued request's wait"),
    ):
        yield header(family, doc, "gauge")
        for q in queues:
            yield f"{family}{label_text(['klass', 'pool'], [q['class'], q['pool']])} {number(q[key])}\n"
    family = "weir_policy_decisions_total"
    yield header(family, "Scheduling policy decisions, by kind (router.policy: Policy.counters)", "counter")
    for name, n in sorted(snap.get("counters", {}).items()):
        yield f"{family}{label_text(['decision'], [name])} {number(n)}\n"
    mape = snap.get("ttft_prediction_mape")
    if mape is not None:  # (router.policy.targets: only once a request with a target had its first token)
        family = "weir_ttft_prediction_error_ratio"
        yield header(family, "Mean |observed - predicted| / observed TTFT of the last 1,000 predictions", "gauge")
        yield f"{family} {number(mape)}\n"
    mape = snap.get("tpot_prediction_mape")
    if mape is not None:  # (once a request with a TPOT target ended)
        family = "weir_tpot_prediction_error_ratio"
        yield header(family, "Mean |observed - predicted| / observed TPOT of the last 1,000 predictions", "gauge")
        yield f"{family} {number(mape)}\n"
    rows = snap.get("targets") or []
    if rows:  # (router.policy.targets: per model and class, once a request with a target came)
        family = "weir_target_requests_total"
        yield header(family, "Requests with a latency target, by target and outcome (met, missed, shed)", "counter")
        names = ["model", "klass", "target", "outcome"]
        for row in rows:
            for target in ("ttft", "tpot"):
                for outcome in ("met", "missed", "shed"):
                    labels = label_text(names, [row["model"], row["klass"], target, outcome])
                    yield f"{family}{labels} {number(row[f'{target}_{outcome}'])}\n"
        family = "weir_target_goodput_requests_total"
        yield header(family, "Requests that met every latency target they had (its rate: goodput)", "counter")
        for row in rows:
            yield f"{family}{label_text(['model', 'klass'], [row['model'], row['klass']])} {number(row['goodput'])}\n"
