"""Models added and removed at run time, carried out by the supervisor.

The router is where the admin call lands (``POST /admin/models``, ``POST
/admin/models/{name}/remove``; ``weir models add|remove``): it starts or
stops serving the model.  This reconciler, run by ``weir up``'s supervisor
(``deploy.stack.Stack`` with ``supervise=True``) every ``RECONCILE_S``,
reads the router's ``GET /admin/models`` and makes the processes match:

* a model added at run time whose workers do not run yet: they are written
  into ``<run_dir>/runtime-models.toml`` (the config plus every model added
  at run time; a worker reads its settings from the config it is given) and
  started, supervised like the others;
* a model ``unloading``: SIGTERM to each of its workers -- each drains
  (finishes what it runs, up to ``router.drain_timeout_s``), says Goodbye and
  exits; they are not restarted, and once the last has gone the router
  forgets the model (requests for it are then 404);
* a router that restarted (it knows only its config file) is told again of
  the models added at run time that this supervisor still runs, and of the
  LoRA adapters added at run time that it served before (``GET
  /admin/adapters``, each pass; a restart: the router's ``/health`` uptime
  went back), after the models (an adapter's base may be one of them).
"""

from __future__ import annotations

import json
import signal
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

import tomli_w

from deploy.processes import Component
from shared.config import Config
from shared.keys import admin_headers

RECONCILE_S = 0.5
RUNTIME_CONFIG = "runtime-models.toml"
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _call(
    url: str, body: dict[str, Any] | None = None, timeout: float = 2.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """``headers``: the admin token's (shared.keys.admin_headers) where configured."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with _opener.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class Supervisor(Protocol):
    """What the reconciler needs of the stack that runs it (deploy.stack.Stack)."""

    cfg: Config
    cfg_path: Path
    run_dir: Path
    router_url: str
    worker_ids: list[str]  # the workers it runs and waits for
    components: dict[str, Component]  # by name: "worker:<id>", ...

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component: ...


class ModelReconciler:
    def __init__(self, stack: Supervisor) -> None:
        self.stack = stack
        self.added: dict[str, dict[str, Any]] = {}  # model name -> {"config": ..., "workers": [...]}, started here
        self.stopping: set[str] = set()  # worker ids told to drain and exit
        self.runtime_cfg = stack.run_dir / RUNTIME_CONFIG
        self.admin = admin_headers(stack.cfg)  # (loopback needs none; sent where configured)
        self.adapters: dict[str, dict[str, Any]] = {}  # adapters added at run time, as last listed: name -> config
        self.uptime_s: float | None = None  # the router's at the last pass that reached it

    def step(self) -> list[str]:
        """One pass; what it did, in words.  The router unreachable: nothing."""
        stack = self.stack
        try:
            _, models = _call(stack.router_url + "/admin/models", headers=self.admin)
        except (OSError, ValueError):
            return []
        said: list[str] = []
        listed = {m["name"]: m for m in models}
        for name, m in listed.items():
            if m["state"] == "unloading":
                said += self._stop_workers(name, m)
            elif m["runtime"] and name not in self.added:
                said += self._start_workers(name, m)
        for name, spec in list(self.added.items()):
            if name in listed:
                continue
            if all(w["id"] in self.stopping for w in spec["workers"]):  # removed: its workers went
                del self.added[name]
                self._forget_components(spec["workers"])
                self._write_config()
                said.append(f"model {name} removed")
            else:  # the router restarted and knows only its config file
                code, out = _call(
                    stack.router_url + "/admin/models",
                    {"model": spec["config"], "workers": spec["workers"]},
                    headers=self.admin,
                )
                said.append(f"router told again of model {name} ({code})")
        return said + self._adapters()

    def _adapters(self) -> list[str]:
        """Remember the adapters added at run time; after a router restart, add them again."""
        stack = self.stack
        try:
            _, health = _call(stack.router_url + "/health")
            _, listed = _call(stack.router_url + "/admin/adapters", headers=self.admin)
        except (OSError, ValueError):
            return []
        if not isinstance(listed, list) or not isinstance(health, dict):
            return []
        uptime = float(health.get("uptime_s") or 0.0)
        restarted = self.uptime_s is not None and uptime < self.uptime_s
        self.uptime_s = uptime
        in_config = {a.name for a in stack.cfg.adapters}
        served = {a["name"] for a in listed}
        said: list[str] = []
        if restarted:
            for name, spec in self.adapters.items():
                if name not in served:
                    code, _ = _call(stack.router_url + "/admin/adapters", {"adapter": spec}, headers=self.admin)
                    said.append(f"router told again of adapter {name} ({code})")
            return said
        self.adapters = {  # (one removed through the admin API is no longer listed: forgotten)
            a["name"]: {"name": a["name"], "base": a["base"], "path": a["path"]}
            for a in listed
            if a["name"] not in in_config and a.get("path")
        }
        return said

    def _start_workers(self, name: str, m: dict[str, Any]) -> list[str]:
        stack = self.stack
        self.added[name] = {"config": m["config"], "workers": m["workers"]}
        self._write_config()
        said = [f"model {name} added: starting {len(m['workers'])} workers"]
        for w in m["workers"]:
            wid = w["id"]
            stack.worker_ids.append(wid)
            stack.spawn(
                f"worker:{wid}",
                [sys.executable, "-m", "engine_worker", "--config", str(self.runtime_cfg), "--worker-id", wid],
                w.get("env") or {},
            )
        return said

    def _stop_workers(self, name: str, m: dict[str, Any]) -> list[str]:
        stack = self.stack
        ids = [w.id for w in stack.cfg.workers if w.model == name]
        ids += [w["id"] for w in self.added.get(name, {}).get("workers", [])]
        said: list[str] = []
        for wid in ids:
            comp = stack.components.get(f"worker:{wid}")
            if wid in self.stopping or comp is None:
                continue
            self.stopping.add(wid)
            comp.stopping = True  # not restarted when it exits
            comp.signal_group(signal.SIGTERM)  # drains: finishes what it runs, then Goodbye
            said.append(f"model {name} unloading: worker {wid} draining")
        if name not in self.added and all(w in self.stopping for w in ids):
            self.added[name] = {"config": m["config"], "workers": [{"id": w} for w in ids]}  # (config-file model)
        return said

    def _forget_components(self, workers: list[dict[str, Any]]) -> None:
        stack = self.stack
        for w in workers:
            wid = w["id"]
            if wid in stack.worker_ids:
                stack.worker_ids.remove(wid)

    def _write_config(self) -> None:
        """The config file plus every model added here (the workers' --config)."""
        with open(self.stack.cfg_path, "rb") as f:
            raw = tomllib.load(f)
        raw.setdefault("base_dir", str(self.stack.cfg_path.parent))  # relative paths as in the original
        names = {m["name"] for m in raw.get("models", [])}
        for spec in self.added.values():
            if spec["config"]["name"] not in names:
                raw.setdefault("models", []).append(_toml_ready(spec["config"]))
                raw.setdefault("workers", []).extend(_toml_ready(w) for w in spec["workers"])
        self.runtime_cfg.write_text(tomli_w.dumps(raw))


def _toml_ready(d: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: leave unset fields out (their defaults apply)."""
    return {k: _toml_ready(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
