"""A worker across a real network boundary (README: Scaling out, Workers on other hosts).

The test makes its own network namespace joined to the host by a veth pair
(CI runs as root), with addresses of its own (10.213.x.1/30 on the host,
.2 inside); the router's backend listens on all addresses and a worker
started *inside* the namespace -- which has no route to the host's loopback
-- knows only the router's veth address (its ``routers`` list).  It
registers, heartbeats and serves a model no other worker has, through
Envoy.  Where namespaces cannot be made (no root, no ``ip``), the same runs
with the worker dialling a second loopback address (127.0.0.2) instead,
and the test says which ran (``WEIR_TEST_NO_NETNS=1`` forces the fallback).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import requests
from stackutil import sim_worker, start_stack, write_config

from bench import localconfig
from bench.localconfig import REPO, free_ports

REMOTE_MODEL = "sim-remote"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def _namespace():
    """(host address, run-in-namespace prefix) of a fresh netns + veth pair,
    or None when namespaces are unavailable here."""
    if os.environ.get("WEIR_TEST_NO_NETNS") or os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    ns, host_if, ns_if = f"weirns{tag}", f"wvh{tag}", f"wvn{tag}"
    net = f"10.213.{random.randrange(256)}"
    try:
        _ip("netns", "add", ns)
    except (subprocess.CalledProcessError, OSError):
        yield None
        return
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{net}.1/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{net}.2/30", "dev", ns_if)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield f"{net}.1", ["ip", "netns", "exec", ns]
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _registered(url: str) -> set[str]:
    try:
        return {w["id"] for w in requests.get(url + "/admin/workers", timeout=5).json()}
    except (requests.RequestException, ValueError):
        return set()


def test_worker_in_another_network_namespace_serves_through_the_router(tmp_path):
    (backend_port,) = free_ports(1)
    models = [*localconfig.models(), {"name": REMOTE_MODEL, "engine": "sim", "max_model_len": 4096}]
    with _namespace() as netns:
        if netns is not None:
            host_addr, prefix = netns
            boundary = f"network namespace over a veth pair (router at {host_addr})"
        else:
            host_addr, prefix = "127.0.0.2", []
            boundary = "second loopback address 127.0.0.2 (no network namespace here)"
        print(f"\nremote worker across: {boundary}")
        remote = sim_worker("remote-0", model=REMOTE_MODEL, routers=[f"tcp://{host_addr}:{backend_port}"])
        cfg = write_config(
            tmp_path,
            models=models,
            workers=[sim_worker("sim-0"), remote],
            router={"backend": f"tcp://0.0.0.0:{backend_port}", "heartbeat_interval_s": 0.25},
        )
        with start_stack(cfg, workers=["sim-0"]) as stack:  # the remote one is started below, over there
            log = open(tmp_path / "remote-0.log", "wb")
            env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "engine_worker", "--config", str(cfg), "--worker-id", "remote-0"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
                process_group=0,
            )
            try:
                deadline = time.monotonic() + 30
                while "remote-0" not in _registered(stack.router_url) and time.monotonic() < deadline:
                    assert proc.poll() is None, (tmp_path / "remote-0.log").read_text()
                    time.sleep(0.2)
                assert "remote-0" in _registered(stack.router_url), (tmp_path / "remote-0.log").read_text()
                body = {"model": REMOTE_MODEL, "prompt": "from afar", "max_tokens": 12}
                for _ in range(5):
                    r = requests.post(stack.envoy_url + "/v1/completions", json=body, timeout=30)
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 12
                # Its heartbeats cross too: still registered after several liveness periods.
                time.sleep(1.5)
                assert "remote-0" in _registered(stack.router_url)
                if netns is not None:  # and the boundary is real: no way back to the host's loopback
                    probe = subprocess.run(
                        [
                            *prefix,
                            sys.executable,
                            "-c",
                            f"import socket; socket.create_connection(('127.0.0.1', {backend_port}), 1)",
                        ],
                        capture_output=True,
                        timeout=10,
                    )
                    assert probe.returncode != 0
            finally:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                log.close()
