"""A worker given one DNS name finds every router behind it, through real getaddrinfo.

A uniquely named /etc/hosts entry stands in for Kubernetes' headless Service:
it resolves to several loopback addresses (127.0.0.1-3), with a real router
process bound on each at the same ports.  One sim worker is given only the
name.  While traffic runs through a router that stays, an address is added
(its router is joined within one discovery period) and one removed (its
router is dropped: the worker's Goodbye takes it off that router's table).
The pure discovery logic with an injected resolver: tests/unit/test_discovery.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import hostsfile
import pytest
import requests
from stackutil import REPO, SIM_MODEL, sim_worker, write_config

from bench.localconfig import free_ports

INTERVAL_S = 0.5
IPS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]

pytestmark = pytest.mark.skipif(not hostsfile.writable(), reason="needs a writable /etc/hosts (root)")


def _worker_ids(http: str) -> set[str]:
    try:
        return {
            w["id"] for w in requests.get(f"http://{http}/admin/workers", timeout=2).json() if w["state"] == "ready"
        }
    except requests.RequestException:
        return set()


def _wait(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_worker_links_every_address_of_a_name_and_follows_changes(tmp_path):
    hosts = hostsfile.HostsName()
    http, front, back = free_ports(3)
    routers = [
        {"http": f"{ip}:{http}", "frontend": f"tcp://{ip}:{front}", "backend": f"tcp://{ip}:{back}"} for ip in IPS
    ]
    worker = sim_worker("sim-0", routers=[f"tcp://{hosts.name}:{back}"], discovery_interval_s=INTERVAL_S)
    cfg = write_config(tmp_path, routers=routers, workers=[worker], router={"heartbeat_interval_s": 0.25})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen] = []

    def spawn(args: list[str], log: str) -> None:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", *args, "--config", str(cfg)],
                env=env,
                cwd=REPO,
                process_group=0,
                stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / log, "wb"),
            )
        )

    hosts.set(IPS[:2])
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def traffic() -> None:  # through the router that stays throughout
        while not stop.is_set():
            try:
                r = requests.post(
                    f"http://{routers[1]['http']}/v1/completions",
                    timeout=10,
                    json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 8},
                )
                if r.status_code == 200:
                    served[0] += 1
                else:
                    failures.append(f"{r.status_code} {r.text[:200]}")
            except requests.RequestException as e:
                failures.append(repr(e))
            time.sleep(0.02)

    t = threading.Thread(target=traffic)
    try:
        for i in range(3):
            spawn(["router", "--index", str(i)], f"router{i}.log")
        spawn(["engine_worker", "--worker-id", "sim-0"], "worker.log")
        https = [r["http"] for r in routers]
        _wait(lambda: "sim-0" in _worker_ids(https[0]) and "sim-0" in _worker_ids(https[1]), 30)
        time.sleep(3 * INTERVAL_S)
        assert "sim-0" not in _worker_ids(https[2])  # not in the name: not linked
        t.start()
        time.sleep(0.5)

        hosts.set(IPS)  # a router pod appears
        joined = _wait(lambda: "sim-0" in _worker_ids(https[2]), 10)
        print(
            f"\ndiscovery: an added router got the worker's registration {joined:.2f} s after its record "
            f"appeared (interval {INTERVAL_S} s)"
        )
        assert joined < INTERVAL_S + 1.5  # one period, plus registration on a loaded machine
        r = requests.post(
            f"http://{https[2]}/v1/completions", timeout=10, json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 4}
        )
        assert r.status_code == 200, r.text

        # One disappears while it streams to this worker (a router pod draining, still up): its
        # stream ends whole, then the worker's Goodbye drops it there.
        body: dict[str, str] = {}

        def stream() -> None:
            with requests.post(
                f"http://{https[0]}/v1/completions",
                timeout=30,
                stream=True,
                json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 800, "stream": True},
            ) as r:
                body["text"] = r.content.decode()

        s = threading.Thread(target=stream)
        s.start()
        time.sleep(0.2)
        hosts.set(IPS[1:])
        t_gone = time.monotonic()
        time.sleep(2 * INTERVAL_S)
        assert s.is_alive() and "sim-0" in _worker_ids(https[0])  # kept while it holds a request here
        s.join(timeout=30)
        assert body["text"].rstrip().endswith("data: [DONE]") and '"error"' not in body["text"], body["text"][-300:]
        ended = time.monotonic()
        dropped = _wait(lambda: "sim-0" not in _worker_ids(https[0]), 10)
        print(
            f"discovery: a removed router, streaming, kept its link {ended - t_gone:.2f} s until the stream "
            f"ended, then dropped {dropped:.2f} s later"
        )
        assert dropped < INTERVAL_S + 1.5
        time.sleep(0.5)
        stop.set()
        t.join(timeout=15)
        assert not failures, failures[:5]
        assert served[0] > 10
        assert all(p.poll() is None for p in procs), (tmp_path / "worker.log").read_text()[-2000:]
        assert "sim-0" in _worker_ids(https[1]) and "sim-0" in _worker_ids(https[2])
    finally:
        stop.set()
        hosts.set([])
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
