"""Read-only views of the router for operators: health, models, admin, metrics.

Built from the state's owners -- the lifecycle's job table, the policy's
ledger and queues, the worker link's engine stats -- at the moment they
are asked for, so nothing is mirrored on the hot path.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.core import RouterCore
from router.worker_link import WorkerLink
from shared.protocol import GpuInfo


class RouterViews:
    def __init__(self, core: RouterCore, link: WorkerLink, reload: Optional[Callable[[], dict]] = None) -> None:
        self.core = core
        self.link = link
        self._reload = reload
        core.metrics.add_state_collector(self.state)

    def models(self) -> list[tuple[str, int, int]]:
        """(name, max_model_len, workers ready) per configured model."""
        ready = self.ready_workers()
        return [(m.name, m.max_model_len, ready[m.name]) for m in self.core.cfg.models]

    def health(self) -> dict:
        """Liveness: the process answers (``/health``, ``/health/live``)."""
        core = self.core
        return {"status": "ok", "workers": len(self.link.workers),
                "uptime_s": round(core.clock() - core.started_at, 3), "jobs": len(core.jobs)}

    def ready_workers(self) -> dict[str, int]:
        """Per configured model: linked workers that take new work."""
        counts = {m.name: 0 for m in self.core.cfg.models}
        for w in self.link.workers.values():
            if w.drain_deadline is None and w.reg.model in counts:
                counts[w.reg.model] += 1
        return counts

    def readiness(self) -> tuple[bool, dict]:
        """Ready to serve: at least one worker (of any model) takes new work."""
        models = self.ready_workers()
        ready = any(models.values())
        return ready, {"status": "ready" if ready else "not_ready", "models": models}

    def drain(self, worker_id: str, on: bool) -> bool:
        return self.link.drain(worker_id) if on else self.link.undrain(worker_id)

    def admin_workers(self) -> list[dict]:
        return self.state()["workers"]

    def admin_queues(self) -> list[dict]:
        return self.core.policy.snapshot(self.core.clock())["queues"]

    def admin_tenants(self) -> dict:
        """Per-tenant usage, refusals and budgets (keys by their id, never the key)."""
        return self.core.quota.snapshot()

    def reload(self) -> dict:
        if self._reload is None:
            return {"ok": False, "error": "reload is not wired in this router"}
        return self._reload()

    def metrics_payload(self) -> tuple[bytes, str]:
        return generate_latest(self.core.metrics.registry), CONTENT_TYPE_LATEST

    def state(self) -> dict:
        """The policy's snapshot, each worker joined with its engine's own report."""
        now = self.core.clock()
        snap = self.core.policy.snapshot(now)
        linked = self.link.workers
        for w in snap["workers"]:
            live = linked.get(w["id"])
            if live is not None:
                s = live.stats
                if live.drain_deadline is None:
                    w["state"] = "ready"
                else:
                    w["state"] = "draining"
                    w["drain_left_s"] = round(max(0.0, live.drain_deadline - now), 3)
                w.update(engine=live.reg.engine, engine_running=s.running, engine_waiting=s.waiting,
                         kv_usage=s.kv_usage, preemptions=s.preemptions_total,
                         aborts=s.aborts_total, finished=s.finished_total, tokens_total=s.tokens_total,
                         gpu_used_bytes=s.gpu_used_bytes, gpu_total_bytes=s.gpu_total_bytes,
                         gpu=live.reg.gpu.name if live.reg.gpu.present else None)
                w.update(gpu_reading(s.gpu if s.gpu is not None else live.reg.gpu))
        return snap


def gpu_reading(g: GpuInfo) -> dict:
    """A worker's last NVML reading for /admin/workers and /metrics;
    ``gpu_present`` False is the explicit "no GPU" state (the rest then None)."""
    if not g.present:
        return {"gpu_present": False, "gpu_utilization_percent": None, "gpu_memory_used_bytes": None,
                "gpu_memory_total_bytes": None, "gpu_temperature_celsius": None, "gpu_power_watts": None}
    return {"gpu_present": True, "gpu_utilization_percent": g.utilization_percent,
            "gpu_memory_used_bytes": g.used_bytes, "gpu_memory_total_bytes": g.total_bytes,
            "gpu_temperature_celsius": g.temperature_c, "gpu_power_watts": g.power_w}
