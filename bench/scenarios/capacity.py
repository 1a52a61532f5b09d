"""Capacity: how much traffic one router process carries.

1. Requests/s: 1-token completions on a zero-cost sim engine, open-loop
   Poisson arrivals at rising rates, on the ZeroMQ path and on router-direct
   HTTP, until p99 bends (p99 E2E over ``--bend`` x its value at the lowest
   rate, achieved rate under 95 % of offered, or over 1 % refused).  The
   capacity is the highest rate before that.  Router, worker and client CPU
   are recorded at each rate, which shows who ran out first.
2. Streamed tokens/s: ``--streams`` concurrent streams of 256-token outputs
   (closed loop) on the same zero-cost engine, over SSE (router-direct HTTP)
   and ZeroMQ; tokens counted by the client.

    python -m bench.scenarios.capacity [--paths zmq,router] [--max-rate 64000] [--streams 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import spec
from bench.arrivals import Arrivals
from bench.plots import latency_vs_load
from bench.report import sweep_table
from bench.runner import Limits
from bench.scenarios import common

KIND_URL = {"zmq": "zmq_frontend", "router": "router_url", "envoy": "envoy_url"}


def _cpu(stack) -> dict[str, float]:
    out = {}
    for name, comp in stack.components.items():
        try:
            out[name] = common.pid_cpu_seconds(comp.pid)
        except OSError:
            pass
    return out


def _measured(stack, *args, **kwargs):
    """Run ``common.bench(*args, **kwargs)``; return its result and each
    component's CPU use (cores) over the measured part of the run."""
    marks = {}

    def on_phase(phase: str) -> None:
        marks[phase] = (_cpu(stack), time.monotonic())

    res = common.bench(*args, on_phase=on_phase, **kwargs)
    (c0, t0), (c1, t1) = marks["start"], marks["end"]
    return res, {k: (c1[k] - c0[k]) / (t1 - t0) for k in c1 if k in c0}


def _rates(start: float, stop: float, factor: float) -> list[float]:
    out, r = [], start
    while r <= stop * 1.0001:
        out.append(round(r))
        r *= factor
    return out


def sweep(stack, kind: str, args, workload) -> tuple[list[dict], float | None]:
    url = getattr(stack, KIND_URL[kind])
    points: list[dict] = []
    base_p99 = None
    best = None
    for rate in _rates(args.start_rate, args.max_rate, args.factor):
        n = max(200, int(rate * args.step_s))
        res, cpu = _measured(
            stack,
            workload,
            kind,
            url,
            Arrivals(rate=rate),
            Limits(n, args.step_s * 1.5, 10),
            label=f"{kind} @ {rate} req/s",
            connections=min(512, max(8, rate // 100)),
        )
        o = res.summary["overall"]
        p99 = o["e2e_ms"]["p99"] if o["e2e_ms"] else float("inf")
        base_p99 = base_p99 if base_p99 is not None else p99
        refused = (o["sent"] - o["ok"]) / max(1, o["sent"])
        achieved = o["throughput_rps"] / rate
        bent = p99 > args.bend * base_p99 or achieved < 0.95 or refused > 0.01
        points.append({"offered": rate, "summary": res.summary, "cpu": cpu, "bent": bent})
        print(
            f"{kind} @ {rate} req/s: achieved {o['throughput_rps']:.0f}, p50 {o['e2e_ms'] and o['e2e_ms']['p50']:.2f} "
            f"p99 {p99:.2f} ms, refused {100 * refused:.1f} %, CPU "
            + ", ".join(f"{k} {100 * v:.0f} %" for k, v in cpu.items())
            + f", client {100 * res.summary['client_cpu_util']:.0f} %",
            file=sys.stderr,
        )
        if bent:
            break
        best = rate
    return points, best


def streaming(stack, kind: str, args) -> dict:
    url = getattr(stack, KIND_URL[kind])
    w = spec.load("stream")
    n = args.streams * args.stream_rounds
    res, cpu = _measured(
        stack,
        w,
        kind,
        url,
        Arrivals(concurrency=args.streams),
        Limits(n, 120, 60),
        label=f"{kind}: {args.streams} streams",
        connections=args.streams,
    )
    o = res.summary["overall"]
    print(f"{kind} streaming: {o['output_tok_per_s']:.0f} tok/s, {o['ok']}/{o['sent']} ok", file=sys.stderr)
    return {"kind": kind, "summary": res.summary, "cpu": cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="zmq,router", help="comma-separated: zmq, router, envoy")
    ap.add_argument("--start-rate", type=float, default=500)
    ap.add_argument("--max-rate", type=float, default=64000)
    ap.add_argument("--factor", type=float, default=1.41421356, help="rate multiplier per step")
    ap.add_argument("--step-s", type=float, default=3.0, help="seconds of arrivals per rate")
    ap.add_argument("--bend", type=float, default=10.0, help="p99 multiple of the lowest rate's that counts as bent")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--stream-rounds", type=int, default=4, help="requests per stream slot")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-streams", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]

    out = args.out or common.results_dir("capacity")
    one_token = spec.load("one-token")
    big = 10_000_000
    cfg = common.write_config(
        out / "stack",
        workers=[common.sim_worker(max_num_seqs=4096, zero_cost=True, kv_capacity_tokens=big)],
        # Overload should show as latency here, not as queue-full refusals.
        scheduler={"max_queue_per_tenant": big, "classes": [{"name": n, "max_queue": big} for n in common.CLASSES]},
    )
    sweeps, best, streams = {}, {}, []
    with common.stack(cfg, out / "stack" / "run") as st:
        for kind in paths:
            if not args.skip_sweep:
                sweeps[kind], best[kind] = sweep(st, kind, args, one_token)
        for kind in paths:
            if not args.skip_streams:
                streams.append(streaming(st, kind, args))
    _report(out, args, argv if argv is not None else sys.argv[1:], sweeps, best, streams)
    return 0


def _cpu_cell(cpu: dict) -> str:
    short = {"router": "router", "envoy": "envoy"}
    parts = []
    for k, v in sorted(cpu.items()):
        parts.append(f"{short.get(k, k.replace('worker:', ''))} {100 * v:.0f}%")
    return ", ".join(parts)


def _report(out: Path, args, argv, sweeps: dict, best: dict, streams: list) -> None:
    md = [common.header("Capacity of one router process", ["bench.scenarios.capacity", *argv]), ""]
    if sweeps:
        md.append("## Requests/s (1-token completions, zero-cost sim engine, Poisson arrivals)\n")
        md.append(f"Bend: p99 E2E > {args.bend:g}× the lowest rate's, achieved < 95 % of offered, or > 1 % refused.\n")
        md.append("| path | capacity (highest rate before the bend), req/s |\n|---|---|")
        for k in sweeps:
            md.append(f"| {k} | {best[k] if best[k] is not None else 'below ' + str(args.start_rate)} |")
        for k, pts in sweeps.items():
            md.append(f"\n### {k}\n")
            md.append(sweep_table(pts))
            md.append(
                "\nCPU per component at each rate (cores): "
                + "; ".join(f"{p['offered']}: {_cpu_cell(p['cpu'])}" for p in pts)
            )
        latency_vs_load(sweeps, out / "capacity_latency_vs_load.png", "1-token requests, zero-cost sim engine")
        md.append("\n![latency vs load](capacity_latency_vs_load.png)\n")
    if streams:
        md.append(f"## Streamed tokens/s ({args.streams} concurrent streams × 256 tokens, zero-cost sim engine)\n")
        md.append(
            "| path | output tokens/s | ok / sent | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | client CPU | CPU |"
        )
        md.append("|---|---|---|---|---|---|---|---|")
        for s in streams:
            o = s["summary"]["overall"]
            md.append(
                f"| {s['kind']} | {o['output_tok_per_s']:,.0f} | {o['ok']} / {o['sent']} | "
                f"{o['ttft_ms']['p50'] if o['ttft_ms'] else float('nan'):.1f} | "
                f"{o['itl_ms']['p50'] if o['itl_ms'] else float('nan'):.2f} | "
                f"{o['itl_ms']['p99'] if o['itl_ms'] else float('nan'):.2f} | "
                f"{100 * s['summary']['client_cpu_util']:.0f} % | {_cpu_cell(s['cpu'])} |"
            )
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text)
    common.save(out, "capacity.json", {"sweeps": sweeps, "capacity": best, "streams": streams})
    print(text)
    print(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())
