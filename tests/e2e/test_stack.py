"""`weir up` and deploy.stack: start, serve, stop with no process left behind;
Envoy's 503 when the router is gone; start-up failures that say what failed."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from stackutil import SIM_MODEL, alive, sim_worker, start_stack, write_config

from deploy.stack import Stack, StackError, StackInterrupted, group_members
from shared.config import load


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                out.append(int(entry))
    return out


class _Lines:
    """Reads a child's stdout on a thread so the test can wait with a timeout."""

    def __init__(self, stream):
        self.q: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.seen):
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in output:\n{''.join(self.seen)}")
            self.seen.append(line)


def _weir_up(cfg_path: Path, run_dir: Path, blocked: frozenset[signal.Signals] = frozenset()) -> subprocess.Popen:
    """``weir up`` as a user runs it (the installed console script), output
    piped; started with ``blocked`` in its signal mask, as a launcher that
    blocks them leaves it."""
    weir = Path(sys.executable).parent / "weir"
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        return subprocess.Popen(
            [str(weir), "up", "--config", str(cfg_path), "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _blocked_signals(pid: int) -> int:
    """The process's blocked-signal mask (/proc/PID/status SigBlk)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk for {pid}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_weir_up_serves_then_stops_every_child(tmp_path, sig):
    cfg_path = write_config(tmp_path, workers=[sim_worker("sim-0"), sim_worker("sim-1")])
    cfg = load(cfg_path)
    proc = _weir_up(cfg_path, tmp_path / "run")
    try:
        out = _Lines(proc.stdout)
        out.wait_for("Ctrl-C (or SIGTERM) stops everything.", 60)
        text = "".join(out.seen)
        envoy_url = f"http://{cfg.envoy.listen}"
        assert f"OpenAI API (via Envoy):  {envoy_url}/v1" in text
        assert cfg.router.frontend in text and f"curl -N {envoy_url}/v1/chat/completions" in text

        r = requests.post(
            envoy_url + "/v1/completions", timeout=30, json={"model": SIM_MODEL, "prompt": "hello", "max_tokens": 3}
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3

        children = _children_of(proc.pid)
        assert len(children) == 4  # router, two workers, envoy
        for pid in children:
            assert os.getpgid(pid) == pid  # each leads its own process group

        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        out.wait_for("[weir] stopped", 5)
        assert not alive(set(children))
        assert not any(group_members(pgid) for pgid in children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_envoy_answers_503_json_with_retry_after_when_router_is_down(tmp_path):
    cfg_path = write_config(tmp_path)
    with start_stack(cfg_path, tmp_path / "run") as stack:
        url = stack.envoy_url + "/v1/completions"
        body = {"model": SIM_MODEL, "prompt": "hi", "max_tokens": 1}
        assert requests.post(url, json=body, timeout=30).status_code == 200

        router = stack.components["router"]
        router.signal_group(signal.SIGKILL)
        router.proc.wait(timeout=10)
        assert [c.name for c in stack.dead()] == ["router"]

        # Connect failure at first, then "no healthy upstream" once the
        # health check notices (it may notice before the first retry here):
        # both are Envoy's own 503, with a JSON body.
        messages = []
        deadline = time.monotonic() + 10
        while not messages or "no healthy upstream" not in messages[-1]:
            assert time.monotonic() < deadline, messages
            r = requests.post(url, json=body, timeout=10)
            assert r.status_code == 503
            assert r.headers["content-type"] == "application/json"
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert (err["type"], err["code"], err["param"]) == ("server_error", "service_unavailable", None)
            messages.append(err["message"])
            time.sleep(0.1)
        assert all("connection failure" in m or "no healthy upstream" in m for m in messages), messages
        clusters = requests.get(stack.admin_url + "/clusters", timeout=5).text
        assert "router::" in clusters and "/failed_active_hc" in clusters
        pgids = stack.process_groups()
    assert not any(group_members(pgid) for pgid in pgids)


def test_components_lead_their_own_process_groups_in_the_launchers_session(sim_stack):
    # One process group each (what stop() signals), one session for all: with
    # Linux's autogroups a session of its own would be a scheduling group of
    # its own, and a mostly-idle router's group then waited ~50 ms behind a
    # busy engine's (deploy/processes.py).
    comps = sim_stack.components
    assert {"router", "worker:sim-0", "envoy"} <= set(comps)
    for name, c in comps.items():
        assert os.getpgid(c.pid) == c.pid, name
        assert os.getsid(c.pid) == os.getsid(0), name


def test_start_failure_names_the_component_and_cleans_up(tmp_path):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    try:
        taken = f"127.0.0.1:{blocker.getsockname()[1]}"
        cfg_path = write_config(tmp_path, envoy={"listen": taken})
        stack = Stack(cfg_path, tmp_path / "run")
        with pytest.raises(StackError) as info:
            stack.start()
    finally:
        blocker.close()
    msg = str(info.value)
    assert msg.startswith("envoy: exited while starting")
    assert str(tmp_path / "run" / "envoy.log") in msg
    assert "ddress already in use" in msg  # the tail of Envoy's own log
    assert {"router", "worker:sim-0", "envoy"} <= set(stack.components)
    assert not any(group_members(pgid) for pgid in stack.process_groups())


def test_worker_that_dies_at_start_is_reported(tmp_path):
    # A worker whose interpreter cannot even start (its `env` breaks Python).
    broken = sim_worker("sim-broken", env={"PYTHONHOME": str(tmp_path / "nowhere")})
    cfg_path = write_config(tmp_path, workers=[sim_worker("sim-0"), broken])
    stack = Stack(cfg_path, tmp_path / "run")
    with pytest.raises(StackError, match=r"^worker:sim-broken: exited before registering") as info:
        stack.start()
    msg = str(info.value)
    assert "exited with status 1" in msg and "worker-sim-broken.log" in msg
    assert "Fatal Python error" in msg  # the tail of the worker's own log
    assert not any(group_members(pgid) for pgid in stack.process_groups())


@pytest.mark.parametrize("blocked", [False, True], ids=["default", "launched-with-stop-signals-blocked"])
def test_weir_up_interrupted_while_starting_leaves_nothing(tmp_path, blocked):
    # A launcher may leave SIGINT/SIGTERM blocked (the mask survives exec):
    # weir up unblocks its own and starts every component with none blocked.
    cfg_path = write_config(tmp_path)
    stop_signals = frozenset({signal.SIGINT, signal.SIGTERM}) if blocked else frozenset()
    proc = _weir_up(cfg_path, tmp_path / "run", blocked=stop_signals)
    try:
        out = _Lines(proc.stdout)
        out.wait_for("started router (pid ", 30)
        router_pid = int(out.seen[-1].split("(pid ")[1].split(")")[0])
        if blocked:
            assert _blocked_signals(router_pid) == 0
        proc.send_signal(signal.SIGINT)  # before the stack is ready
        assert proc.wait(timeout=30) == 0
        out.wait_for("[weir] stopped", 5)
        text = "".join(out.seen)
        assert "weir is up." not in text
        started = {int(p.split(")")[0]) for p in text.split("(pid ")[1:]}
        assert router_pid in started
        assert not alive(started) and not any(group_members(pgid) for pgid in started)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stop_asked_for_while_starting_ends_the_start_and_leaves_nothing(tmp_path):
    # The launcher's flag, for when its signal handler's exception is lost
    # (raised inside a finalizer, Python prints and drops it): the start's
    # next poll sees it.
    stack = Stack(write_config(tmp_path), tmp_path / "run")
    stack.stop_requested = "SIGINT"
    t0 = time.monotonic()
    with pytest.raises(StackInterrupted, match="SIGINT"):
        stack.start()
    assert time.monotonic() - t0 < 10  # (the router's first poll, not its 30 s readiness timeout)
    assert "router" in stack.components
    assert not any(group_members(pgid) for pgid in stack.process_groups())
