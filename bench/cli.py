"""``weir bench``: send a workload to a target and report what it measured.

Examples::

    weir bench --workload short --target router --rate 200 -n 2000
    weir bench --workload mixed --target envoy --concurrency 32 -n 500 --duration 60
    weir bench --workload tiny-llama --target openai --url http://127.0.0.1:8000/v1 \\
        --tokenizer models/tiny-llama --rate 20 -n 200
    weir bench --workload short --target zmq --sweep-rates 1000,2000,4000 -n 4000
    weir bench client    # aiperf's shared-prefix and multi-turn workloads: vllm serve vs weir

Results go to ``--out`` (default ``bench/results/<time>-<label>/``):
``result.json`` (meta, summary, every request), ``summary.md``, ``cdf.png``;
a sweep adds ``sweep.json`` and ``latency_vs_load.png``.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from .arrivals import Arrivals
from .runner import Limits, RunResult, run_bench
from .spec import SpecError, Workload, load
from .targets import KINDS, make_target

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weir bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workload", "-w", default="smoke", help="TOML file, or a name in bench/workloads/ (default: smoke)"
    )
    p.add_argument("--target", "-t", choices=KINDS, default="router")
    p.add_argument(
        "--url",
        "--address",
        dest="url",
        help="base URL (http://host:port[/v1]) or ZeroMQ address; default for envoy/router/zmq: from --config",
    )
    p.add_argument(
        "--config", help="weir config to take default addresses from (default: $WEIR_CONFIG or deploy/weir.toml)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", "-r", type=float, help="open loop: mean arrivals per second ('inf': all at once)")
    g.add_argument("--concurrency", "-c", type=int, help="closed loop: requests kept in flight")
    g.add_argument("--sweep-rates", help="comma-separated open-loop rates, run one after another")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, <1 burstier")
    p.add_argument("--num-requests", "-n", type=int, default=100, help="requests per run (default 100)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds after which no request is sent (default 60)")
    p.add_argument("--drain", type=float, default=30.0, help="seconds in-flight requests get after the last send")
    p.add_argument("--warmup", type=int, default=0, help="requests sent sequentially and discarded first")
    p.add_argument("--model", help="override the workload's model name")
    p.add_argument("--api-key", help="for classes that set none")
    p.add_argument("--tokenizer", help="model dir or tokenizer.json: exact prompt lengths")
    p.add_argument("--connections", type=int, help="HTTP connections to open before starting")
    p.add_argument("--max-connections", type=int, default=4096)
    p.add_argument("--seed", type=int, help="override the workload's seed")
    p.add_argument("--label", help="name of this run in files and plots")
    p.add_argument("--out", type=Path, help="results directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-requests", action="store_true", help="leave per-request records out of result.json")
    p.add_argument("--allow-remote", action="store_true", help=argparse.SUPPRESS)
    return p


def _default_url(kind: str, config: str | None) -> str:
    from shared.config import load as load_config

    cfg = load_config(config)
    return {
        "envoy": f"http://{cfg.envoy.listen}",
        "router": f"http://{cfg.router.http}",
        "zmq": cfg.router.frontend,
    }[kind]


def _is_loopback(url: str) -> bool:
    if url.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _run_one(args, workload: Workload, url: str, arrivals: Arrivals, label: str) -> RunResult:
    target = make_target(args.target, url, args.api_key, args.max_connections)
    try:
        return await run_bench(
            workload,
            target,
            arrivals,
            Limits(args.num_requests, args.duration, args.drain, args.warmup),
            model=args.model,
            tokenizer=args.tokenizer,
            progress=not args.no_progress,
            connections=args.connections,
            label=label,
        )
    finally:
        await target.close()


def _save(res: RunResult, out: Path, plots: bool, with_requests: bool) -> dict:
    from . import report

    data = res.to_json(with_requests)
    report.write_json(out / "result.json", data)
    (out / "summary.md").write_text(
        f"# {res.meta['label']}\n\n{res.meta['target']}, {res.meta['arrivals']}, "
        f"{res.meta['started_at']}, {res.meta['machine']['cpus']} CPUs\n\n" + report.markdown_table(res.summary) + "\n"
    )
    if plots:
        from .plots import latency_cdf

        names = [c["name"] for c in res.meta["workload"]["classes"]]
        series = {n: rs for n in names if (rs := [r for r in res.records if r.cls == n])}
        latency_cdf(series, out / "cdf.png", f"{res.meta['label']}: {res.meta['target']}, {res.meta['arrivals']}")
    return data


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:  # an ecosystem client against weir and `vllm serve`: bench/ecosystem.py
        from .ecosystem import main as client_main

        return client_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        workload = load(args.workload)
    except SpecError as e:
        print(f"weir bench: {e}", file=sys.stderr)
        return 2
    if args.seed is not None:
        workload.seed = args.seed
    url = args.url
    if not url:
        if args.target == "openai":
            print("weir bench: --target openai needs --url (e.g. http://127.0.0.1:8000/v1)", file=sys.stderr)
            return 2
        url = _default_url(args.target, args.config)
    if not args.allow_remote and not _is_loopback(url):
        print(f"weir bench: {url} is not a loopback address; the benchmark only runs on loopback", file=sys.stderr)
        return 2
    if args.num_requests < 1 or args.duration <= 0:
        print("weir bench: --num-requests must be >= 1 and --duration > 0", file=sys.stderr)
        return 2
    if args.sweep_rates:
        try:
            rates = [float(x) for x in args.sweep_rates.split(",") if x.strip()]
        except ValueError:
            print(f"weir bench: bad --sweep-rates {args.sweep_rates!r}", file=sys.stderr)
            return 2
        runs = [Arrivals(rate=r, burstiness=args.burstiness) for r in rates]
    elif args.concurrency is not None:
        runs = [Arrivals(concurrency=args.concurrency)]
    else:
        runs = [Arrivals(rate=args.rate if args.rate is not None else math.inf, burstiness=args.burstiness)]

    label = args.label or f"{workload.name}-{args.target}"
    out = args.out or RESULTS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    import uvloop

    from . import report

    points = []
    any_ok = False
    for arr in runs:
        sub = out if len(runs) == 1 else out / f"rate-{arr.rate:g}"
        run_label = label if len(runs) == 1 else f"{label} @ {arr.rate:g} req/s"
        try:
            res = uvloop.run(_run_one(args, workload, url, arr, run_label))
        except ValueError as e:
            print(f"weir bench: {e}", file=sys.stderr)
            return 2
        data = _save(res, sub, not args.no_plots, not args.no_requests)
        print(report.text_report(data))
        print(f"results: {sub}\n")
        any_ok |= res.summary["overall"]["ok"] > 0
        points.append({"offered": arr.rate, "summary": res.summary})
    if len(runs) > 1:
        report.write_json(out / "sweep.json", {"label": label, "points": points})
        (out / "sweep.md").write_text(f"# {label}: sweep\n\n" + report.sweep_table(points) + "\n")
        print(report.sweep_table(points))
        if not args.no_plots:
            from .plots import latency_vs_load

            latency_vs_load({label: points}, out / "latency_vs_load.png", f"{label}: latency vs offered load")
        print(f"sweep results: {out}")
    # Exit 1 when nothing at all succeeded: the target was down or refused all.
    return 0 if any_ok else 1


if __name__ == "__main__":
    sys.exit(main())
