"""Overhead: what each path adds to a request that costs the engine nothing.

1-token completions, sequential (one in flight), on a zero-cost sim engine,
so every microsecond measured is dataplane: client, transport, router,
worker.  Paths: ZeroMQ direct to the router, HTTP straight to the router,
HTTP through Envoy -- plus three floors, the same client against canned-reply
servers (``bench.echo``): over ZeroMQ and HTTP, which is what the client and
loopback cost by themselves, and the relay floor, weir's ZeroMQ topology
(client -> relay process -> worker process and back, four hops) with no work
in it, which is the least a direct request to weir can cost.  The paths take turns in rounds so that noise
from anything else on the machine lands on all of them alike.

    python -m bench.scenarios.overhead [-n 2000] [--rounds 4] [--curve] [--tracing HOST:PORT [--sampling-ratio R]]

``--curve``: the router's ZeroMQ planes are CURVE servers (shared.curve) and
the bench client and the worker authenticate: the zmq path then measures
what encryption + authentication add (compare with a run without it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from bench import spec
from bench.arrivals import Arrivals
from bench.metrics import summarise
from bench.plots import latency_cdf
from bench.runner import Limits
from bench.scenarios import common

PATHS = ("floor-zmq", "floor-relay", "zmq", "floor-http", "router", "envoy")
KIND = {
    "floor-zmq": "zmq",
    "floor-relay": "zmq",
    "zmq": "zmq",
    "floor-http": "openai",
    "router": "router",
    "envoy": "envoy",
}
# What each path is compared with to say what it adds.
BASE = {"floor-relay": "floor-zmq", "zmq": "floor-zmq", "router": "floor-http", "envoy": "router"}
DESCRIBE = {
    "floor-zmq": "bench client ↔ canned ZeroMQ ROUTER (floor)",
    "floor-relay": "bench client ↔ canned relay ↔ canned worker (floor: weir's four hops, no work)",
    "zmq": "ZeroMQ direct → router → sim worker",
    "floor-http": "bench client ↔ canned HTTP server (floor)",
    "router": "HTTP → router → sim worker",
    "envoy": "HTTP → Envoy → router → sim worker",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--num-requests", type=int, default=2000, help="per path (default 2000)")
    ap.add_argument("--rounds", type=int, default=4, help="the paths alternate this many times")
    ap.add_argument("--warmup", type=int, default=200, help="per path, before the first round")
    ap.add_argument(
        "--backend",
        help="router<->worker endpoint (default: a free tcp://127.0.0.1 port), e.g. ipc:///tmp/weir-backend.sock",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--curve", action="store_true", help="CURVE on both ZeroMQ planes (keys made in OUT/stack/curve)")
    ap.add_argument("--tracing", metavar="HOST:PORT", help="[tracing] on, exporting to this OTLP collector (gRPC)")
    ap.add_argument("--sampling-ratio", type=float, default=1.0, help="with --tracing (default 1.0)")
    args = ap.parse_args(argv)

    out = args.out or common.results_dir("overhead")
    workload = spec.load("one-token")
    per_round = max(1, args.num_requests // args.rounds)
    curve_keys, extra = None, {}
    if args.curve:
        from shared import curve

        d = out / "stack" / "curve"
        curve.generate(d, workers=["sim-0"], clients=["bench"])
        curve_keys = (str(d / "clients" / "bench.key_secret"), str(d / "router.key"))
        extra["security"] = {"curve": True, "curve_dir": str(d)}
    if args.tracing:  # what tracing costs every path (docs/operating.md#tracing)
        extra["tracing"] = {"endpoint": args.tracing, "sampling_ratio": args.sampling_ratio}
    cfg = common.write_config(
        out / "stack",
        workers=[common.sim_worker(max_num_seqs=256, zero_cost=True)],
        router={"backend": args.backend} if args.backend else None,
        **extra,
    )
    ports = common.free_ports(4)
    echo_http, echo_zmq = f"127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
    relay_front, relay_back = f"tcp://127.0.0.1:{ports[2]}", f"tcp://127.0.0.1:{ports[3]}"
    # three processes, as weir's path has: the client's, the relay's, the worker's
    echoes = [
        subprocess.Popen([sys.executable, "-m", "bench.echo", *a], cwd=common.REPO)
        for a in (
            ["--http", echo_http, "--zmq", echo_zmq],
            ["--relay", f"{relay_front},{relay_back}"],
            ["--worker", relay_back],
        )
    ]
    records = {p: [] for p in PATHS}
    try:
        with common.stack(cfg, out / "stack" / "run") as st:
            urls = {
                "floor-zmq": echo_zmq,
                "floor-relay": relay_front,
                "zmq": st.zmq_frontend,
                "floor-http": f"http://{echo_http}",
                "router": st.router_url,
                "envoy": st.envoy_url,
            }
            _wait_listening(echo_http)
            for p in PATHS:
                common.bench(
                    workload,
                    KIND[p],
                    urls[p],
                    Arrivals(concurrency=1),
                    Limits(args.warmup, 120, 10),
                    label=f"warm-up {p}",
                    progress=False,
                    curve=curve_keys if p == "zmq" else None,
                )
            for r in range(args.rounds):
                for p in PATHS:
                    res = common.bench(
                        workload,
                        KIND[p],
                        urls[p],
                        Arrivals(concurrency=1),
                        Limits(per_round, 600, 30),
                        label=f"{p} round {r + 1}/{args.rounds}",
                        curve=curve_keys if p == "zmq" else None,
                    )
                    records[p] += res.records
    finally:
        for e in echoes:
            e.terminate()
            e.wait()
    summaries = {p: summarise(records[p], None, sum(x.e2e for x in records[p]), 0) for p in PATHS}
    _report(out, summaries, records, args, argv if argv is not None else sys.argv[1:])
    return 0 if all(s["ok"] == s["sent"] for s in summaries.values()) else 1


def _wait_listening(hostport: str, timeout_s: float = 10.0) -> None:
    import socket

    host, _, port = hostport.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _us(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _report(out: Path, summaries: dict, records: dict, args, argv) -> None:
    e = {p: summaries[p]["e2e_ms"] for p in PATHS}
    rows = [
        "| path | what | ok / sent | E2E p50 (µs) | p90 | p99 | adds over | p50 added (µs) | p50 ratio | "
        "p99 added (µs) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PATHS:
        s, b = summaries[p], BASE.get(p)
        ep = e[p] or {}
        add50 = add99 = ratio = "-"
        if b and e[p] and e[b]:
            add50 = f"{1000 * (e[p]['p50'] - e[b]['p50']):+.0f}"
            add99 = f"{1000 * (e[p]['p99'] - e[b]['p99']):+.0f}"
            ratio = f"{e[p]['p50'] / e[b]['p50']:.2f}×"
        rows.append(
            f"| {p} | {DESCRIBE[p]} | {s['ok']} / {s['sent']} | {_us(ep.get('p50'))} | {_us(ep.get('p90'))} | "
            f"{_us(ep.get('p99'))} | {b or '-'} | {add50} | {ratio} | {add99} |"
        )
    table = "\n".join(rows)
    if e["zmq"] and e["floor-relay"]:  # what weir's router and worker add beyond their hops
        table += (
            f"\n\nZeroMQ direct over the relay floor (the same four hops, no work): "
            f"{1000 * (e['zmq']['p50'] - e['floor-relay']['p50']):+.0f} µs p50, "
            f"{e['zmq']['p50'] / e['floor-relay']['p50']:.2f}×."
        )
    latency_cdf(
        {p: records[p] for p in PATHS},
        out / "overhead_cdf.png",
        "1-token requests, sequential, zero-cost sim engine",
        metrics=("e2e_ms",),
    )
    md = (
        common.header("Overhead: 1-token requests on a zero-cost sim engine", ["bench.scenarios.overhead", *argv])
        + f"\n{args.num_requests} requests per path in {args.rounds} alternating rounds, one in flight, "
        "after a warm-up; E2E as the client sees it (so it includes the client's own work: see the floors).\n\n"
        + table
        + "\n\n![CDF](overhead_cdf.png)\n"
    )
    (out / "summary.md").write_text(md)
    common.save(out, "overhead.json", {"summaries": summaries})
    print(md)
    print(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())
