"""Soak: steady load while workers are killed and restarted, and the router once.

    python -m bench.scenarios.soak [--minutes 5] [--rate 37] [--kill-every 60]

Two simulated workers (32 sequences, 16k KV tokens each: the scheduling
scenario's fleet, whose FIFO saturation was 53 req/s on the ``mixed``
workload, so 37 req/s is ~70 %) under ``weir up``'s supervision; streamed
``mixed`` requests through Envoy at a Poisson rate.  Every ``--kill-every``
seconds one worker (in turn) is SIGKILLed -- the supervisor restarts it --
and half way the router is SIGKILLed once.  Reported: requests ok / refused
(429/503, with Retry-After) / lost (an error or cut-off stream after being
admitted), streams resumed (router metrics, summed over its lives), RSS of
every process at the start and the end with its slope, reserved tokens at the
end, and p99 TTFT over time (``soak_ttft.png``).
"""

from __future__ import annotations

import argparse
import math
import signal
import statistics
import threading
import time
from pathlib import Path

import requests

from bench import spec
from bench.arrivals import Arrivals
from bench.metrics import OK
from bench.runner import Limits
from bench.scenarios import common

BUCKET_S = 10.0


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _resumed(url: str) -> float:
    try:
        text = requests.get(url, timeout=2).text
    except requests.RequestException:
        return -1.0
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("weir_resumed_total{"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=37.0, help="req/s (default ~70 %% of the fleet's capacity)")
    ap.add_argument("--kill-every", type=float, default=60.0, help="seconds between worker kills")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    out = args.out or common.results_dir("soak")
    duration = args.minutes * 60
    workers = [common.sim_worker(f"sim-{i}", max_num_seqs=32, kv_capacity_tokens=16384) for i in range(2)]
    cfg = common.write_config(out / "stack", workers=workers)
    workload = spec.load("mixed")
    from deploy.stack import Stack

    st = Stack(cfg, out / "stack" / "run", supervise=True, progress=lambda m: print(f"[stack] {m}", flush=True))
    with st:
        result: dict = {}
        runner = threading.Thread(
            target=lambda: result.update(
                r=common.bench(
                    workload,
                    "envoy",
                    st.envoy_url,
                    Arrivals(rate=args.rate),
                    Limits(num_requests=int(args.rate * duration * 1.5), duration_s=duration, drain_s=60),
                    label="soak",
                    progress=False,
                )
            )
        )
        t0 = time.monotonic()
        runner.start()
        rss: dict[str, list[tuple[float, float]]] = {}
        resumed_lives: list[float] = [0.0]
        events: list[tuple[float, str]] = []
        victims = [f"worker:{w['id']}" for w in workers]
        next_kill, kills, router_killed = args.kill_every, 0, False
        while runner.is_alive():
            now = time.monotonic() - t0
            for name, comp in st.components.items():  # per process: a restart is a new one
                if comp.pid and (mb := _rss_mb(comp.pid)) is not None:
                    rss.setdefault(f"{name} (pid {comp.pid})", []).append((now, mb))
            r = _resumed(st.metrics_url)
            if r >= 0:
                if r < resumed_lives[-1]:
                    resumed_lives.append(r)  # a new router: its counters start again
                else:
                    resumed_lives[-1] = r
            if now < duration and now >= next_kill:
                name = victims[kills % len(victims)]
                st.components[name].signal_group(signal.SIGKILL)
                events.append((now, f"SIGKILL {name}"))
                kills += 1
                next_kill += args.kill_every
            if not router_killed and now >= duration / 2:
                st.components["router"].signal_group(signal.SIGKILL)
                events.append((now, "SIGKILL router"))
                router_killed = True
            time.sleep(1.0)
        workers_end = requests.get(st.router_url + "/admin/workers", timeout=5).json()
        restarts = dict(st.restarts)
    records = result["r"].records
    ok = [r for r in records if r.status == OK]
    refused = [r for r in records if r.status in (429, 503) and not r.output_tokens]
    lost = [r for r in records if r not in ok and r not in refused]
    t_first = min(r.start for r in records)
    # Fault to next token: the longest inter-token gap of each stream that was
    # running when a worker was killed (its tokens resumed elsewhere).
    kill_times = [t for t, e in events if "worker" in e]  # (records' times count from the run's start too)
    gaps = sorted(max(r.itl) * 1e3 for r in ok if r.itl and any(r.start < k < r.end for k in kill_times))
    buckets: dict[int, list[float]] = {}
    for r in ok:
        if r.ttft is not None:
            buckets.setdefault(int((r.start - t_first) // BUCKET_S), []).append(r.ttft * 1e3)
    series = sorted(
        (b * BUCKET_S, sorted(v)[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]) for b, v in buckets.items()
    )
    lines = [
        common.header(
            "Soak",
            [
                "bench.scenarios.soak",
                "--minutes",
                f"{args.minutes:g}",
                "--rate",
                f"{args.rate:g}",
                "--kill-every",
                f"{args.kill_every:g}",
            ],
        ),
        f"{len(records)} requests ({args.rate:g} req/s, `mixed`, streamed through Envoy) over {duration:.0f} s; "
        f"events: {', '.join(f'{e} at {t:.0f} s' for t, e in events)}; restarts by the supervisor: {restarts}.\n",
        "| ok | refused (429/503 + Retry-After) | lost (admitted, then an error) | resumed streams |",
        "|---|---|---|---|",
        f"| {len(ok)} | {len(refused)} | {len(lost)} | {int(sum(resumed_lives))} |",
        "",
        (
            f"Streams running across a worker kill: {len(gaps)}; their longest inter-token gap (fault to "
            f"next token) p50 {gaps[len(gaps) // 2]:.0f} ms, "
            f"p99 {gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]:.0f} ms, "
            f"max {gaps[-1]:.0f} ms.\n"
        )
        if gaps
        else "",
        "| process | RSS first seen (MB) | RSS last seen (MB) | slope (MB/min, fit) | seen for (s) |",
        "|---|---|---|---|---|",
    ]
    for name, pts in sorted(rss.items()):
        if len(pts) >= 3:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            slope = statistics.linear_regression(xs, ys).slope * 60
            lines.append(f"| {name} | {ys[0]:.1f} | {ys[-1]:.1f} | {slope:+.2f} | {xs[-1] - xs[0]:.0f} |")
    lines.append(
        f"\nReserved tokens at the end: {sum(w['reserved_tokens'] for w in workers_end)}; "
        f"running: {sum(w['running'] for w in workers_end)}."
    )
    if lost:
        why: dict[str, int] = {}
        for r in lost:
            key = (r.error or f"status {r.status}")[:80]
            why[key] = why.get(key, 0) + 1
        lines.append("Lost, by error: " + "; ".join(f"{k} x{v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])))
    lines.append("\n![p99 TTFT over time](soak_ttft.png)")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "summary.md").write_text(text)
    common.save(out, "soak.json", {"series_p99_ttft_ms": series, "events": events, "rss": rss})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([s[0] for s in series], [s[1] for s in series], marker=".", label="p99 TTFT per 10 s")
    for t, e in events:
        ax.axvline(t, color="red" if "router" in e else "grey", linestyle=":", linewidth=1)
    ax.set_xlabel("s since start (dotted: a worker killed; red: the router)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "soak_ttft.png", dpi=110)
    return 0 if not lost else 1


if __name__ == "__main__":
    raise SystemExit(main())
