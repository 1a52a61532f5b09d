"""A real router against a simulated fleet of many workers, in one process.

``FleetSim`` registers W zero-cost workers, each over its own DEALER socket
(the router sees W separate peers, as it would W engine processes): each
answers a Dispatch at once with every request's final Delta and heartbeats
once per ``heartbeat_interval_s``.  A ZeroMQ client in the same process
sends 1-token requests, ``--concurrency`` in flight.  Measured per W: the
router's req/s and its CPU per request (its /proc counters), and its CPU
while idle with W workers heartbeating (issue 10 target: <= 5 % of a core
at 1,024 workers at 1 Hz).  The client and the fleet share the other core,
so req/s is the pair's, and on this shared 2-core VM a lower bound.

    python -m bench.scenarios.fleet [--workers 1 16 256 1024] [-n 4000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import zmq

from bench import localconfig
from bench.localconfig import REPO, SIM_MODEL
from bench.scenarios.common import pid_cpu_seconds
from shared import protocol as p
from shared.client import AsyncClient
from shared.config import load
from shared.transport import SocketPump


class FleetSim:
    """W simulated workers, one DEALER each, one event loop."""

    def __init__(self, backend: str, n: int, interval_s: float, max_num_seqs: int = 256) -> None:
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, n + 64)  # (libzmq's default is 1,024 sockets a context)
        self.pump = SocketPump(self.loop)
        self.interval_s = interval_s
        self.socks = []
        for i in range(n):
            wid = f"fleet-{i:05d}"
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, wid.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(backend)
            self.pump.add(sock, lambda frames, s=sock: self._on_message(s, frames))
            self.pump.send(
                sock,
                [
                    p.encoder.encode(
                        p.Register(
                            worker_id=wid,
                            model=SIM_MODEL,
                            pool=p.Pool.ANY,
                            max_model_len=4096,
                            kv_capacity_tokens=1 << 20,
                            block_size=16,
                            max_num_seqs=max_num_seqs,
                            engine="sim",
                        )
                    )
                ],
            )
            self.socks.append(sock)
        self.served = 0
        self._beat = self.loop.create_task(self._heartbeats())

    def _on_message(self, sock, frames: list[bytes]) -> None:
        msg = p.to_worker_decoder.decode(frames[-1])
        if msg.__class__ is p.Dispatch:
            out = [
                p.Delta(r.request_id, " tok", r.params.max_tokens, "length", r.prompt_tokens, r.params.max_tokens)
                for r in msg.requests
            ]
            self.served += len(out)
            self.pump.send(sock, [p.encoder.encode(p.Outputs(out))])
        elif msg.__class__ is p.Goodbye:  # (a router restart): register again
            pass

    async def _heartbeats(self) -> None:
        beat = p.encoder.encode(p.Heartbeat(p.WorkerStats()))
        while True:
            await asyncio.sleep(self.interval_s)
            for sock in self.socks:
                self.pump.send(sock, [beat])

    def close(self) -> None:
        self._beat.cancel()
        for sock in self.socks:
            self.pump.remove(sock)
            sock.close(linger=0)
        self.ctx.term()


def _registered(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/admin/workers", timeout=5) as r:
            import json

            return len(json.loads(r.read()))
    except OSError:
        return -1


async def measure(cfg_path: Path, router_pid: int, n_workers: int, n: int, concurrency: int, idle_s: float) -> dict:
    cfg = load(cfg_path)
    url = f"http://{cfg.router.http}"
    fleet = FleetSim(cfg.router.backend, n_workers, cfg.router.heartbeat_interval_s)
    t0 = time.monotonic()
    while _registered(url) < n_workers:
        if time.monotonic() - t0 > 120:
            raise RuntimeError(f"only {_registered(url)} of {n_workers} workers registered")
        await asyncio.sleep(0.2)
    registered_s = time.monotonic() - t0
    await asyncio.sleep(2 * cfg.router.heartbeat_interval_s)  # settle
    c0, t1 = pid_cpu_seconds(router_pid), time.monotonic()
    await asyncio.sleep(idle_s)
    idle_core = (pid_cpu_seconds(router_pid) - c0) / (time.monotonic() - t1)
    async with AsyncClient(cfg.router.frontend) as client:
        for _ in range(min(200, n)):  # warm-up
            await client.complete(SIM_MODEL, "x", max_tokens=1)
        sem = asyncio.Semaphore(concurrency)
        errors = 0

        async def one():
            nonlocal errors
            async with sem:
                try:
                    await client.complete(SIM_MODEL, "x", max_tokens=1)
                except Exception:
                    errors += 1

        c0, t1 = pid_cpu_seconds(router_pid), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t1
        cpu = pid_cpu_seconds(router_pid) - c0
    fleet.close()
    return {
        "workers": n_workers,
        "registered_s": registered_s,
        "idle_core": idle_core,
        "req_s": n / wall,
        "router_cpu_us": cpu / n * 1e6,
        "errors": errors,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 16, 256, 1024])
    ap.add_argument("-n", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    rows = []
    for w in args.workers:  # a fresh router per fleet size: no leftovers of the last
        d = Path(tempfile.mkdtemp(prefix="weir-fleet-"))
        cfg = localconfig.write_config(
            d, router={"log_level": "warning", "heartbeat_interval_s": args.heartbeat_s}, workers=[]
        )
        log = open(d / "router.log", "wb")
        router = subprocess.Popen(
            [sys.executable, "-m", "router", "--config", str(cfg)], cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            url = f"http://{load(cfg).router.http}"
            while _registered(url) < 0:
                time.sleep(0.1)
            rows.append(asyncio.run(measure(cfg, router.pid, w, args.n, args.concurrency, args.idle_s)))
            r = rows[-1]
            print(
                f"W={w:>5}: registered in {r['registered_s']:.1f} s; idle router {100 * r['idle_core']:.1f} % "
                f"of a core; {r['req_s']:.0f} req/s, router CPU {r['router_cpu_us']:.0f} us/request, "
                f"{r['errors']} errors",
                flush=True,
            )
        finally:
            router.terminate()
            router.wait(timeout=10)
            log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
