"""Operator actions on a running router: drain a worker, add or remove a
model, reload keys and budgets.

The HTTP admin routes (router.ingress.routes) call these; the views
(router.observe.views) only read.  A model added or removed here is carried out by
the supervisor (deploy/runtime_models.py), which reads ``GET /admin/models``.
(Not ``router/operator.py``: that name would shadow the standard library's
``operator`` for a script run from this directory.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from shared.config import Config, ConfigError, ModelConfig, WorkerConfig, validate

# A reload's outcome: {"ok": True, ...} or {"ok": False, "error": ...}.
Reload = Callable[[], dict[str, Any]]
# Starting this router's drain (router/lifecycle/drain.py): its state, as a reload's.
DrainRouter = Callable[[], dict[str, Any]]


class ModelControl(Protocol):
    """What the actions need of the lifecycle (router.lifecycle.core.RouterCore)."""

    def served_config(self) -> Config: ...

    def runtime_worker_ids(self) -> set[str]: ...

    def has_model(self, name: str) -> bool: ...

    def model_state(self, name: str) -> str: ...

    def add_model(self, model: ModelConfig, workers: list[WorkerConfig]) -> str | None: ...

    def remove_model(self, name: str) -> str | None: ...


class WorkerControl(Protocol):
    """What the actions need of the worker link (router.fleet.worker_link.WorkerLink)."""

    def worker_ids(self) -> set[str]: ...

    def workers_of(self, model: str) -> list[str]: ...

    def drain(self, worker_id: str) -> bool: ...

    def undrain(self, worker_id: str) -> bool: ...


class _AddModel(msgspec.Struct, forbid_unknown_fields=True):
    model: dict[str, Any]
    workers: list[dict[str, Any]] = []


class RouterOperator:
    def __init__(
        self,
        core: ModelControl,
        link: WorkerControl,
        reload: Reload | None = None,
        drain_router: DrainRouter | None = None,
    ) -> None:
        self.core = core
        self.link = link
        self._reload = reload
        self._drain_router = drain_router

    def add_model(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """POST /admin/models {"model": {...}, "workers": [{...}]}: the config's own fields and checks."""
        try:
            req = msgspec.json.decode(body, type=_AddModel)
            model = msgspec.convert(req.model, ModelConfig)
            workers = [msgspec.convert(w, WorkerConfig) for w in req.workers]
            cfg = self.core.served_config()
            validate(msgspec.structs.replace(cfg, models=[*cfg.models, model], workers=[*cfg.workers, *workers]))
            if any(w.model != model.name for w in workers):
                raise ConfigError(f"workers must serve {model.name!r}")
            taken = self.link.worker_ids() | self.core.runtime_worker_ids()
            clash = [w.id for w in workers if w.id in taken]
            if clash:
                raise ConfigError(f"worker ids in use: {clash}")
        except (msgspec.DecodeError, ConfigError) as e:
            return 400, {"ok": False, "error": str(e)}
        err = self.core.add_model(model, workers)
        if err is not None:
            return 409, {"ok": False, "error": err}
        return 200, {"ok": True, "model": model.name, "state": self.core.model_state(model.name)}

    def remove_model(self, name: str) -> tuple[int, dict[str, Any]]:
        """POST /admin/models/{name}/remove: unloading; its workers drain (no new work)."""
        err = self.core.remove_model(name)
        if err is not None:
            return 404, {"ok": False, "error": err}
        for worker_id in self.link.workers_of(name):
            self.link.drain(worker_id)
        gone = not self.core.has_model(name)
        return 200, {"ok": True, "model": name, "state": "removed" if gone else "unloading"}

    def drain(self, worker_id: str, on: bool) -> bool:
        """POST /admin/workers/{id}/drain (``on``) or /undrain; False: no such worker."""
        return self.link.drain(worker_id) if on else self.link.undrain(worker_id)

    def reload(self) -> dict[str, Any]:
        """POST /admin/reload: API keys and budgets from the config file again."""
        if self._reload is None:
            return {"ok": False, "error": "reload is not wired in this router"}
        return self._reload()

    def drain_router(self) -> dict[str, Any]:
        """POST /admin/drain: this router stops taking work, finishes what it
        has (up to ``router.drain_timeout_s``) and exits 0."""
        if self._drain_router is None:
            return {"ok": False, "error": "drain is not wired in this router"}
        return self._drain_router()
