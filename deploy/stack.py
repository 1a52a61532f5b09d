"""Start and stop the whole weir stack: router, engine workers, Envoy.

Each component is a child process leading its own process group in the
launcher's session (so a terminal's Ctrl-C reaches only the launcher, stopping
a component can signal everything it spawned -- vLLM starts an EngineCore
process and more -- and the scheduler sees one session: deploy/processes.py).
Output goes to ``<run_dir>/<component>.log`` (appended across restarts).
``weir up`` and the tests both use this.

Supervision (``supervise=True``, as ``weir up`` runs it): a component that
exits without being asked -- crash, SIGKILL, a drained worker or router -- is started
again after a back-off that doubles from ``RESTART_BACKOFF_S`` to
``RESTART_BACKOFF_MAX_S``; more than ``CRASH_LOOP_RESTARTS`` restarts within
``CRASH_LOOP_WINDOW_S`` is a crash loop, and that component is left down
(``Stack.failed``).  Restarts are counted in ``Stack.restarts``.

    with Stack("deploy/weir.toml") as stack:
        print(stack.envoy_url)
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from deploy import envoy_config
from deploy.processes import Component, group_members
from deploy.processes import StackError as StackError  # raised from here: callers import it with Stack
from deploy.processes import StackInterrupted as StackInterrupted
from deploy.runtime_models import RECONCILE_S, ModelReconciler
from shared.config import DEFAULT_CONFIG, Config, client_host, load, split_hostport, zmq_connect_addr

ROUTER_READY_S = 30.0
ENVOY_READY_S = 15.0
WORKER_READY_S = {"sim": 30.0, "vllm": 300.0}  # vLLM takes ~16-25 s on an idle CPU
STOP_GRACE_S = 10.0
ENVOY_DRAIN_S = 1  # Envoy's listener drain time on a graceful stop (its default, 600 s, would hold a restart)
POLL_S = 0.1
RESTART_BACKOFF_S = 0.2  # a router back in ~1 s: workers re-register within a heartbeat
RESTART_BACKOFF_MAX_S = 30.0
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 60.0


def _http_url(addr: str, scheme: str = "http") -> str:
    host, port = split_hostport(addr)
    host = client_host(host)
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _answers_ok(url: str) -> Callable[[], bool]:
    """A readiness check: ``url`` answers 200."""
    return lambda: _get(url)[0] == 200


def _get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    """GET without proxies (loopback; a proxy env var must not interfere)."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if url.startswith("https:"):  # our own listener on loopback: readiness, not identity
        handlers.append(urllib.request.HTTPSHandler(context=ssl._create_unverified_context()))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Stack:
    """Router + workers + Envoy as child processes; a context manager.

    Attributes once started: ``envoy_url``, ``router_url``, ``zmq_frontend``
    (a connect address), ``admin_url`` (Envoy admin), ``metrics_url``,
    ``cfg``, ``cfg_path``, ``run_dir``, ``components`` (name -> Component;
    names are ``router``, ``worker:<id>``, ``envoy``).  Several routers
    (``[[routers]]``): ``router``, ``router:1``, ``router:2``... in config
    order, with ``router_urls`` / ``zmq_frontends`` (index i: the i-th);
    ``router_url`` and ``zmq_frontend`` are the first's.
    """

    def __init__(
        self,
        cfg_path: str | os.PathLike[str] | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        workers: list[str] | None = None,
        progress: Callable[[str], None] | None = None,
        worker_ready_s: float | None = None,
        envoy_log_level: str = "warning",
        supervise: bool = False,
    ):
        self.cfg_path = Path(cfg_path or os.environ.get("WEIR_CONFIG") or DEFAULT_CONFIG).resolve()
        self.cfg: Config = load(self.cfg_path)
        envoy_config.check(self.cfg)  # config errors before any process or directory
        # Absolute: children run with the run dir as their working directory.
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="weir-run-")).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.worker_ids = workers if workers is not None else [w.id for w in self.cfg.workers]
        self.progress = progress or (lambda msg: None)
        self.worker_ready_s = worker_ready_s
        self.envoy_log_level = envoy_log_level
        self.envoy_url = _http_url(self.cfg.envoy.listen, "https" if self.cfg.envoy.tls_cert_file else "http")
        self.admin_url = _http_url(self.cfg.envoy.admin)
        endpoints = self.cfg.router_endpoints()
        self.router_names = ["router"] + [f"router:{i}" for i in range(1, len(endpoints))]
        self.router_urls = [_http_url(ep.http) for ep in endpoints]
        self.zmq_frontends = [zmq_connect_addr(ep.frontend) for ep in endpoints]
        self.router_url = self.router_urls[0]
        self.metrics_url = self.router_url + "/metrics"
        self.zmq_frontend = self.zmq_frontends[0]
        self.envoy_yaml = self.run_dir / "envoy.yaml"
        self.components: dict[str, Component] = {}
        self._started: list[Component] = []
        self.supervising = supervise
        self.restarts: dict[str, int] = {}  # component name -> restarts so far
        self.failed: set[str] = set()  # left down after a crash loop
        self._deaths: dict[str, list[float]] = {}  # restart times, for the crash-loop window
        self._down_since: dict[str, float] = {}
        self._lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        # Set (to the signal's name) by a launcher's signal handler: every wait
        # below ends at its next poll with StackInterrupted.  A flag, not only the
        # handler's exception: an exception raised while the main thread runs a
        # finalizer is printed and dropped, and the stack would come up anyway.
        self.stop_requested: str | None = None

    # -------------------------------------------------------------- start

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "WEIR_CONFIG": str(self.cfg_path)})
        env.update(extra or {})
        return env

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        """Start a component (``<run_dir>/<name>.log``); supervised like the others."""
        log = self.run_dir / (name.replace(":", "-") + ".log")
        comp = Component(name, argv, log, self._env(env), cwd=str(self.run_dir))
        self.components[name] = comp
        self._started.append(comp)
        comp.start()
        self.progress(f"started {name} (pid {comp.pid}), log {log}")
        return comp

    def start(self) -> Stack:
        """Start everything and wait until all of it is ready; on any failure
        (or Ctrl-C meanwhile) stop what was started and raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        if self.supervising:
            self._supervisor = threading.Thread(target=self._supervise_loop, name="weir-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _start(self) -> None:
        t0 = time.monotonic()
        yaml_text = envoy_config.render(self.cfg)
        envoy_config.validate(yaml_text)
        self.envoy_yaml.write_text(yaml_text)

        py = sys.executable
        cfg = str(self.cfg_path)
        routers = [
            self.spawn(name, [py, "-m", "router", "--config", cfg, "--index", str(i)])
            for i, name in enumerate(self.router_names)
        ]
        for router, url in zip(routers, self.router_urls, strict=True):
            self._wait(router, ROUTER_READY_S, "not healthy at " + url + "/health", _answers_ok(url + "/health"))
            self.progress(f"{router.name} ready ({time.monotonic() - t0:.1f} s)")

        workers = []
        for wid in self.worker_ids:
            w = self.cfg.worker(wid)
            argv = [py, "-m", "engine_worker", "--config", cfg, "--worker-id", wid]
            workers.append(self.spawn(f"worker:{wid}", argv, w.env))

        envoy = self.spawn("envoy", self.envoy_argv(self.envoy_yaml))
        self._wait(envoy, ENVOY_READY_S, "not live (admin /ready)", self._envoy_live)
        self._wait_for_workers(workers, t0, also_alive=[*routers, envoy])
        # Envoy's health check asks the router's readiness: it passes once a worker is in.
        self._wait(
            envoy,
            ENVOY_READY_S,
            "not ready (/health through Envoy)",
            lambda: _get(self.envoy_url + "/health")[0] == 200,
        )
        if len(self.router_urls) > 1:  # and each router has passed Envoy's health check
            self._wait(
                envoy,
                ENVOY_READY_S,
                "not sending to every router (admin /clusters)",
                lambda: self.envoy_healthy_routers() == len(self.router_urls),
            )
        self.progress(f"envoy ready ({time.monotonic() - t0:.1f} s)")

    def envoy_argv(self, yaml_path: Path) -> list[str]:
        return [
            envoy_config.envoy_binary(),
            "-c",
            str(yaml_path),
            "--disable-hot-restart",
            "--concurrency",
            str(self.cfg.envoy.concurrency),
            "-l",
            self.envoy_log_level,
            # A graceful stop (deploy/restart.py: admin drain_listeners?graceful)
            # tells every client connection to close at once and stops accepting
            # after this long; in-flight streams then run to their end.
            "--drain-time-s",
            str(ENVOY_DRAIN_S),
            "--drain-strategy",
            "immediate",
        ]

    def _wait_for_workers(self, workers: list[Component], t0: float, also_alive: list[Component]) -> None:
        """Until each worker's id shows up in every router's /admin/workers."""
        pending = {c.name.partition(":")[2]: c for c in workers}
        deadlines = {wid: time.monotonic() + self._worker_timeout(wid) for wid in pending}
        while pending:
            registered = self._registered_workers()
            for wid in [w for w in pending if w in registered]:
                self.progress(f"worker {wid} registered ({time.monotonic() - t0:.1f} s)")
                del pending[wid]
            for comp in also_alive:
                if comp.exited() is not None:
                    raise comp.failure("exited while the workers were starting")
            for wid, comp in pending.items():
                if comp.exited() is not None:
                    raise comp.failure("exited before registering with the router")
                if time.monotonic() > deadlines[wid]:
                    raise comp.failure(f"did not register with the router in {self._worker_timeout(wid):.0f} s")
            if pending:
                self.poll(POLL_S * 2)

    def _worker_timeout(self, wid: str) -> float:
        if self.worker_ready_s is not None:
            return self.worker_ready_s
        engine = self.cfg.model(self.cfg.worker(wid).model).engine
        return WORKER_READY_S[engine]

    def _wait(self, comp: Component, timeout_s: float, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if comp.exited() is not None:
                raise comp.failure("exited while starting")
            try:
                if ready():
                    return
            except (OSError, ValueError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise comp.failure(f"{what} after {timeout_s:.0f} s")
            self.poll(POLL_S)

    def poll(self, seconds: float) -> None:
        """Sleep between two checks of a wait; end the wait if a stop was asked for."""
        time.sleep(seconds)
        if self.stop_requested:
            raise StackInterrupted(self.stop_requested)

    def _envoy_live(self) -> bool:
        status, body = _get(self.admin_url + "/ready")
        return status == 200 and body.strip() == b"LIVE"

    def envoy_healthy_routers(self) -> int:
        """Routers Envoy's health check passes (its admin /clusters)."""
        status, body = _get(self.admin_url + "/clusters")
        return sum(
            1
            for line in body.decode().splitlines()
            if line.startswith(f"{envoy_config.ROUTER_CLUSTER}::") and line.endswith("::health_flags::healthy")
        )

    def _registered_workers(self) -> set[str]:
        """Workers registered with every router."""
        seen = [self.registered_at(url) for url in self.router_urls]
        return set.intersection(*seen)

    @staticmethod
    def registered_at(router_url: str) -> set[str]:
        try:
            status, body = _get(router_url + "/admin/workers")
            return {w["id"] for w in json.loads(body)} if status == 200 else set()
        except (OSError, ValueError, KeyError, TypeError):
            return set()  # busy or restarting: ask again

    # -------------------------------------------------------------- run / stop

    def dead(self) -> list[Component]:
        """Components that exited without being asked to."""
        return [c for c in self._started if not c.stopping and c.exited() is not None]

    def rolling_restart(self, timeout_s: float = 120.0) -> list[str]:
        """Restart every worker, one at a time, losing no request: SIGTERM
        drains it (its requests finish, or move at the drain timeout), the
        supervisor starts it again, and the next goes once it has registered."""
        said = []
        for wid in self.worker_ids:
            comp = self.components[f"worker:{wid}"]
            old = comp.pid
            comp.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not (comp.pid != old and wid in self._registered_workers()):
                self.poll(POLL_S)
            ok = comp.pid != old and wid in self._registered_workers()
            said.append(f"worker {wid} {'restarted' if ok else 'NOT back'} (pid {old} -> {comp.pid})")
            self.progress(said[-1])
        return said

    def _supervise_loop(self) -> None:
        models = ModelReconciler(self)  # models added / removed at run time (router's /admin/models)
        next_reconcile = 0.0
        while self.supervising:
            for msg in self.supervise():
                self.progress(msg)
            if time.monotonic() >= next_reconcile:
                next_reconcile = time.monotonic() + RECONCILE_S
                with self._lock:
                    if self.supervising:
                        for msg in models.step():
                            self.progress(msg)
            time.sleep(POLL_S)

    def supervise(self) -> list[str]:
        """One pass: restart what died (after its back-off); what it did, in words."""
        said: list[str] = []
        now = time.monotonic()
        with self._lock:
            if not self.supervising:
                return said
            for comp in self.dead():
                name = comp.name
                if name in self.failed:
                    continue
                if name not in self._down_since:
                    self._down_since[name] = now
                    said.append(f"{name} exited with status {comp.exited()}")
                recent = [t for t in self._deaths.get(name, []) if now - t < CRASH_LOOP_WINDOW_S]
                if len(recent) >= CRASH_LOOP_RESTARTS:
                    self.failed.add(name)
                    said.append(
                        f"{name}: {len(recent)} restarts in {CRASH_LOOP_WINDOW_S:.0f} s, a crash "
                        f"loop: left down; log {comp.log_path}"
                    )
                    continue
                backoff = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** len(recent))
                if now - self._down_since[name] < backoff:
                    continue
                del self._down_since[name]
                self._deaths[name] = recent + [now]
                self.restarts[name] = self.restarts.get(name, 0) + 1
                comp.start()
                said.append(f"restarted {name} (pid {comp.pid}; restart {self.restarts[name]})")
        return said

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every process group (Envoy first), wait up to ``grace_s``,
        then SIGKILL each whole group, which also sweeps any grandchild left
        behind.  Idempotent."""
        with self._lock:
            self.supervising = False  # nothing is restarted from here on
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
        comps = list(reversed(self._started))
        for c in comps:
            c.stopping = True
            # A worker or router drains on SIGTERM (finishes its requests);
            # with the whole stack going there is nobody to finish them for:
            # SIGINT (a router ends what it has with error events).
            c.signal_group(signal.SIGINT if c.name.startswith(("worker:", "router")) else signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in comps:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.progress(f"{c.name} ignored SIGTERM for {grace_s:.0f} s: SIGKILL")
        for c in comps:
            c.signal_group(signal.SIGKILL)
            if c.proc is not None:
                c.proc.wait()
        # Grandchildren are reaped by init; give it a moment so callers can
        # rely on "no process left in any of our groups" when stop() returns.
        deadline = time.monotonic() + 5.0
        while any(c.pid and group_members(c.pid) for c in comps) and time.monotonic() < deadline:
            time.sleep(0.05)

    def process_groups(self) -> list[int]:
        return [c.pid for c in self._started if c.pid]

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
