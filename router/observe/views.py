"""Read-only views of the router for operators: health, models, workers, queues, metrics.

Built from the state's owners -- the lifecycle's job table, the policy's
KV reservations and queues, the worker link's engine stats -- at the moment they
are asked for, so nothing is mirrored on the hot path.  What they read is
declared here (``CoreReads``, ``LinkReads``) and nothing else; the actions
that change state (drain, models at run time, reload) are router.observe.operator_actions'.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from router.observe.exposition import MetricsPage
from router.observe.metrics import RouterMetrics
from router.observe.ops_metrics import OpsCollector
from router.observe.worker_report import WorkerReport
from router.observe.worker_series import WorkerSeries
from shared.config import AliasConfig, ModelConfig, WorkerConfig
from shared.protocol import ErrorInfo, GpuInfo

# (name, max_model_len, workers ready, state): one row of /v1/models
ModelRow = tuple[str, int, int, str]


class CoreReads(Protocol):
    """What the views read of the lifecycle (router.lifecycle.reads.RouterCoreReads over its RouterCore)."""

    @property
    def draining(self) -> bool: ...  # router.lifecycle.drain: readiness fails

    def served_models(self) -> list[ModelConfig]: ...

    def model_aliases(self) -> list[AliasConfig]: ...

    def model_state(self, name: str) -> str: ...

    def served_adapters(self) -> list[tuple[str, str]]: ...

    def adapter_paths(self) -> dict[str, str]: ...

    def allowed_adapters(self, api_key: str | None) -> frozenset[str] | None | ErrorInfo: ...

    def runtime_workers_of(self, name: str) -> list[WorkerConfig] | None: ...

    def uptime_s(self) -> float: ...

    def live_jobs(self) -> int: ...

    def running_on(self, worker_id: str) -> list[str]: ...

    def scheduler_snapshot(self) -> dict[str, Any]: ...

    def queued_by_model(self) -> dict[tuple[str, str], int]: ...

    def tenants(self) -> dict[str, Any]: ...


class LinkReads(Protocol):
    """What the views read of the worker link (router.fleet.worker_link.WorkerLink)."""

    def worker_count(self) -> int: ...

    def report(self, worker_id: str) -> WorkerReport | None: ...

    def reports(self) -> list[WorkerReport]: ...


class RouterViews:
    def __init__(self, core: CoreReads, link: LinkReads, metrics: RouterMetrics) -> None:
        self.core = core
        self.link = link
        self.metrics = metrics
        metrics.registry.register(OpsCollector(core, link))
        metrics.add_text_source(WorkerSeries(core, link))
        self.page = MetricsPage(metrics.registry, metrics.sources)

    def models(self) -> list[ModelRow]:
        """(name, max_model_len, workers ready, state) per model served: state
        loading (no worker ready yet) / ready / unloading (router/lifecycle/core.py)."""
        ready = self.ready_workers()
        rows = [
            (m.name, m.max_model_len, ready[m.name], self.core.model_state(m.name)) for m in self.core.served_models()
        ]
        by_name = {r[0]: r for r in rows}
        for a in self.core.model_aliases():  # an alias: the smallest context behind it, every worker behind it
            behind = [by_name[n] for n in dict.fromkeys([*(t.model for t in a.targets), *a.fallbacks]) if n in by_name]
            if behind:
                n_ready = sum(r[2] for r in behind)
                rows.append((a.name, min(r[1] for r in behind), n_ready, "ready" if n_ready else "loading"))
        return rows

    def adapters(self) -> list[tuple[str, str, int, int, str]]:
        """(name, base model, max_model_len, workers ready, state) per LoRA adapter served:
        its base model's figures (the adapter runs on its base's workers)."""
        rows = {name: (max_len, ready, state) for name, max_len, ready, state in self.models()}
        return [(name, base, *rows[base]) for name, base in self.core.served_adapters() if base in rows]

    def adapter_paths(self) -> dict[str, str]:
        """name -> directory of each adapter served (the admin listing: what the supervisor replays)."""
        return self.core.adapter_paths()

    def adapters_for(self, api_key: str | None) -> list[tuple[str, str, int, int, str]] | ErrorInfo:
        """``adapters`` less those the caller's key or tenant may not use
        (/v1/models), or the refusal of a key that is not one (as a generation's)."""
        allowed = self.core.allowed_adapters(api_key)
        if isinstance(allowed, ErrorInfo):
            return allowed
        return [a for a in self.adapters() if allowed is None or a[0] in allowed]

    def admin_models(self) -> list[dict[str, Any]]:
        """Every model and its state: what the supervisor (deploy/runtime_models.py) carries out."""
        core = self.core
        ready = self.ready_workers()
        out = []
        for m in core.served_models():
            runtime = core.runtime_workers_of(m.name)
            out.append(
                {
                    "name": m.name,
                    "state": core.model_state(m.name),
                    "ready_workers": ready[m.name],
                    "runtime": runtime is not None,
                    "config": msgspec.to_builtins(m),
                    "workers": [msgspec.to_builtins(w) for w in runtime or []],
                }
            )
        return out

    def health(self) -> dict[str, Any]:
        """Liveness: the process answers (``/health``, ``/health/live``)."""
        return {
            "status": "ok",
            "workers": self.link.worker_count(),
            "uptime_s": round(self.core.uptime_s(), 3),
            "jobs": self.core.live_jobs(),
        }

    def ready_workers(self) -> dict[str, int]:
        """Per model served: linked workers that take new work."""
        counts = {m.name: 0 for m in self.core.served_models()}
        for w in self.link.reports():
            if not w.draining and w.model in counts:
                counts[w.model] += 1
        return counts

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready to serve: not draining, and at least one worker (of any model) takes new work."""
        models = self.ready_workers()
        if self.core.draining:
            return False, {"status": "draining", "models": models}
        ready = any(models.values())
        return ready, {"status": "ready" if ready else "not_ready", "models": models}

    def admin_workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = self.state()["workers"]
        return workers

    def admin_worker(self, worker_id: str) -> dict[str, Any] | None:
        """One worker's state in O(its running jobs) (``admin_workers`` is O(workers)): what each
        worker pod's probes ask every 10 s (deploy/k8s_probe.py)."""
        w = self.link.report(worker_id)
        if w is None:
            return None
        out: dict[str, Any] = {
            "id": worker_id,
            "model": w.model,
            "state": "draining" if w.draining else "ready",
            "running": len(self.core.running_on(worker_id)),
        }
        if w.drain_left_s is not None:
            out["drain_left_s"] = round(w.drain_left_s, 3)
        return out

    def admin_queues(self) -> list[dict[str, Any]]:
        queues: list[dict[str, Any]] = self.core.scheduler_snapshot()["queues"]
        return queues

    def admin_tenants(self) -> dict[str, Any]:
        """Per-tenant usage, refusals and budgets (keys by their id, never the key)."""
        return self.core.tenants()

    async def metrics_payload(self) -> tuple[bytes, str]:
        """The /metrics page, rendered in slices of the loop (router.observe.exposition)."""
        return await self.page.payload()

    def state(self) -> dict[str, Any]:
        """The policy's snapshot, each worker joined with its engine's own report."""
        snap = self.core.scheduler_snapshot()
        linked = {w.worker_id: w for w in self.link.reports()}
        for w in snap["workers"]:
            live = linked.get(w["id"])
            if live is None:
                continue
            s = live.stats
            if live.drain_left_s is None:
                w["state"] = "ready"
            else:
                w["state"] = "draining"
                w["drain_left_s"] = round(live.drain_left_s, 3)
            w.update(
                engine=live.engine,
                engine_running=s.running,
                engine_waiting=s.waiting,
                kv_usage=s.kv_usage,
                preemptions=s.preemptions_total,
                aborts=s.aborts_total,
                finished=s.finished_total,
                tokens_total=s.tokens_total,
                gpu_used_bytes=s.gpu_used_bytes,
                gpu_total_bytes=s.gpu_total_bytes,
                gpu=live.gpu.name if live.gpu.present else None,
            )
            w.update(gpu_reading(s.gpu if s.gpu is not None else live.gpu))
        return snap


def gpu_reading(g: GpuInfo) -> dict[str, Any]:
    """A worker's last NVML reading for /admin/workers and /metrics;
    ``gpu_present`` False is the explicit "no GPU" state (the rest then None)."""
    if not g.present:
        return {
            "gpu_present": False,
            "gpu_utilization_percent": None,
            "gpu_memory_used_bytes": None,
            "gpu_memory_total_bytes": None,
            "gpu_temperature_celsius": None,
            "gpu_power_watts": None,
        }
    return {
        "gpu_present": True,
        "gpu_utilization_percent": g.utilization_percent,
        "gpu_memory_used_bytes": g.used_bytes,
        "gpu_memory_total_bytes": g.total_bytes,
        "gpu_temperature_celsius": g.temperature_c,
        "gpu_power_watts": g.power_w,
    }
