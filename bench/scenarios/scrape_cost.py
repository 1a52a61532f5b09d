"""What a Prometheus scrape of the router's /metrics costs, by registered workers.

A router (and Envoy) with one sim worker; N stand-in workers register over the
real backend socket (ZeroMQ DEALERs sending Register and heartbeats with stats,
as engine_worker does) and stay registered while /metrics is fetched
sequentially; prints the scrape's latency p50/p90 and size per N, and -- for
the worker pods' probes (deploy/k8s_probe.py) -- one worker
(/admin/workers/{id}) against the whole list (/admin/workers); and how long
another request (/health/live, back to back from a second thread) waits
while the scrapes run: the router's loop held by them -- against the same
pings for IDLE_S with no scrape (the fleet's heartbeats, this process's own
threads and the machine's other load are in both).  The router's full garbage
collections are logged over the run (bench/gc_probe): how many, and the
longest, while the scrapes ran and over the whole run.

    python -m bench.scenarios.scrape_cost [--workers 0,64,1024] [-n 30]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import zmq

from bench.scenarios import common
from shared.protocol import GpuInfo, Heartbeat, Pool, Register, WorkerStats, encoder

T = TypeVar("T")

HEARTBEAT_S = 0.5  # well within the router's liveness (6 x 0.5 s in the bench stacks)
# Each worker heartbeats every HEARTBEAT_S at its own phase, as a real fleet's
# timers are: one group every HEARTBEAT_S / GROUPS.  (All 1,024 at once has
# the router drain them 512 a loop turn: a stall of their own, in both columns.)
GROUPS = 10
IDLE_S = 3.0  # the control: pings with no scrape running (six heartbeat rounds)
GC_PROBE = Path(__file__).resolve().parent.parent / "gc_probe"  # a sitecustomize the router picks up


class Fleet:
    """N stand-in workers on one thread: register, heartbeat, read what comes."""

    def __init__(self, backend: str, n: int, model: str):
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, n + 64)  # libzmq's default is 1,023
        self.socks = []
        self.stop = threading.Event()
        for i in range(n):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, f"stand-in-{i}".encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(backend)
            s.send(
                encoder.encode(
                    Register(
                        worker_id=f"stand-in-{i}",
                        model=model,
                        pool=Pool.ANY,
                        max_model_len=4096,
                        kv_capacity_tokens=65536,
                        block_size=16,
                        max_num_seqs=64,
                        engine="sim",
                        gpu=GpuInfo(),
                    )
                )
            )
            self.socks.append(s)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        next_beat, group = 0.0, 0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                for i in range(group, len(self.socks), GROUPS):
                    stats = WorkerStats(running=i % 5, waiting=i % 3, kv_usage=0.1)
                    self.socks[i].send(encoder.encode(Heartbeat(stats)))
                group = (group + 1) % GROUPS
                next_beat = now + HEARTBEAT_S / GROUPS
            for s, _ in poller.poll(10):
                while s.poll(0):
                    s.recv_multipart()

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()
        self.ctx.term()


def _get(url: str) -> bytes:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=30) as r:
        return r.read()


def _registered(router: str) -> int:
    import json

    return len(json.loads(_get(router + "/admin/workers")))


def _time(url: str, n: int, warmup: int = 3) -> tuple[list[float], int]:
    for _ in range(warmup):
        _get(url)
    times, size = [], 0
    for _ in range(n):
        t = time.perf_counter()
        size = len(_get(url))
        times.append(time.perf_counter() - t)
    return times, size


def _pings_during(url: str, work: Callable[[], T]) -> tuple[list[float], T]:
    """Latencies of back-to-back GET ``url`` (another client of the same
    router) while ``work()`` runs: how long the router's loop is held; and
    what ``work()`` returned."""
    out: list[float] = []
    done = threading.Event()

    def ping():
        while not done.is_set():
            t = time.perf_counter()
            _get(url)
            out.append(time.perf_counter() - t)

    th = threading.Thread(target=ping)
    th.start()
    try:
        result = work()
    finally:
        done.set()
        th.join()
    return out, result


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def _full_collections(log: Path, since: float = 0.0, until: float = float("inf")) -> list[float]:
    """Durations (s) of the router's full collections that ended in [since, until] (bench/gc_probe's log)."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        at, ms = line.split()[:2]
        if since <= float(at) <= until:
            out.append(float(ms) / 1e3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.scrape_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="0,64,1024", help="registered stand-in workers per round")
    ap.add_argument("-n", "--scrapes", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    # A socket each here, a connection each in the router (which inherits the limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    argv = list(argv if argv is not None else __import__("sys").argv[1:])
    out = args.out or common.results_dir("scrape-cost")
    cfg = common.write_config(out / "stack", workers=[common.sim_worker()])  # Envoy waits for a ready router
    gc_log = out / "router-gc.log"
    os.environ["WEIR_BENCH_GC_LOG"] = str(gc_log)  # the stack's processes inherit this environment
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GC_PROBE), os.environ.get("PYTHONPATH")]))
    rows = []
    with common.stack(cfg, out / "stack" / "run") as st:
        backend = st.cfg.router.backend
        for n in [int(x) for x in args.workers.split(",")]:
            fleet = Fleet(backend, n, common.SIM_MODEL)
            try:
                deadline = time.monotonic() + 60
                while _registered(st.router_url) < n + 1:
                    assert time.monotonic() < deadline, "stand-in workers did not all register"
                    time.sleep(0.2)
                idle, _ = _pings_during(st.router_url + "/health/live", lambda: time.sleep(IDLE_S))
                scrapes_from = time.time()
                pings, (metrics, size) = _pings_during(
                    st.router_url + "/health/live", lambda: _time(st.metrics_url, args.scrapes)
                )
                during_gc = _full_collections(gc_log, scrapes_from, time.time())
                one, _ = (
                    _time(st.router_url + f"/admin/workers/stand-in-{max(0, n - 1)}", args.scrapes) if n else ([0.0], 0)
                )
                every, _ = _time(st.router_url + "/admin/workers", args.scrapes)
                rows.append(
                    (
                        n,
                        _pct(metrics, 50),
                        _pct(metrics, 90),
                        size,
                        _pct(one, 50),
                        _pct(every, 50),
                        _pct(pings, 99),
                        max(pings),
                        _pct(idle, 99),
                        max(idle),
                        len(during_gc),
                        max(during_gc, default=0.0),
                    )
                )
            finally:
                fleet.close()
            time.sleep(4.5)  # the router forgets them (missed heartbeats: 6 x 0.5 s) before the next round
    print(common.header("Scrape cost of /metrics by registered workers", ["bench.scenarios.scrape_cost", *argv]))
    print(
        f"{'workers':>8} {'/metrics p50 ms':>16} {'p90 ms':>8} {'bytes':>9} {'/admin/workers/{id} p50 ms':>27} "
        f"{'/admin/workers p50 ms':>22} {'/health/live during scrapes p99 ms':>35} {'max ms':>7} "
        f"{'without scrapes p99 ms':>23} {'max ms':>7} {'full GCs during scrapes':>24} {'longest ms':>11}"
    )
    for n, p50, p90, size, one, every, ping99, ping_max, idle99, idle_max, gcs, gc_max in rows:
        print(
            f"{n:>8} {p50 * 1e3:>16.2f} {p90 * 1e3:>8.2f} {size:>9} {one * 1e3:>27.2f} {every * 1e3:>22.2f} "
            f"{ping99 * 1e3:>35.2f} {ping_max * 1e3:>7.2f} {idle99 * 1e3:>23.2f} {idle_max * 1e3:>7.2f} "
            f"{gcs:>24} {gc_max * 1e3:>11.2f}"
        )
    whole = _full_collections(gc_log)
    print(
        f"the router's full collections over the whole run (start-up's freeze included): {len(whole)}, "
        f"{', '.join(f'{t * 1e3:.1f}' for t in whole)} ms (bench/gc_probe; log {gc_log})"
    )
    common.save(
        out,
        "scrape_cost",
        [
            dict(
                zip(
                    (
                        "workers",
                        "metrics_p50_s",
                        "metrics_p90_s",
                        "metrics_bytes",
                        "one_worker_p50_s",
                        "all_workers_p50_s",
                        "ping_during_p99_s",
                        "ping_during_max_s",
                        "ping_idle_p99_s",
                        "ping_idle_max_s",
                        "full_gcs_during",
                        "full_gc_during_max_s",
                    ),
                    r,
                )
            )
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
