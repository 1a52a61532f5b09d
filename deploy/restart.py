"""Restart a running stack's components one by one, losing no request
(``weir restart [router|workers|envoy|all]``, carried out by ``weir up``).

  * a router: SIGTERM drains it (router/lifecycle/drain.py: no new work, Envoy retries
    what it refuses on another router, admitted requests finish); it exits 0,
    the supervisor starts it again, and the next one goes once it is ready
    and Envoy's health check sends to every router again;
  * the workers: ``Stack.rolling_restart`` (each drains, comes back, registers);
  * Envoy: a stand-in Envoy starts on the same listener port (SO_REUSEPORT:
    both accept) with its own admin port; the old one drains gracefully
    (admin ``drain_listeners?graceful``: every connection told to close,
    no new ones after ``ENVOY_DRAIN_S``), its in-flight streams run to
    their end, it stops; Envoy starts again on its own config and the
    stand-in drains the same way.  Two hand-overs keep the admin address
    (``weir stats``, the supervisor) where the config says.

With one router, its restart leaves a gap (requests then are served late
through Envoy's retries, or answered 503 + Retry-After); with two or more,
none.  The request/answer between ``weir restart`` and ``weir up`` goes
through files in the run directory and SIGUSR1 (``ask``/``serve_request``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from deploy import envoy_config
from deploy.processes import Component

POLL_S = 0.05
TARGETS = ("router", "workers", "envoy")
READY_MARGIN_S = 60.0  # beyond a router's drain timeout: its exit, restart and the workers' registration


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _post(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, method="POST"), timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


def _get_json(url: str) -> Any:
    from deploy.stack import _get

    status, body = _get(url, timeout=2.0)
    return json.loads(body) if status == 200 else None


def _wait(pred: Callable[[], bool], timeout_s: float, poll: Callable[[float], None] = time.sleep) -> bool:
    """Until ``pred()`` or ``timeout_s``; ``poll`` sleeps between checks (a
    Stack's ``poll`` also ends the wait when a stop is asked for)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except (OSError, ValueError, urllib.error.URLError):
            pass  # not answering yet
        poll(POLL_S)
    return False


# ------------------------------------------------------------------ the steps (on a Stack)


def restart_routers(stack: Any, say: Callable[[str], None]) -> bool:
    """Each router in turn: drain (SIGTERM), exit 0, restarted, ready, back in Envoy."""
    from deploy.stack import _get

    def restarted(comp: Component, url: str, old: int | None) -> Callable[[], bool]:
        return lambda: comp.pid != old and _get(url + "/health/ready")[0] == 200

    timeout = stack.cfg.router.drain_timeout_s + READY_MARGIN_S
    for name, url in zip(stack.router_names, stack.router_urls, strict=True):
        comp: Component = stack.components[name]
        old = comp.pid
        t0 = time.monotonic()
        comp.signal_group(signal.SIGTERM)
        back = _wait(restarted(comp, url, old), timeout, stack.poll)
        back = back and _wait(lambda: stack.envoy_healthy_routers() == len(stack.router_urls), timeout, stack.poll)
        say(
            f"{name} {'drained and back' if back else 'NOT back'} in {time.monotonic() - t0:.1f} s "
            f"(pid {old} -> {comp.pid})"
        )
        if not back:
            return False
    return True


def restart_workers(stack: Any, say: Callable[[str], None]) -> bool:
    said = stack.rolling_restart(timeout_s=stack.cfg.router.drain_timeout_s + READY_MARGIN_S)
    for line in said:
        say(line)
    return all("NOT back" not in line for line in said)


def _envoy_ready(admin_url: str, routers: int) -> bool:
    from deploy.stack import _get

    status, body = _get(admin_url + "/clusters")
    healthy = sum(
        1
        for line in body.decode().splitlines()
        if line.startswith(f"{envoy_config.ROUTER_CLUSTER}::") and line.endswith("::health_flags::healthy")
    )
    return status == 200 and _get(admin_url + "/ready")[1].strip() == b"LIVE" and healthy == routers


def _active_requests(admin_url: str) -> int:
    stats = _get_json(admin_url + "/stats?format=json&filter=^http.ingress_http.downstream_rq_active$")
    return int(stats["stats"][0]["value"]) if stats and stats.get("stats") else 0


def drain_envoy(comp: Component, admin_url: str, timeout_s: float, poll: Callable[[float], None] = time.sleep) -> bool:
    """Stop an Envoy gracefully: listeners drained (clients told to close, no
    new connection after its drain time), in-flight requests to their end
    (up to ``timeout_s``), then SIGTERM.  True if nothing was cut."""
    from deploy.stack import ENVOY_DRAIN_S

    _post(admin_url + "/drain_listeners?graceful")
    time.sleep(ENVOY_DRAIN_S)
    clean = _wait(lambda: _active_requests(admin_url) == 0, timeout_s, poll)
    comp.signal_group(signal.SIGTERM)
    if comp.proc is not None:
        comp.proc.wait(timeout=10)
    return clean


def restart_envoy(stack: Any, say: Callable[[str], None]) -> bool:
    """Two hand-overs on the shared listener port: old -> stand-in -> new."""
    t0 = time.monotonic()
    timeout = stack.cfg.router.drain_timeout_s + READY_MARGIN_S
    routers = len(stack.router_urls)
    d = yaml.safe_load(stack.envoy_yaml.read_text())
    host = d["admin"]["address"]["socket_address"]["address"]
    port = _free_port(host)
    d["admin"]["address"]["socket_address"]["port_value"] = port
    standin_yaml = stack.run_dir / "envoy-standin.yaml"
    standin_yaml.write_text(yaml.safe_dump(d, sort_keys=False))
    standin_admin = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    standin = Component(
        "envoy-standin",
        stack.envoy_argv(standin_yaml),
        stack.run_dir / "envoy-standin.log",
        stack._env(),
        cwd=str(stack.run_dir),
    )
    standin.start()
    try:
        if not _wait(lambda: _envoy_ready(standin_admin, routers), timeout, stack.poll):
            say(f"envoy stand-in not ready: {standin.tail()}")
            return False
        envoy: Component = stack.components["envoy"]
        with stack._lock:
            envoy.stopping = True  # the supervisor leaves it to us
        clean = drain_envoy(envoy, stack.admin_url, timeout, stack.poll)
        envoy.start()
        with stack._lock:
            envoy.stopping = False
        if not _wait(lambda: _envoy_ready(stack.admin_url, routers), timeout, stack.poll):
            say(f"envoy not ready again: {envoy.tail()}")
            return False
        clean = drain_envoy(standin, standin_admin, timeout, stack.poll) and clean
    finally:
        standin.signal_group(signal.SIGKILL)  # (a no-op once it stopped)
        if standin.proc is not None:
            standin.proc.wait()
    say(f"envoy restarted in {time.monotonic() - t0:.1f} s (pid {envoy.pid}){'' if clean else ': some streams cut'}")
    return clean


STEPS = {"router": restart_routers, "workers": restart_workers, "envoy": restart_envoy}


def restart(stack: Any, what: str, say: Callable[[str], None]) -> bool:
    """``what``: router, workers, envoy or all (in that order)."""
    for target in TARGETS if what == "all" else (what,):
        say(f"restarting {target}")
        if not STEPS[target](stack, say):
            say(f"restart of {target} failed: stopping here")
            return False
    return True


# ------------------------------------------------------------------ weir restart <-> weir up


def state_file(cfg_path: Path) -> Path:
    """Where ``weir up`` says where it runs (found again from its config path)."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"weir-{os.getuid()}"
    return base / ("up-" + hashlib.sha256(str(cfg_path.resolve()).encode()).hexdigest()[:16] + ".json")


def announce(cfg_path: Path, run_dir: Path) -> Path:
    """``weir up``: record its pid and run dir for ``weir restart`` (in the
    run dir, and where its config path finds it)."""
    path = state_file(cfg_path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    text = json.dumps({"pid": os.getpid(), "run_dir": str(run_dir), "config": str(cfg_path)})
    for p in (run_dir / "weir-up.json", path):
        tmp = p.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(p)
    return path


def forget(cfg_path: Path) -> None:
    """``weir up`` stopping: no ``weir restart`` may signal its pid (it could be reused)."""
    state_file(cfg_path).unlink(missing_ok=True)


def serve_request(stack: Any, say: Callable[[str], None]) -> None:
    """``weir up`` on SIGUSR1: carry out the request in its run dir, its
    progress appended to the request's answer file (last line: DONE ok|failed)."""
    req_path = stack.run_dir / "restart-request.json"
    try:
        req = json.loads(req_path.read_text())
        req_path.unlink()
    except (OSError, ValueError):
        return
    answer = stack.run_dir / f"restart-{req['id']}.log"

    def tell(msg: str) -> None:
        say(msg)
        with open(answer, "a") as f:
            f.write(msg + "\n")

    ok = False
    try:
        ok = restart(stack, req["what"], tell)
    finally:  # (also when a stop interrupts it: the asker is told)
        tell(f"DONE {'ok' if ok else 'failed'}")


def ask(cfg_path: Path, what: str, run_dir: Path | None, timeout_s: float, out: Callable[[str], None]) -> int:
    """``weir restart``: ask the ``weir up`` of this config (or run dir), follow it; 0 if every step worked."""
    if run_dir is None:
        try:
            state = json.loads(state_file(cfg_path).read_text())
        except (OSError, ValueError):
            out(f"weir restart: no `weir up` running for {cfg_path} (or pass --run-dir)")
            return 2
        pid, run_dir = int(state["pid"]), Path(state["run_dir"])
    else:
        try:
            pid = int(json.loads((run_dir / "weir-up.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            out(f"weir restart: no `weir up` state in {run_dir}")
            return 2
    rid = uuid.uuid4().hex[:12]
    tmp = run_dir / "restart-request.tmp"
    tmp.write_text(json.dumps({"id": rid, "what": what}))
    tmp.replace(run_dir / "restart-request.json")
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        out(f"weir restart: `weir up` (pid {pid}) is not running")
        return 2
    answer, seen = run_dir / f"restart-{rid}.log", 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = answer.read_text() if answer.exists() else ""
        lines = text[: text.rfind("\n") + 1].splitlines()  # whole lines only
        for line in lines[seen:]:
            out(line)
            if line.startswith("DONE"):
                return 0 if line == "DONE ok" else 1
        seen = len(lines)
        time.sleep(0.2)
    out(f"weir restart: no answer in {timeout_s:.0f} s")
    return 1
