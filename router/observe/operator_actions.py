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

from shared.config import AdapterConfig, Config, ConfigError, ModelConfig, WorkerConfig, validate
from shared.errors import Code, error
from shared.protocol import ErrorInfo

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

    def add_adapter(self, adapter: AdapterConfig) -> str | None: ...

    def remove_adapter(self, name: str) -> str | None: ...

    def lora_models(self) -> list[str]: ...


class WorkerControl(Protocol):
    """What the actions need of the worker link (router.fleet.worker_link.WorkerLink)."""

    def worker_ids(self) -> set[str]: ...

    def workers_of(self, model: str) -> list[str]: ...

    def drain(self, worker_id: str) -> bool: ...

    def undrain(self, worker_id: str) -> bool: ...


class _AddModel(msgspec.Struct, forbid_unknown_fields=True):
    model: dict[str, Any]
    workers: list[dict[str, Any]] = []


class _AddAdapter(msgspec.Struct, forbid_unknown_fields=True):
    adapter: dict[str, Any]


class _LoadLora(msgspec.Struct):
    """vLLM's /v1/load_lora_adapter body (its other fields are ignored, as vLLM does)."""

    lora_name: str
    lora_path: str = ""
    base_model_name: str | None = None  # weir: which model, when several run LoRA


class _UnloadLora(msgspec.Struct):
    lora_name: str


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

    def add_adapter(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """POST /admin/adapters {"adapter": {"name", "base", "path"}}: the [[adapters]] fields and checks,
        the adapter's rank against its base's max_lora_rank included."""
        try:
            req = msgspec.json.decode(body, type=_AddAdapter)
            adapter = msgspec.convert(req.adapter, AdapterConfig)
        except msgspec.MsgspecError as e:
            return 400, {"ok": False, "error": str(e)}
        err = self.core.add_adapter(adapter)
        if err is not None:
            return 400, {"ok": False, "error": err}
        return 200, {"ok": True, "adapter": adapter.name, "base": adapter.base}

    def remove_adapter(self, name: str) -> tuple[int, dict[str, Any]]:
        """POST /admin/adapters/{name}/remove: new requests for it get 404, admitted ones finish."""
        err = self.core.remove_adapter(name)
        if err is not None:
            return 404, {"ok": False, "error": err}
        return 200, {"ok": True, "adapter": name, "state": "removed"}

    def load_lora_adapter(self, body: bytes) -> str | ErrorInfo:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: its success text, or the error.
        The base is ``base_model_name`` or else the one model whose workers run LoRA."""
        try:
            req = msgspec.json.decode(body, type=_LoadLora)
        except msgspec.MsgspecError as e:
            return error(Code.BAD_REQUEST, f"Invalid body: {e}")
        if not req.lora_name or not req.lora_path:
            return error(Code.BAD_REQUEST, "Both 'lora_name' and 'lora_path' must be provided.")
        base = req.base_model_name
        if base is None:
            lora = self.core.lora_models()
            if len(lora) != 1:
                return error(
                    Code.BAD_REQUEST,
                    f"Models running LoRA: {sorted(lora)}; name the adapter's base in 'base_model_name'.",
                    param="base_model_name",
                )
            base = lora[0]
        err = self.core.add_adapter(AdapterConfig(name=req.lora_name, base=base, path=req.lora_path))
        if err is not None:
            return error(Code.BAD_REQUEST, err, param="lora_name")
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload_lora_adapter(self, body: bytes) -> str | ErrorInfo:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}."""
        try:
            req = msgspec.json.decode(body, type=_UnloadLora)
        except msgspec.MsgspecError as e:
            return error(Code.BAD_REQUEST, f"Invalid body: {e}")
        if self.core.remove_adapter(req.lora_name) is not None:
            return error(
                Code.MODEL_NOT_FOUND, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name"
            )
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

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
