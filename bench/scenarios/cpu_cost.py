"""What weir's frontend costs in CPU next to ``vllm serve``'s own, under the same load.

The same tiny model and engine settings behind both (as ``versus_vllm``):

* vllm: ``vllm serve``'s API server process, and its engine (EngineCore + model worker);
* weir: Envoy -> router -> engine-worker process (AsyncLLM), and its engine.

Per round and rate, ``vllm bench serve`` (random dataset, ``--input-len``
tokens in, ``--output-len`` out, EOS ignored, streamed, Poisson at the
rate) runs against each server in turn, the first alternating by round.
Around each run the user+system CPU seconds of every process of each
server are read from ``/proc`` (by process group: each component is its
own group; vLLM's EngineCore and model worker by their process titles) and divided by the
requests served and by the tokens streamed.  The frontend is everything
but the engine: for vllm its API server; for weir the router, Envoy
and the worker process.  Reported per rate: CPU per request and per 1,000
streamed tokens by process, the frontend ratio weir / vllm, and TTFT /
TPOT p50 and p99 from ``vllm bench serve``'s own result -- the medians of
the rounds, each round's figures in the JSON -- and a bar chart.  Once,
after the warm-up, both servers' idle CPU per second (``--idle-s``): at a
low rate the timers of an idle server are part of its CPU per request.

``--pin-engine`` gives both servers' engine processes the last CPU and
everything else (the frontends, this scenario and its ``vllm bench serve``)
the others, set per thread after the warm-up: the topology of a GPU host,
where the engine's busy loop has a core of its own, instead of an engine
that spins on the cores the frontend wakes on.

With several output lengths (``--output-len 4,128``) each rate runs at each,
and a least-squares line through the medians splits every process's CPU per
request into a fixed part (per request, idle share included) and a part per
streamed token: where a frontend's cost grows with the output and where it
does not.

    python -m bench.scenarios.cpu_cost [--rates 5,20] [-n 400] [--rounds 3] [--output-len 32] [--pin-engine]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench.scenarios import common
from bench.scenarios.versus_vllm import start_vllm_server, stop_group, wait_ready

SERVERS = ("vllm", "weir")
FRONTEND = {"vllm": ("api_server",), "weir": ("router", "envoy", "worker")}
TIMING = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def _members(groups: dict[str, int]) -> Iterator[tuple[psutil.Process, str]]:
    """Each live process of the groups (by process group) with its role:
    its group's, or ``engine`` for vLLM's engine processes whatever group
    they are in -- vLLM titles its EngineCore and the model's worker process
    it spawns (on CPU too) "VLLM::EngineCore" / "VLLM::Worker"."""
    role_of = {pgid: role for role, pgid in groups.items()}
    for p in psutil.process_iter(["pid", "name"]):
        try:
            role = role_of.get(os.getpgid(p.pid))
        except ProcessLookupError:
            continue  # (exited since the listing)
        if role is not None:
            yield p, "engine" if (p.info["name"] or "").startswith("VLLM::") else role


def group_cpu(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, the processes' own) by role (``_members``)."""
    out: dict[str, float] = {role: 0.0 for role in groups} | {"engine": 0.0}
    for p, role in _members(groups):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue  # (exited between the listing and the read)
        out[role] += t.user + t.system
    return out


def pin_engine(groups: dict[str, int], engine_cpus: set[int], other_cpus: set[int]) -> None:
    """Every thread of the groups' processes onto ``engine_cpus`` (vLLM's
    engine processes) or ``other_cpus`` (the rest); threads started later
    inherit their creator's set."""
    for p, role in _members(groups):
        try:
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                os.sched_setaffinity(int(tid), engine_cpus if role == "engine" else other_cpus)
        except OSError:
            continue  # (exited meanwhile)


def idle_cpu(servers: dict[str, tuple[str, dict[str, int]]], seconds: float) -> dict[str, dict[str, float]]:
    """CPU ms per second of each server's processes with no request in flight
    (heartbeats, health checks, stats timers): both servers over one window.
    At a low rate this is a visible part of the CPU per request."""
    time.sleep(2.0)  # the warm-up's last streams and their logging settle
    before = {s: group_cpu(groups) for s, (_, groups) in servers.items()}
    time.sleep(seconds)
    after = {s: group_cpu(groups) for s, (_, groups) in servers.items()}
    idle = {s: {role: 1e3 * (after[s][role] - before[s][role]) / seconds for role in after[s]} for s in servers}
    print(f"[cpu_cost] idle over {seconds:g} s, CPU ms per second: {idle}", file=sys.stderr)
    return idle


def vllm_bench(
    base_url: str, out: Path, label: str, args: argparse.Namespace, rate: float, output_len: int | None = None
) -> dict[str, Any]:
    """One ``vllm bench serve`` run of this scenario's load at ``rate``
    (``output_len`` tokens out; the first of ``--output-len`` if not given)."""
    olen = args.output_lens[0] if output_len is None else output_len
    return common.vllm_bench_serve(
        base_url,
        out,
        f"bench-{label}",
        [
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(olen),
            "--ignore-eos",
            "--num-prompts",
            str(args.num_prompts),
            "--request-rate",
            f"{rate:g}",
            "--seed",
            "7",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,99",
        ],
        timeout_s=1200,
        check=True,
    )


def measure(
    server: str,
    url: str,
    groups: dict[str, int],
    out: Path,
    label: str,
    args: argparse.Namespace,
    rate: float,
    output_len: int,
) -> dict[str, Any]:
    before = group_cpu(groups)
    res = vllm_bench(url, out, label, args, rate, output_len)
    after = group_cpu(groups)
    served, tokens = res["completed"], res["total_output_tokens"]
    cpu = {role: after[role] - before[role] for role in after}
    frontend = sum(cpu[r] for r in FRONTEND[server])
    row = {
        "server": server,
        "rate": rate,
        "output_len": output_len,
        "completed": served,
        "failed": res["num_prompts"] - served,
        "output_tokens": tokens,
        "cpu_s": cpu,
        "frontend_cpu_s": frontend,
        "frontend_ms_per_request": 1e3 * frontend / max(1, served),
        "frontend_ms_per_1k_tokens": 1e6 * frontend / max(1, tokens),
    }
    row |= {k: res.get(k) for k in TIMING}
    print(
        f"[cpu_cost] {label}: frontend {row['frontend_ms_per_request']:.2f} ms/request, "
        f"TTFT p50 {row['median_ttft_ms']:.1f} ms, p99 {row['p99_ttft_ms']:.1f} ms; {cpu}",
        file=sys.stderr,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.cpu_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="20", help="comma-separated Poisson rates (req/s)")
    ap.add_argument("-n", "--num-prompts", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument(
        "--output-len",
        default="32",
        help="tokens out per request; a comma-separated list runs each and fits fixed + per-token CPU",
    )
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument(
        "--idle-s", type=float, default=20.0, help="seconds of idle CPU measured once after the warm-up (0: skip)"
    )
    ap.add_argument(
        "--pin-engine",
        action="store_true",
        help="both engines on the last CPU, everything else on the others (a GPU host's topology)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin_engine and len(cpus) < 2:
        ap.error("--pin-engine needs two or more CPUs")
    args.engine_cpu = cpus[-1]
    args.engine_env = dict(common.CPU_ENGINE_ENV)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    args.output_lens = [int(n) for n in str(args.output_len).split(",") if n.strip()]
    if not args.output_lens or min(args.output_lens) < 1:
        ap.error("--output-len: one or more positive token counts")
    out = args.out or common.results_dir("cpu-cost")
    cfg = common.write_config(
        out / "stack", workers=[common.vllm_worker(max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes)]
    )
    port = common.free_port()
    vllm_log = out / "vllm-server.log"
    rows: list[dict[str, Any]] = []
    proc = start_vllm_server(port, args, vllm_log)
    try:
        with common.stack(cfg, out / "stack" / "run") as st:
            wait_ready(proc, f"http://127.0.0.1:{port}/v1", vllm_log)
            comp = st.components
            worker = next(name for name in comp if name.startswith("worker"))
            servers = {
                "vllm": (f"http://127.0.0.1:{port}", {"api_server": proc.pid}),
                "weir": (
                    st.envoy_url,
                    {"router": comp["router"].pid, "envoy": comp["envoy"].pid, "worker": comp[worker].pid},
                ),
            }
            for s, (url, _) in servers.items():  # warm-up: the first requests compile and allocate
                vllm_bench(url, out, f"warm-up-{s}", argparse.Namespace(**{**vars(args), "num_prompts": 40}), 10.0)
            if args.pin_engine:
                for _, groups in servers.values():
                    pin_engine(groups, {cpus[-1]}, set(cpus[:-1]))
                os.sched_setaffinity(0, set(cpus[:-1]))  # and vllm bench serve, which inherits it
            idle = idle_cpu(servers, args.idle_s) if args.idle_s > 0 else {}
            for rnd in range(args.rounds):
                order = SERVERS if rnd % 2 == 0 else SERVERS[::-1]
                for rate in rates:
                    for olen in args.output_lens:
                        for s in order:
                            url, groups = servers[s]
                            tag = f"{s}-{rate:g}" + (f"-o{olen}" if len(args.output_lens) > 1 else "")
                            row = measure(s, url, groups, out, f"{tag}-r{rnd + 1}", args, rate, olen)
                            rows.append(row | {"round": rnd + 1})
    finally:
        stop_group(proc)
    lines = fits(rows)
    common.save(
        out,
        "cpu_cost.json",
        {
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
            "idle_ms_per_s": idle,
            "fits": lines,
        },
    )
    _report(out, rows, lines, rates, args, argv if argv is not None else sys.argv[1:], idle)
    return 0


ROLES = ("router", "envoy", "worker", "api_server", "engine")


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _per_request_ms(rows: list[dict[str, Any]], role: str) -> float:
    return 1e3 * statistics.median(r["cpu_s"].get(role, 0.0) / max(1, r["completed"]) for r in rows)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points (at
    least two distinct xs)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def fits(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate and server (with runs at two or more output lengths): each
    frontend process's CPU per request as fixed ms + us per streamed token,
    fitted through the medians at each length against the tokens actually
    streamed per request."""
    out: list[dict[str, Any]] = []
    for rate in sorted({r["rate"] for r in rows}):
        for s in SERVERS:
            by_len: dict[int, list[dict[str, Any]]] = {}
            for r in rows:
                if r["rate"] == rate and r["server"] == s:
                    by_len.setdefault(r["output_len"], []).append(r)
            if len(by_len) < 2:
                continue
            tokens = [
                statistics.median(r["output_tokens"] / max(1, r["completed"]) for r in rs) for rs in by_len.values()
            ]
            fit = {"rate": rate, "server": s}
            for role in (*FRONTEND[s], "frontend"):
                parts = FRONTEND[s] if role == "frontend" else (role,)
                ms = [sum(_per_request_ms(rs, x) for x in parts) for rs in by_len.values()]
                fixed, per_token = fit_line(tokens, ms)
                fit[role] = {"fixed_ms": fixed, "us_per_token": 1e3 * per_token}
            out.append(fit)
    return out


def _report(
    out: Path,
    rows: list[dict[str, Any]],
    lines: list[dict[str, Any]],
    rates: list[float],
    args: argparse.Namespace,
    argv: list[str],
    idle: dict[str, dict[str, float]],
) -> None:
    lens = args.output_lens
    md = [
        common.header("CPU per request: weir's frontend against vllm serve's", ["bench.scenarios.cpu_cost", *argv]),
        "",
        f"`vllm bench serve`, random dataset, {args.input_len} tokens in, {', '.join(map(str, lens))} out "
        f"(EOS ignored), streamed, {args.num_prompts} requests per run, Poisson; tiny-llama, max_num_seqs "
        f"{args.max_num_seqs}, {args.kv_cache_bytes >> 20} MiB KV, both engines alike.  Medians of {args.rounds} "
        "alternating rounds.  Frontend: vllm's API server; weir's router + Envoy + worker process.  CPU is user + "
        "system from /proc."
        + (
            f"  Pinned: both engines on CPU {args.engine_cpu}, everything else on the other CPUs."
            if args.pin_engine
            else ""
        )
        + "\n",
        "| rate | out | server | served | frontend ms / request | ms / 1k tokens | router | Envoy | worker "
        "| API server | engine (EngineCore + model worker) | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
        "|---" * 15 + "|",
    ]
    per_run: dict[tuple[float, int], dict[str, dict[str, float]]] = {}
    for rate in rates:
        for olen in lens:
            for s in SERVERS:
                rs = [r for r in rows if r["rate"] == rate and r["output_len"] == olen and r["server"] == s]
                n = {role: _per_request_ms(rs, role) for role in ROLES}
                m = {k: _median(rs, k) for k in ("frontend_ms_per_request", "frontend_ms_per_1k_tokens", *TIMING)}
                per_run.setdefault((rate, olen), {})[s] = m | n
                shown = (*FRONTEND[s], "engine")
                md.append(
                    f"| {rate:g} | {olen} | {s} | {sum(r['completed'] for r in rs)} / "
                    f"{sum(r['completed'] + r['failed'] for r in rs)} "
                    f"| {m['frontend_ms_per_request']:.2f} | {m['frontend_ms_per_1k_tokens']:.1f} | "
                    + " | ".join(f"{n[role]:.2f}" if role in shown else "-" for role in ROLES)
                    + f" | {m['median_ttft_ms']:.1f} | {m['p99_ttft_ms']:.1f} | {m['median_tpot_ms']:.2f} "
                    f"| {m['p99_tpot_ms']:.2f} |"
                )
    md += [
        "",
        "| rate | out | frontend CPU weir / vllm | TTFT p50 ratio | TTFT p99 ratio | TPOT p50 ratio |",
        "|---|---|---|---|---|---|",
    ]
    for (rate, olen), d in per_run.items():
        w, v = d["weir"], d["vllm"]
        md.append(
            f"| {rate:g} | {olen} | {w['frontend_ms_per_request'] / v['frontend_ms_per_request']:.2f} | "
            f"{w['median_ttft_ms'] / v['median_ttft_ms']:.2f} | {w['p99_ttft_ms'] / v['p99_ttft_ms']:.2f} | "
            f"{w['median_tpot_ms'] / v['median_tpot_ms']:.2f} |"
        )
    if lines:
        md += [
            "",
            "CPU per request as a line through the output lengths: fixed ms per request (idle share "
            "included) + µs per streamed token.",
            "",
            "| rate | server | frontend fixed ms | frontend µs / token | by process (fixed ms + µs / token) |",
            "|---|---|---|---|---|",
        ]
        for f in lines:
            parts = ", ".join(
                f"{role} {f[role]['fixed_ms']:.2f} + {f[role]['us_per_token']:.0f}" for role in FRONTEND[f["server"]]
            )
            md.append(
                f"| {f['rate']:g} | {f['server']} | {f['frontend']['fixed_ms']:.2f} | "
                f"{f['frontend']['us_per_token']:.0f} | {parts} |"
            )
    if idle:
        md += [
            "",
            f"Idle, no request in flight ({args.idle_s:g} s once after the warm-up), CPU ms per second:",
            "",
            "| server | frontend | " + " | ".join(FRONTEND["weir"] + FRONTEND["vllm"]) + " | engine |",
            "|---" * (3 + len(FRONTEND["weir"]) + len(FRONTEND["vllm"])) + "|",
        ]
        for s in SERVERS:
            d = idle[s]
            md.append(
                f"| {s} | {sum(d[r] for r in FRONTEND[s]):.1f} | "
                + " | ".join(f"{d[r]:.1f}" if r in d else "-" for r in FRONTEND["weir"] + FRONTEND["vllm"])
                + f" | {d['engine']:.1f} |"
            )
    _plot(out, per_run, len(lens) > 1)
    md += ["", "![CPU per request by process](cpu_cost.png)"]
    text = "\n".join(md) + "\n"
    (out / "README.md").write_text(text)
    print(text)
    print(f"results: {out}")


def _plot(out: Path, per_run: dict[tuple[float, int], dict[str, dict[str, float]]], show_len: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = ("api_server", "router", "envoy", "worker")
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * 2 * len(per_run)), 4))
    labels, bottoms = [], []
    for (rate, olen), d in per_run.items():
        for s in SERVERS:
            labels.append(f"{s}\n{rate:g} req/s" + (f"\n{olen} out" if show_len else ""))
            bottoms.append(d[s])
    base = [0.0] * len(labels)
    for role in roles:
        vals = [b.get(role, 0.0) if role in FRONTEND[lab.split()[0]] else 0.0 for b, lab in zip(bottoms, labels)]
        ax.bar(labels, vals, bottom=base, label=role)
        base = [x + y for x, y in zip(base, vals)]
    ax.set_ylabel("frontend CPU ms per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cpu_cost.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
