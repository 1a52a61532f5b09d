"""``weir bench client``: a benchmark client the field uses (NVIDIA's aiperf)
against ``vllm serve`` and against weir, the same workloads and settings.

aiperf lives in a venv of its own (``make bench-client`` makes it; this
command runs that target first), so its dependencies never touch vLLM's.
Each server is started alone on the tiny model with the same engine settings
as ``bench.scenarios.versus_vllm`` (one engine, max_num_seqs, KV budget,
bfloat16, eager, prefix caching on), the workloads are run against it, and it
is stopped before the next one starts: on a 2-core machine the two must not
share the CPUs while either is measured.  Workloads (aiperf's own synthetic
generators, streamed chat completions, EOS ignored):

* ``shared-prefix``: a pool of long prefix prompts, one prepended to each
  request's own prompt (``--num-prefix-prompts``), Poisson arrivals;
* ``multi-turn``: conversations whose turns carry the whole history, all
  behind one shared system prompt and each with its own user context, a
  think time between turns, a session id in ``X-Session-ID``.

The table comes from each run's own ``profile_export_aiperf.json``:
requests/s, TTFT p50/p90/p99, inter-token latency, errors.

    weir bench client [--servers vllm,weir] [--workloads shared-prefix,multi-turn] [--rate 10] ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bench.localconfig import CPU_ENGINE_ENV, REPO, TINY_MODEL_DIR, VLLM_MODEL

CLIENT = "aiperf"
VENV = REPO / ".venv-bench-client"
EXPORT = "profile_export_aiperf.json"  # aiperf's summary of one run
SERVERS = ("vllm", "weir")
WORKLOADS = ("shared-prefix", "multi-turn")
SESSION_HEADER = "X-Session-ID"  # vLLM's router's; weir reads it (docs/api.md)

# (column, aiperf metric tag, statistic): what the table shows of each run.
COLUMNS = (
    ("ISL mean", "input_sequence_length", "avg"),  # prompt tokens, history included
    ("req/s", "request_throughput", "avg"),
    ("out tok/s", "output_token_throughput", "avg"),
    ("TTFT p50", "time_to_first_token", "p50"),
    ("TTFT p90", "time_to_first_token", "p90"),
    ("TTFT p99", "time_to_first_token", "p99"),
    ("ITL p50", "inter_token_latency", "p50"),
    ("ITL p99", "inter_token_latency", "p99"),
    ("E2E p50", "request_latency", "p50"),
    ("E2E p99", "request_latency", "p99"),
)
RATIOS = ("TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "E2E p50")  # weir / vllm, lower is better


def workload_options(name: str, args: argparse.Namespace) -> list[str]:
    """aiperf's options for one workload: what it sends and at what load."""
    if name == "shared-prefix":
        return [
            "--num-prefix-prompts",
            str(args.prefixes),
            "--prefix-prompt-length",
            str(args.prefix_tokens),
            "--isl",
            str(args.isl),
            "--osl",
            str(args.osl),
            "--request-rate",
            f"{args.rate:g}",
            "--request-count",
            str(args.requests),
        ]
    if name == "multi-turn":
        return [
            "--shared-system-prompt-length",
            str(args.prefix_tokens // 2),
            "--user-context-prompt-length",
            str(args.user_context_tokens),
            "--num-dataset-entries",
            str(args.sessions),
            "--conversation-num",
            str(args.sessions),
            "--conversation-turn-mean",
            str(args.turns),
            "--conversation-turn-delay-mean",
            str(args.think_ms),
            "--isl",
            str(args.turn_isl),
            "--osl",
            str(args.turn_osl),
            "--concurrency",
            str(args.concurrency),
            "--session-header",
            SESSION_HEADER,
        ]
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def aiperf_argv(url: str, workload: str, artifacts: Path, args: argparse.Namespace) -> list[str]:
    """One ``aiperf profile`` run of ``workload`` against the base URL ``url``
    (aiperf appends /v1/chat/completions), its files in ``artifacts``."""
    return [
        str(VENV / "bin" / "aiperf"),
        "profile",
        "--url",
        url,
        "--model",
        VLLM_MODEL,
        "--tokenizer",
        str(TINY_MODEL_DIR.resolve()),  # an absolute local path: no hub
        "--endpoint-type",
        "chat",
        "--streaming",
        "--extra-inputs",
        '{"ignore_eos": true}',  # the tiny model's random weights stop anywhere: generate --osl tokens
        "--random-seed",
        str(args.seed),
        "--workers-max",
        str(args.client_workers),
        "--record-processors",
        "1",
        "--ui-type",
        "none",
        "--no-server-metrics",  # the same for both: nothing scraped beside the load
        "--no-gpu-telemetry",
        "--export-level",
        "summary",
        "--artifact-dir",
        str(artifacts),
        *(["--warmup-request-count", str(args.warmup)] if args.warmup > 0 else []),  # aiperf refuses 0
        *workload_options(workload, args),
    ]


def summarize(export: Mapping[str, Any]) -> dict[str, Any]:
    """One run's row from aiperf's ``profile_export_aiperf.json``: each
    COLUMNS statistic (None where the run has no such metric), requests and
    errors."""

    def stat(tag: str, key: str) -> float | None:
        m = export.get(tag)
        v = m.get(key) if isinstance(m, Mapping) else None
        return float(v) if isinstance(v, int | float) else None

    row: dict[str, Any] = {col: stat(tag, key) for col, tag, key in COLUMNS}
    row["requests"] = int(stat("request_count", "avg") or 0)
    # aiperf leaves the error count out when nothing failed; its error summary lists each kind with a count
    errors = stat("error_request_count", "avg")
    if errors is None:
        errors = sum(int(e.get("count", 0)) for e in export.get("error_summary") or [] if isinstance(e, Mapping))
    row["errors"] = int(errors)
    row["cancelled"] = bool(export.get("was_cancelled"))
    return row


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(rows: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """A markdown table, workload by workload: each server's row, then the
    ratio weir / vllm of the latencies where both ran (< 1: weir is faster).
    ``rows[workload][server]`` is a ``summarize`` row."""
    head = ["workload", "server", "ok", "errors", *(c for c, _, _ in COLUMNS)]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for workload, per in rows.items():
        for server, r in per.items():
            cells = [workload, server, str(r["requests"]), str(r["errors"]), *(_fmt(r[c]) for c, _, _ in COLUMNS)]
            out.append("| " + " | ".join(cells) + " |")
        w, v = per.get("weir"), per.get("vllm")
        if w is not None and v is not None:
            cells = [workload, "weir / vllm", "", ""]
            for c, _, _ in COLUMNS:
                cells.append(f"{w[c] / v[c]:.2f}" if c in RATIOS and w[c] is not None and v[c] else "")
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def ensure_client() -> str:
    """Install the client (``make bench-client``: a no-op once done) and
    return its version."""
    subprocess.run(["make", "-s", "bench-client"], cwd=REPO, check=True)
    code = f"import importlib.metadata as m; print(m.version({CLIENT!r}))"
    return subprocess.run(
        [str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def run_client(url: str, workload: str, artifacts: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One aiperf run; its summary row (its console output in ``aiperf.log``)."""
    artifacts.mkdir(parents=True, exist_ok=True)
    argv = aiperf_argv(url, workload, artifacts, args)
    (artifacts / "command.txt").write_text(" ".join(argv) + "\n")
    # aiperf's offline mode (HF_HUB_OFFLINE) looks even a local path up in the hub's cache and fails; an
    # absolute path is loaded from disk without it and never reaches the hub.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH")}
    env |= {"HF_HUB_DISABLE_TELEMETRY": "1", "NO_COLOR": "1"}
    print(f"[client] {workload}: aiperf against {url}", file=sys.stderr)
    with open(artifacts / "aiperf.log", "wb") as log:
        # Own process group: aiperf runs each of its services as a process; a timeout stops them all.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=artifacts, process_group=0)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"aiperf ran past {args.timeout:g} s; see {artifacts / 'aiperf.log'}") from None
    export = artifacts / EXPORT
    if not export.exists():
        raise RuntimeError(f"aiperf exited {rc} without {EXPORT}; see {artifacts / 'aiperf.log'}")
    return summarize(json.loads(export.read_text()))


@contextlib.contextmanager
def serving(server: str, out: Path, args: argparse.Namespace) -> Iterator[str]:
    """``server`` started alone on the tiny model; yields its base URL and
    stops it (every process of it) on leaving."""
    from bench.scenarios import common
    from bench.scenarios.versus_vllm import start_vllm_server, stop_group, wait_ready

    if server == "vllm":
        port = common.free_port()
        log = out / "vllm-server.log"
        proc = start_vllm_server(port, args, log)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/v1", log)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_group(proc)
    elif server == "weir":
        cfg = common.write_config(
            out / "stack",
            workers=[
                common.vllm_worker(
                    max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes, env=args.engine_env
                )
            ],
        )
        with common.stack(cfg, out / "stack" / "run") as st:
            yield st.envoy_url
    else:
        raise ValueError(f"unknown server {server!r}; known: {', '.join(SERVERS)}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="weir bench client",
        description=__doc__.split("\n\n")[0],
        epilog="docs: bench/README.md (weir bench client)",
    )
    ap.add_argument("--servers", default=",".join(SERVERS), help="in this order, one at a time")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    g = ap.add_argument_group("shared-prefix")
    g.add_argument("--prefixes", type=int, default=4, help="distinct prefix prompts")
    g.add_argument("--prefix-tokens", type=int, default=256, help="tokens per prefix (multi-turn: half, shared)")
    g.add_argument("--isl", type=int, default=64, help="tokens of each request's own prompt")
    g.add_argument("--osl", type=int, default=32, help="tokens generated per request")
    g.add_argument("--rate", type=float, default=10.0, help="Poisson arrivals, requests/s")
    g.add_argument("--requests", type=int, default=400)
    g = ap.add_argument_group("multi-turn")
    g.add_argument("--sessions", type=int, default=48)
    g.add_argument("--turns", type=int, default=4, help="turns per conversation")
    g.add_argument("--think-ms", type=int, default=500, help="mean delay between a reply and the next turn")
    g.add_argument("--user-context-tokens", type=int, default=32, help="each conversation's own context")
    g.add_argument("--turn-isl", type=int, default=32, help="tokens of each new user turn")
    g.add_argument("--turn-osl", type=int, default=24, help="tokens of each reply")
    g.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    g = ap.add_argument_group("both")
    g.add_argument("--warmup", type=int, default=10, help="requests aiperf sends first, not measured")
    g.add_argument("--seed", type=int, default=7)
    g.add_argument("--client-workers", type=int, default=2, help="aiperf's worker processes")
    g.add_argument("--timeout", type=float, default=600, help="seconds one aiperf run may take")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    g.add_argument("--out", type=Path, help="results directory (default bench/results/ecosystem-client-<time>/)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    for s in servers:
        if s not in SERVERS:
            print(f"weir bench client: unknown server {s!r}; known: {', '.join(SERVERS)}", file=sys.stderr)
            return 2
    for w in workloads:
        if w not in WORKLOADS:
            print(f"weir bench client: unknown workload {w!r}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
            return 2
    args.engine_env = dict(CPU_ENGINE_ENV)
    version = ensure_client()

    from bench.scenarios import common

    out = args.out or common.results_dir("ecosystem-client")
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in workloads}
    for server in servers:
        with serving(server, out, args) as url:
            for w in workloads:
                rows[w][server] = run_client(url, w, out / server / w, args)
    argv_shown = ["weir", "bench", "client", *(argv if argv is not None else sys.argv[1:])]
    text = (
        f"# {CLIENT} {version}: vllm serve vs weir (tiny-llama on CPU)\n\n`{' '.join(argv_shown)}`\n\n"
        f"Latencies in ms. Each server alone, one engine: max_num_seqs {args.max_num_seqs}, "
        f"KV {args.kv_cache_bytes >> 20} MiB, bfloat16, eager, prefix caching; weir through Envoy.\n\n"
        + table(rows)
        + "\n"
    )
    (out / "summary.md").write_text(text)
    common.save(out, "ecosystem_client.json", {"client": CLIENT, "version": version, "rows": rows})
    print(text)
    print(f"results: {out}")
    return 0 if all(r["requests"] > 0 for per in rows.values() for r in per.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
