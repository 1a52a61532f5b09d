"""weir versus ``vllm serve``: the same tiny model, the same workload, the
same engine settings, run alternately in one session.

* vllm: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``);
* weir: Envoy -> router -> vLLM engine worker (AsyncLLM in the worker process).

Both engines get the same max_num_seqs, KV budget, dtype, eager mode,
engine environment (default: weir's CPU engine environment, one unbound
OpenMP thread) and per-step stats (vLLM's default, on: weir's worker needs
them for its heartbeats, so ``vllm serve`` is not run with
``--disable-log-stats``).
Per round, each server gets a 1-token probe (sequential, not streamed) and
the ``tiny-llama`` workload (80 % short / 20 % long, streamed) at each rate;
which server goes first alternates by round.  Reported: median and p99 TTFT
and E2E per server and their ratios weir / vllm (< 1: weir is faster).

    python -m bench.scenarios.versus_vllm [--rates 5,20,60] [-n 150] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import spec
from bench.arrivals import Arrivals
from bench.metrics import summarise, summarise_run
from bench.plots import latency_cdf
from bench.runner import Limits
from bench.scenarios import common

SERVERS = ("vllm", "weir")


def start_vllm_server(
    port: int,
    args,
    log: Path,
    model_dir: Path = common.TINY_MODEL_DIR,
    name: str = common.VLLM_MODEL,
    extra: tuple[str, ...] = (),
    engine_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``vllm serve`` with the engine settings weir's worker gets in these benchmarks (``args``)."""
    argv = common.localconfig.vllm_serve_argv(
        model_dir,
        name,
        port,
        "--max-model-len", "512",
        "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
        "--dtype", "bfloat16",
        "--enforce-eager",
        *extra,
    )  # fmt: skip
    # (stats stay on, vLLM's default: weir's worker computes them too, for heartbeats)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(args.engine_env if engine_env is None else engine_env)}
    with open(log, "wb") as f:
        # Own process group: vLLM spawns an EngineCore (and more); stop them all.
        # The launcher's session, as weir's components (deploy/processes.py), so
        # both servers share one Linux autogroup with the client.
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=common.REPO, process_group=0)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited ({proc.returncode}); see {log}")
        try:
            with opener.open(url + "/models", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM server not ready in {timeout_s:.0f} s; see {log}")
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.versus_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="5,20,60", help="open-loop rates (req/s) of the tiny-llama workload")
    ap.add_argument("-n", "--num-requests", type=int, default=150, help="per server, rate and round")
    ap.add_argument("--probe", type=int, default=200, help="sequential 1-token requests per server and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--weir-path", choices=("envoy", "router"), default="envoy")
    ap.add_argument(
        "--engine-env",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="environment for both engines (repeat; replaces the default "
        f"{' '.join(f'{k}={v}' for k, v in common.CPU_ENGINE_ENV.items())})",
    )
    ap.add_argument(
        "--dispatch-lookahead",
        type=int,
        default=0,
        help="weir's scheduler.dispatch_lookahead (jobs a worker may hold beyond max_num_seqs)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    args.engine_env = (
        dict(kv.split("=", 1) for kv in args.engine_env) if args.engine_env is not None else dict(common.CPU_ENGINE_ENV)
    )

    out = args.out or common.results_dir("versus-vllm")
    workload = spec.load("tiny-llama")
    probe = spec.load("one-token")
    tok = str(common.TINY_MODEL_DIR)
    cfg = common.write_config(
        out / "stack",
        workers=[
            common.vllm_worker(max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes, env=args.engine_env)
        ],
        scheduler={"dispatch_lookahead": args.dispatch_lookahead},
    )
    port = common.free_port()
    vllm_url = f"http://127.0.0.1:{port}/v1"
    vllm_log = out / "vllm-server.log"
    runs: dict[tuple[str, str], list] = {}
    spans: dict[tuple[str, str], list[float]] = {}  # (server, rate) -> [elapsed_s, issue_s] summed over rounds
    proc = start_vllm_server(port, args, vllm_log)
    try:
        with common.stack(cfg, out / "stack" / "run") as st:
            wait_ready(proc, vllm_url, vllm_log)
            urls = {
                "vllm": ("openai", vllm_url),
                "weir": (args.weir_path, st.envoy_url if args.weir_path == "envoy" else st.router_url),
            }
            for s in SERVERS:  # warm-up: first requests compile/allocate
                kind, url = urls[s]
                common.bench(
                    workload,
                    kind,
                    url,
                    Arrivals(concurrency=4),
                    Limits(30, 60, 60),
                    label=f"warm-up {s}",
                    progress=False,
                    tokenizer=tok,
                )
            for rnd in range(args.rounds):
                order = SERVERS if rnd % 2 == 0 else SERVERS[::-1]
                for s in order:
                    kind, url = urls[s]
                    res = common.bench(
                        probe,
                        kind,
                        url,
                        Arrivals(concurrency=1),
                        Limits(args.probe, 120, 30),
                        label=f"{s} 1-token probe, round {rnd + 1}",
                        tokenizer=tok,
                        model=common.VLLM_MODEL,
                    )
                    runs.setdefault((s, "probe"), []).extend(res.records)
                for rate in rates:
                    for s in order:
                        kind, url = urls[s]
                        res = common.bench(
                            workload,
                            kind,
                            url,
                            Arrivals(rate=rate),
                            Limits(args.num_requests, 600, 120),
                            label=f"{s} @ {rate:g} req/s, round {rnd + 1}",
                            tokenizer=tok,
                        )
                        runs.setdefault((s, f"{rate:g}"), []).extend(res.records)
                        span = spans.setdefault((s, f"{rate:g}"), [0.0, 0.0])
                        span[0] += res.summary["elapsed_s"]
                        span[1] += res.summary["issue_s"]
    finally:
        stop_group(proc)
    _report(out, args, argv if argv is not None else sys.argv[1:], runs, spans, rates, workload)
    return 0


def _ratio(a, b, key, pct) -> str:
    if not a or not b or not a.get(key) or not b.get(key):
        return "-"
    return f"{a[key][pct] / b[key][pct]:.2f}"


def _ms(s, key, pct) -> str:
    return "-" if not s or not s.get(key) else f"{s[key][pct]:.2f}"


def _report(out: Path, args, argv, runs, spans, rates, workload) -> None:
    md = [
        common.header("weir vs vLLM's own server (tiny-llama on CPU)", ["bench.scenarios.versus_vllm", *argv]),
        "",
        f"max_num_seqs {args.max_num_seqs}, KV {args.kv_cache_bytes >> 20} MiB, bfloat16, eager, both engines; "
        f"engine env {args.engine_env or '(vLLM defaults)'}; "
        f"weir path: {args.weir_path} → router → vLLM worker, dispatch_lookahead {args.dispatch_lookahead}.  "
        f"{args.rounds} alternating rounds.  "
        "Ratios are weir / vllm (< 1 means weir is faster).\n",
    ]
    summaries = {}
    # 1-token probe
    pv, pw = (summarise(runs[(s, "probe")], None, 1, 0) for s in SERVERS)
    summaries["probe"] = {"vllm": pv, "weir": pw}
    md.append(f"## 1-token completions, sequential ({args.probe * args.rounds} per server)\n")
    md.append("| server | ok / sent | E2E p50 (ms) | E2E p99 (ms) |\n|---|---|---|---|")
    for s, x in (("vllm", pv), ("weir", pw)):
        md.append(f"| {s} | {x['ok']} / {x['sent']} | {_ms(x, 'e2e_ms', 'p50')} | {_ms(x, 'e2e_ms', 'p99')} |")
    md.append(f"| ratio | | {_ratio(pw, pv, 'e2e_ms', 'p50')} | {_ratio(pw, pv, 'e2e_ms', 'p99')} |\n")

    md.append("## tiny-llama workload, streamed (80 % short / 20 % long), Poisson arrivals\n")
    md.append(
        "| rate | class | server | ok / sent | out tok mean | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | "
        "TTFT p50 ratio | TTFT p99 ratio | E2E p50 ratio | E2E p99 ratio |"
    )
    md.append("|---" * 13 + "|")
    for rate in rates:
        key = f"{rate:g}"
        per = {}
        for s in SERVERS:
            elapsed, issued = spans[(s, key)]  # rounds' records are each relative to their run
            per[s] = summarise_run(runs[(s, key)], workload, issued, elapsed_s=elapsed)
        summaries[key] = per
        groups = ["overall"] + [c.name for c in workload.classes]
        for g in groups:
            sv = per["vllm"]["overall"] if g == "overall" else per["vllm"]["classes"].get(g)
            sw = per["weir"]["overall"] if g == "overall" else per["weir"]["classes"].get(g)
            for s, x in (("vllm", sv), ("weir", sw)):
                if x is None:
                    continue
                ratios = (
                    ["", "", "", ""]
                    if s == "vllm"
                    else [
                        _ratio(sw, sv, "ttft_ms", "p50"),
                        _ratio(sw, sv, "ttft_ms", "p99"),
                        _ratio(sw, sv, "e2e_ms", "p50"),
                        _ratio(sw, sv, "e2e_ms", "p99"),
                    ]
                )
                md.append(
                    f"| {key} | {g} | {s} | {x['ok']} / {x['sent']} | "
                    f"{x['output_tokens_mean'] or 0:.1f} | {_ms(x, 'ttft_ms', 'p50')} | {_ms(x, 'ttft_ms', 'p99')} | "
                    f"{_ms(x, 'e2e_ms', 'p50')} | {_ms(x, 'e2e_ms', 'p99')} | " + " | ".join(ratios) + " |"
                )
        latency_cdf(
            {s: runs[(s, key)] for s in SERVERS},
            out / f"versus_cdf_{key}rps.png",
            f"tiny-llama workload at {key} req/s: vLLM server vs weir",
        )
        md.append("")
    md += [f"![{r:g} req/s](versus_cdf_{r:g}rps.png)" for r in rates]
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text)
    common.save(out, "versus_vllm.json", summaries)
    print(text)
    print(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())
