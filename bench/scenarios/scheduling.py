"""Scheduling quality end to end: the router's "weir" policy vs its "fifo"
mode, on the same seeded arrivals, through Envoy, on sim workers.

(a) mixed: 80 % short / 20 % long (``mixed`` workload) at ``--util`` of the
    fleet's saturation.  Target: short p99 E2E >= 5x better than FIFO.
(b) priority overload: 10 % high-priority traffic (``priority`` workload) at
    ``--overload`` x saturation, against the same traffic unloaded (10 % of
    saturation).  Target: high-priority p99 TTFT overloaded <= 2x unloaded.

The fleets are those of the scheduler's discrete-event simulation
(simulation/des.py): two sim workers, 32 seqs each, 16k KV tokens per worker for
(a) -- KV is the scarce resource -- and 64k for (b).  Saturation is measured
here, end to end: completions/s of the FIFO stack when always backlogged.

    python -m bench.scenarios.scheduling [--duration 60] [--only mixed|priority]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import spec
from bench.arrivals import Arrivals
from bench.plots import latency_cdf
from bench.runner import Limits
from bench.scenarios import common

POLICIES = ("fifo", "weir")
KEYS = [
    {"key": "sk-bench-high", "tenant": "vip", "tier": "high"},
    {"key": "sk-bench-a", "tenant": "a", "tier": "normal"},
    {"key": "sk-bench-b", "tenant": "b", "tier": "normal"},
    {"key": "sk-bench-c", "tenant": "c", "tier": "normal"},
]


def fleet(kv_tokens: int, n: int = 2, max_num_seqs: int = 32) -> list[dict]:
    return [common.sim_worker(f"sim-{i}", max_num_seqs=max_num_seqs, kv_capacity_tokens=kv_tokens) for i in range(n)]


def slots(workers: list[dict]) -> int:
    return sum(w["max_num_seqs"] for w in workers)


def saturation(st, workload, slots: int, probe_s: float) -> float:
    """Completions/s while always backlogged (closed loop, 2x the fleet's
    seq slots in flight), over the second half of the probe."""
    res = common.bench(
        workload,
        "envoy",
        st.envoy_url,
        Arrivals(concurrency=2 * slots),
        Limits(10_000, probe_s, 0.0),
        label=f"saturation probe ({workload.name})",
    )
    half = probe_s / 2
    done = [r for r in res.records if r.status == 200 and r.end >= half]
    if not done:
        raise RuntimeError(f"saturation probe: nothing completed; {res.summary['overall'].get('first_error')}")
    return len(done) / (probe_s - half)


def run_policy(out: Path, part: str, policy: str, workers: list[dict], fn, api_keys=None):
    d = out / f"stack-{part}-{policy}"
    cfg = common.write_config(d, workers=workers, api_keys=api_keys, scheduler={"policy": policy})
    with common.stack(cfg, d / "run") as st:
        return fn(st)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.scheduling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per loaded run")
    ap.add_argument("--probe", type=float, default=20.0, help="seconds of the saturation probe")
    ap.add_argument("--util", type=float, default=0.9)
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--only", choices=("mixed", "priority"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    out = args.out or common.results_dir("scheduling")
    argv = argv if argv is not None else sys.argv[1:]
    md = [
        common.header(
            "Scheduling end to end: weir policy vs FIFO (sim workers, through Envoy)",
            ["bench.scenarios.scheduling", *argv],
        ),
        "",
    ]
    data: dict = {}

    if args.only in (None, "mixed"):
        w = spec.load("mixed")
        workers = fleet(kv_tokens=16384)
        sat: dict = {}
        runs = {}
        for policy in POLICIES:

            def go(st, policy=policy):
                if "rate" not in sat:
                    sat["sat"] = saturation(st, w, slots(workers), args.probe)
                    sat["rate"] = args.util * sat["sat"]
                rate = sat["rate"]
                return common.bench(
                    w,
                    "envoy",
                    st.envoy_url,
                    Arrivals(rate=rate),
                    Limits(int(rate * args.duration), args.duration, 120),
                    label=f"mixed, {policy}",
                )

            runs[policy] = run_policy(out, "mixed", policy, workers, go)
        data["mixed"] = {"saturation_rps": sat["sat"], "rate": sat["rate"], **{p: r.summary for p, r in runs.items()}}
        md += _mixed_section(runs, sat, args, out)

    if args.only in (None, "priority"):
        w = spec.load("priority")
        workers = fleet(kv_tokens=65536)
        sat = {}
        runs = {}
        for policy in POLICIES:

            def go(st, policy=policy):
                res = {}
                if "rate" not in sat:
                    sat["sat"] = saturation(st, w, slots(workers), args.probe)
                if policy == "weir":
                    # Unloaded reference: 10 % of saturation, 2x as long for enough high samples.
                    r0 = 0.1 * sat["sat"]
                    res["unloaded"] = common.bench(
                        w,
                        "envoy",
                        st.envoy_url,
                        Arrivals(rate=r0),
                        Limits(int(r0 * 2 * args.duration), 2 * args.duration, 60),
                        label="priority, unloaded (weir)",
                    )
                rate = args.overload * sat["sat"]
                sat["rate"] = rate
                res[f"overload-{policy}"] = common.bench(
                    w,
                    "envoy",
                    st.envoy_url,
                    Arrivals(rate=rate),
                    Limits(int(rate * args.duration), args.duration, 120),
                    label=f"priority {args.overload:g}x overload, {policy}",
                )
                return res

            runs.update(run_policy(out, "priority", policy, workers, go, api_keys=KEYS))
        data["priority"] = {
            "saturation_rps": sat["sat"],
            "rate": sat["rate"],
            **{k: r.summary for k, r in runs.items()},
        }
        md += _priority_section(runs, sat, args, out)

    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text)
    common.save(out, "scheduling.json", data)
    print(text)
    print(f"results: {out}")
    return 0


def _row(name: str, cls: str, s: dict) -> str:
    def f(m, p):
        return "-" if not s.get(m) else f"{s[m][p]:.1f}"

    return (
        f"| {name} | {cls} | {s['ok']} / {s['sent']} | {s['rate_limited_429']} | {s['unavailable_503']} | "
        f"{f('ttft_ms', 'p50')} | {f('ttft_ms', 'p99')} | {f('e2e_ms', 'p50')} | {f('e2e_ms', 'p99')} |"
    )


_HEAD = [
    "| run | class | ok / sent | 429 | 503 | TTFT p50 (ms) | TTFT p99 | E2E p50 | E2E p99 |",
    "|---|---|---|---|---|---|---|---|---|",
]


def _p99(s: dict, cls: str, m: str) -> float:
    c = s["classes"].get(cls)
    return c[m]["p99"] if c and c.get(m) else float("nan")


def _mixed_section(runs, sat, args, out: Path) -> list[str]:
    md = [
        f"## (a) mixed 80 % short / 20 % long at {100 * args.util:.0f} % of saturation\n",
        f"Saturation (FIFO, backlogged): {sat['sat']:.1f} req/s; offered {sat['rate']:.1f} req/s, "
        f"{args.duration:g} s of Poisson arrivals, same seed for both policies.\n",
        *_HEAD,
    ]
    for p, r in runs.items():
        for cls in ("short", "long"):
            if cls in r.summary["classes"]:
                md.append(_row(p, cls, r.summary["classes"][cls]))
    ratio = _p99(runs["fifo"].summary, "short", "e2e_ms") / _p99(runs["weir"].summary, "short", "e2e_ms")
    md.append(f"\n**Short p99 E2E, FIFO / weir: {ratio:.1f}×** (target ≥ 5×)\n")
    latency_cdf(
        {f"short, {p}": [x for x in r.records if x.cls == "short"] for p, r in runs.items()}
        | {f"long, {p}": [x for x in r.records if x.cls == "long"] for p, r in runs.items()},
        out / "scheduling_mixed_cdf.png",
        "mixed workload: weir vs FIFO",
    )
    md.append("![mixed](scheduling_mixed_cdf.png)\n")
    return md


def _priority_section(runs, sat, args, out: Path) -> list[str]:
    md = [
        f"## (b) priority overload: 10 % high priority at {args.overload:g}× saturation\n",
        f"Saturation (FIFO, backlogged): {sat['sat']:.1f} req/s; overload offered {sat['rate']:.1f} req/s for "
        f"{args.duration:g} s; unloaded = 10 % of saturation (weir).\n",
        *_HEAD,
    ]
    for name, r in runs.items():
        for cls in ("high", "normal"):
            if cls in r.summary["classes"]:
                md.append(_row(name, cls, r.summary["classes"][cls]))
    base = _p99(runs["unloaded"].summary, "high", "ttft_ms")
    for p in POLICIES:
        v = _p99(runs[f"overload-{p}"].summary, "high", "ttft_ms")
        md.append(
            f"\n**High-priority p99 TTFT, {p} overloaded / unloaded: {v / base:.2f}×**"
            + (" (target ≤ 2×)" if p == "weir" else "")
        )
    latency_cdf(
        {name: [x for x in r.records if x.cls == "high"] for name, r in runs.items()},
        out / "scheduling_priority_cdf.png",
        "high-priority class: unloaded vs overloaded",
        metrics=("ttft_ms", "e2e_ms"),
    )
    md.append("\n![priority](scheduling_priority_cdf.png)\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
