"""Read-only views of the router for operators: health, models, admin, metrics.

Built from the state's owners -- the lifecycle's job table, the policy's
ledger and queues, the worker link's engine stats -- at the moment they
are asked for, so nothing is mirrored on the hot path.
"""

from __future__ import annotations

from typing import Callable, Optional

import msgspec

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.core import RouterCore
from router.ops_metrics import OpsCollector
from router.worker_link import WorkerLink
from shared.config import ConfigError, ModelConfig, WorkerConfig, validate
from shared.protocol import GpuInfo


class _AddModel(msgspec.Struct, forbid_unknown_fields=True):
    model: dict
    workers: list[dict] = []


class RouterViews:
    def __init__(self, core: RouterCore, link: WorkerLink, reload: Optional[Callable[[], dict]] = None) -> None:
        self.core = core
        self.link = link
        self._reload = reload
        core.metrics.add_state_collector(self.state)
        core.metrics.registry.register(OpsCollector(core, link))

    def models(self) -> list[tuple[str, int, int, str]]:
        """(name, max_model_len, workers ready, state) per model served: state
        loading (no worker ready yet) / ready / unloading (router/core.py)."""
        ready = self.ready_workers()
        return [(m.name, m.max_model_len, ready[m.name], self.core.model_state(m.name)) for m in self.core.cfg.models]

    # -- models at run time: what the supervisor (deploy/runtime_models.py) carries out

    def admin_models(self) -> list[dict]:
        core = self.core
        ready = self.ready_workers()
        return [{"name": m.name, "state": core.model_state(m.name), "ready_workers": ready[m.name],
                 "runtime": m.name in core.runtime_workers, "config": msgspec.to_builtins(m),
                 "workers": [msgspec.to_builtins(w) for w in core.runtime_workers.get(m.name, [])]}
                for m in core.cfg.models]

    def add_model(self, body: bytes) -> tuple[int, dict]:
        """POST /admin/models {"model": {...}, "workers": [{...}]}: the config's own fields and checks."""
        try:
            req = msgspec.json.decode(body, type=_AddModel)
            model = msgspec.convert(req.model, ModelConfig)
            workers = [msgspec.convert(w, WorkerConfig) for w in req.workers]
            cfg = self.core.cfg
            validate(msgspec.structs.replace(cfg, models=[*cfg.models, model], workers=[*cfg.workers, *workers]))
            if any(w.model != model.name for w in workers):
                raise ConfigError(f"workers must serve {model.name!r}")
            taken = set(self.link.workers) | {w.id for ws in self.core.runtime_workers.values() for w in ws}
            clash = [w.id for w in workers if w.id in taken]
            if clash:
                raise ConfigError(f"worker ids in use: {clash}")
        except (msgspec.DecodeError, ConfigError) as e:
            return 400, {"ok": False, "error": str(e)}
        err = self.core.add_model(model, workers)
        if err is not None:
            return 409, {"ok": False, "error": err}
        return 200, {"ok": True, "model": model.name, "state": self.core.model_state(model.name)}

    def remove_model(self, name: str) -> tuple[int, dict]:
        """POST /admin/models/{name}/remove: unloading; its workers drain (no new work)."""
        err = self.core.remove_model(name)
        if err is not None:
            return 404, {"ok": False, "error": err}
        for w in list(self.link.workers.values()):
            if w.reg.model == name:
                self.link.drain(w.reg.worker_id)
        gone = name not in self.core.models_by_name
        return 200, {"ok": True, "model": name, "state": "removed" if gone else "unloading"}

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

    def admin_worker(self, worker_id: str) -> Optional[dict]:
        """One worker's state in O(1) (``admin_workers`` is O(workers)): what each
        worker pod's probes ask every 10 s (deploy/k8s_probe.py)."""
        live = self.link.workers.get(worker_id)
        if live is None:
            return None
        placed = self.core.policy.workers.get(worker_id)
        out = {"id": worker_id, "model": live.reg.model, "state": "ready" if live.drain_deadline is None else "draining",
               "running": len(placed.running) if placed is not None else 0}
        if live.drain_deadline is not None:
            out["drain_left_s"] = round(max(0.0, live.drain_deadline - self.link.clock()), 3)
        return out

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
