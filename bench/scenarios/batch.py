"""The batch tier under interactive load: does a big batch cost interactive users anything?

    python -m bench.scenarios.batch [--seconds 40] [--rate 14] [--lines 10000] [--rss-lines 1000000]
    python -m bench.scenarios.batch --engine vllm --rate R   # the real tiny model; phases A and B only

One sim worker (16 slots, ~21 ms steps: ~24 requests/s of 32 tokens at
most), or (``--engine vllm``) one vLLM worker on the tiny model with 16
slots, requests ignoring EOS so every one costs its 32 tokens; its capacity
depends on the machine, so ``--rate`` is chosen from a first probe
(``--probe``: interactive load alone at several rates).

Phase A: interactive streams alone at ``--rate`` (Poisson, ~60 %% of
capacity).  Phase B: the same while a ``--lines`` batch runs.  Reported:
interactive TTFT p50/p99 in both, batch lines/s, and the engine's slot
utilisation (``weir_worker_running`` / slots, sampled every 0.25 s) --
with the share of what interactive traffic left that the batch used.
Then: router RSS before and after submitting a ``--rss-lines`` batch, and a
router SIGKILL mid-batch under supervision (lines lost / duplicated, time
until the batch runs again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from bench.httpclient import Pool
from bench.scenarios.common import (
    SIM_MODEL,
    VLLM_MODEL,
    header,
    results_dir,
    sim_worker,
    stack,
    vllm_worker,
    write_config,
)

SLOTS = 16
SIM = {"step_fixed_ms": 20.0, "decode_token_us": 60.0}
TOKENS = 32


MODEL = SIM_MODEL  # (--engine vllm: VLLM_MODEL)


def _line(i: int) -> bytes:
    body = {"model": MODEL, "prompt": f"document {i}: summarise it", "max_tokens": TOKENS, "ignore_eos": True}
    return json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/completions", "body": body}).encode()


def _write_batch(path: Path, n: int) -> Path:
    with open(path, "wb") as f:
        for start in range(0, n, 10_000):
            f.write(b"".join(_line(i) + b"\n" for i in range(start, min(n, start + 10_000))))
    return path


def _submit(base: str, path: Path, window: str = "24h") -> str:
    with open(path, "rb") as f:
        up = requests.post(base + "/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}, timeout=600)
    up.raise_for_status()
    b = requests.post(
        base + "/v1/batches",
        json={"input_file_id": up.json()["id"], "endpoint": "/v1/completions", "completion_window": window},
        timeout=30,
    )
    b.raise_for_status()
    return b.json()["id"]


def _batch(base: str, bid: str) -> dict:
    """The batch object; while no router answers (a restart), waits for one."""
    while True:
        try:
            got = requests.get(f"{base}/v1/batches/{bid}", timeout=30).json()
        except (requests.RequestException, ValueError):
            got = {}
        if "status" in got:
            return got
        time.sleep(0.05)


def _running(metrics_url: str) -> float:
    for line in requests.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("weir_worker_running{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _interactive(envoy: str, rate: float, seconds: float) -> list[float]:
    pool = Pool(envoy)
    ttfts: list[float] = []
    body = json.dumps(
        {"model": MODEL, "prompt": "hello there", "max_tokens": TOKENS, "stream": True, "ignore_eos": True}
    ).encode()
    rng = random.Random(7)

    async def one() -> None:
        t0 = time.perf_counter()
        first: list[float] = []

        def on_event(data: bytes, t: float) -> None:
            if not first and data != b"[DONE]":
                first.append(t)

        resp = await pool.post("/v1/completions", body, on_event=on_event)
        if resp.status == 200 and first:
            ttfts.append(first[0] - t0)

    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    await pool.close()
    return ttfts


def _phase(s: Any, rate: float, seconds: float) -> dict:
    samples: list[float] = []
    stop = time.monotonic() + seconds

    async def sampler() -> None:
        loop = asyncio.get_running_loop()
        while time.monotonic() < stop:
            samples.append(await loop.run_in_executor(None, _running, s.metrics_url))
            await asyncio.sleep(0.25)

    async def go() -> list[float]:
        t, _ = await asyncio.gather(_interactive(s.envoy_url, rate, seconds), sampler())
        return t

    ttfts = sorted(asyncio.run(go()))
    q = statistics.quantiles(ttfts, n=100)
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": q[49] * 1e3,
        "ttft_p99_ms": q[98] * 1e3,
        "slot_utilisation": statistics.mean(samples) / SLOTS,
    }


def _counter(metrics_url: str, name: str) -> float:
    for line in requests.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.batch")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rate", type=float, default=14.0, help="interactive requests/s (~60 %% of capacity)")
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--rss-lines", type=int, default=1_000_000)
    ap.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="vllm: the real tiny model; runs the two load phases only",
    )
    ap.add_argument("--probe", default="", help="comma-separated rates: interactive alone at each, then stop")
    ap.add_argument(
        "--priority-headroom",
        type=float,
        default=None,
        help="scheduler.priority_headroom: the share of a worker kept from the batch class",
    )
    args = ap.parse_args(argv)
    global MODEL
    vllm = args.engine == "vllm"
    if vllm:
        MODEL = VLLM_MODEL
    out = results_dir("batch-vllm" if vllm else "batch")
    tmp = Path(tempfile.mkdtemp(prefix="weir-batch-bench-"))
    report: dict[str, Any] = {"args": vars(args)}
    worker = vllm_worker(max_num_seqs=SLOTS) if vllm else sim_worker("sim-0", max_num_seqs=SLOTS, **SIM)
    cfg = write_config(
        tmp,
        workers=[worker],
        batch={"max_file_bytes": 1 << 30, "directory": str(tmp / "batches")},
        envoy={"max_request_bytes": 1 << 20},
        scheduler=None if args.priority_headroom is None else {"priority_headroom": args.priority_headroom},
    )
    with stack(cfg, tmp / "run") as s:
        if vllm:  # warm-up: the first requests compile and allocate
            _phase(s, 2.0, 5.0)
        if args.probe:
            for rate in (float(x) for x in args.probe.split(",")):
                print(f"probe {rate}/s:", _phase(s, rate, args.seconds), file=sys.stderr)
            return 0
        alone = _phase(s, args.rate, args.seconds)
        report["interactive_alone"] = alone
        print("alone:", alone, file=sys.stderr)
        bid = _submit(s.envoy_url, _write_batch(tmp / "batch.jsonl", args.lines))
        while _batch(s.envoy_url, bid)["status"] != "in_progress":
            time.sleep(0.2)
        time.sleep(2.0)
        before = _batch(s.envoy_url, bid)["request_counts"]
        t0 = time.monotonic()
        with_batch = _phase(s, args.rate, args.seconds)
        after = _batch(s.envoy_url, bid)["request_counts"]
        lines_s = (after["completed"] + after["failed"] - before["completed"] - before["failed"]) / (
            time.monotonic() - t0
        )
        with_batch["batch_lines_per_s"] = lines_s
        left = 1.0 - alone["slot_utilisation"]
        with_batch["batch_share_of_idle"] = (with_batch["slot_utilisation"] - alone["slot_utilisation"]) / left
        with_batch["preempted"] = _counter(s.metrics_url, "weir_batch_lines_preempted_total")
        report["interactive_with_batch"] = with_batch
        print("with batch:", with_batch, file=sys.stderr)
        requests.post(f"{s.envoy_url}/v1/batches/{bid}/cancel", timeout=30)
        while _batch(s.envoy_url, bid)["status"] != "cancelled":
            time.sleep(0.2)
        if vllm:  # memory and SIGKILL do not depend on the engine: the sim run measures them
            (out / "batch.json").write_text(json.dumps(report, indent=1))
            _markdown(out, report, argv)
            return 0
        # Router memory with a million-line batch submitted
        router_pid = s.components["router"].pid
        rss0 = _rss_kib(router_pid)
        big = _write_batch(tmp / "big.jsonl", args.rss_lines)
        t_up = time.monotonic()
        bid = _submit(s.envoy_url, big)
        upload_s = time.monotonic() - t_up
        while _batch(s.envoy_url, bid)["status"] != "in_progress":
            time.sleep(0.5)
        time.sleep(10.0)
        rss1 = _rss_kib(router_pid)
        counts = _batch(s.envoy_url, bid)["request_counts"]
        report["rss"] = {
            "lines": args.rss_lines,
            "file_mib": big.stat().st_size / 2**20,
            "upload_and_create_s": upload_s,
            "router_rss_before_mib": rss0 / 1024,
            "router_rss_running_mib": rss1 / 1024,
            "done_when_measured": counts["completed"] + counts["failed"],
        }
        print("rss:", report["rss"], file=sys.stderr)
        requests.post(f"{s.envoy_url}/v1/batches/{bid}/cancel", timeout=30)
        while _batch(s.envoy_url, bid)["status"] != "cancelled":
            time.sleep(0.5)
    (out / "batch.json").write_text(json.dumps(report, indent=1))  # (so far, should the next part fail)
    report["sigkill"] = _sigkill(tmp / "kill")
    print("sigkill:", report["sigkill"], file=sys.stderr)
    (out / "batch.json").write_text(json.dumps(report, indent=1))
    _markdown(out, report, argv)
    return 0


def _sigkill(tmp: Path, n: int = 2000) -> dict:
    from deploy.stack import Stack

    cfg = write_config(
        tmp,
        workers=[sim_worker("sim-0", max_num_seqs=SLOTS, step_fixed_ms=3.0)],
        batch={"directory": str(tmp / "batches"), "scan_interval_s": 0.2},
        router={"heartbeat_interval_s": 0.25},
    )
    with Stack(cfg, tmp / "run", supervise=True) as s:
        bid = _submit(s.envoy_url, _write_batch(tmp / "in.jsonl", n))
        while _batch(s.envoy_url, bid)["request_counts"]["completed"] < n // 4:
            time.sleep(0.05)
        s.components["router"].signal_group(signal.SIGKILL)
        t_kill = time.monotonic()
        before = None
        while True:
            got = _batch(s.envoy_url, bid)
            if before is None:
                before = got["request_counts"]["completed"]
            elif got["request_counts"]["completed"] > before:
                resumed_s = time.monotonic() - t_kill
                break
            time.sleep(0.05)
        while (got := _batch(s.envoy_url, bid))["status"] != "completed":
            time.sleep(0.2)
        out = requests.get(f"{s.envoy_url}/v1/files/{got['output_file_id']}/content", timeout=60).content
        ids = [json.loads(x)["custom_id"] for x in out.splitlines()]
    return {
        "lines": n,
        "lost": n - len(set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "kill_to_progress_s": resumed_s,
    }


def _markdown(out: Path, r: dict, argv: list[str] | None) -> None:
    a, b = r["interactive_alone"], r["interactive_with_batch"]
    text = header("Batch tier under interactive load", ["bench.scenarios.batch", *(argv or [])])
    text += (
        f"\n| | interactive TTFT p50 | p99 | slot utilisation | batch lines/s |\n|---|---|---|---|---|\n"
        f"| interactive alone ({a['requests']} req) | {a['ttft_p50_ms']:.1f} ms | {a['ttft_p99_ms']:.1f} ms "
        f"| {a['slot_utilisation']:.0%} | - |\n"
        f"| with a {r['args']['lines']:,}-line batch ({b['requests']} req) | {b['ttft_p50_ms']:.1f} ms "
        f"| {b['ttft_p99_ms']:.1f} ms | {b['slot_utilisation']:.0%} | {b['batch_lines_per_s']:.1f} |\n\n"
        f"p99 ratio {b['ttft_p99_ms'] / a['ttft_p99_ms']:.2f}x; the batch used {b['batch_share_of_idle']:.0%} "
        f"of the slots interactive traffic left ({b['preempted']:.0f} batch lines preempted for interactive work).\n\n"
    )
    if "rss" not in r:
        (out / "README.md").write_text(text)
        print(text)
        return
    m = r["rss"]
    text += (
        f"Router RSS: {m['router_rss_before_mib']:.0f} MiB before, {m['router_rss_running_mib']:.0f} MiB with a "
        f"{m['lines']:,}-line ({m['file_mib']:.0f} MiB) batch running; "
        f"upload + create {m['upload_and_create_s']:.1f} s.\n\n"
    )
    k = r["sigkill"]
    text += (
        f"Router SIGKILL mid-batch ({k['lines']} lines): {k['lost']} lost, {k['duplicated']} duplicated; "
        f"progress again {k['kill_to_progress_s']:.1f} s after the kill.\n"
    )
    (out / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
