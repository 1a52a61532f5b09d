"""Big uploads beside live streams: does a burst of /v1/files uploads cost the router memory or its streams time?

    python -m bench.scenarios.uploads [--uploads 20] [--mib 50] [--rate 20] [--seconds 20]

One stack through Envoy on one sim worker.  A streamed chat load (Poisson at
``--rate`` req/s, ``--tokens`` tokens each) runs twice for ``--seconds``:
alone, then with ``--uploads`` concurrent uploads of a ``--mib`` MiB JSONL
file starting 2 s in: ``curl -F`` processes in one session of their own at
autogroup nice 19, so their CPU (reading and sending the file) stands for
other hosts' rather than the server's.  Reported:

* the router's RSS (``/proc/<pid>/status`` VmRSS, sampled every 50 ms)
  before the uploads, its peak while they run, and 10 s after the last one
  ended (goal: back within 50 MB of the start); Envoy's too;
* the streams' inter-token gaps (time between two content events of one
  stream, TTFT excluded): the worst and the p99 during the uploads against
  the same load alone (goal: within 50 ms of the worst alone), and the
  router's own answer time (a request straight to it every 20 ms);
* every upload's status and time, and that each stored file has the bytes sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from bench.httpclient import Pool
from bench.scenarios.common import SIM_MODEL, header, results_dir, sim_worker, stack, write_config

SIM = {"step_fixed_ms": 20.0, "decode_token_us": 60.0}
SLOTS = 128
MIB = 1 << 20


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _write_file(path: Path, mib: int) -> Path:
    line = json.dumps(
        {
            "custom_id": "doc-0000000",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": SIM_MODEL, "messages": [{"role": "user", "content": "x" * 200}]},
        }
    ).encode()
    n = mib * MIB
    with open(path, "wb") as f:
        block = (line + b"\n") * 1000
        while n > 0:
            f.write(block[:n])
            n -= min(n, len(block))
    return path


class Load:
    """Streamed chat requests at a Poisson rate until stopped; every content event's time per stream."""

    def __init__(self, url: str, rate: float, tokens: int) -> None:
        self.pool = Pool(url)
        self.rate = rate
        self.body = json.dumps(
            {
                "model": SIM_MODEL,
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": tokens,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()
        self.streams: list[list[float]] = []  # each stream's content-event times
        self.failed = 0
        self.stop = False

    async def _one(self) -> None:
        times: list[float] = []

        def on_event(data: bytes, t: float) -> None:
            if data != b"[DONE]" and b'"content"' in data:
                times.append(t)

        resp = await self.pool.post("/v1/chat/completions", self.body, on_event=on_event)
        if resp.status == 200:
            self.streams.append(times)
        else:
            self.failed += 1

    async def run(self) -> None:
        rng = random.Random(7)
        tasks = []
        while not self.stop:
            tasks.append(asyncio.create_task(self._one()))
            await asyncio.sleep(rng.expovariate(self.rate))
        await asyncio.gather(*tasks)
        await self.pool.close()

    def gaps(self, t0: float = 0.0, t1: float = float("inf")) -> list[float]:
        """Inter-token gaps (s) that ended within [t0, t1]."""
        out = []
        for times in self.streams:
            for a, b in zip(times, times[1:]):
                if t0 <= b <= t1:
                    out.append(b - a)
        return out


def _gap_stats(gaps: list[float]) -> dict[str, Any]:
    if len(gaps) < 2:  # (a window too short to say anything)
        nan = float("nan")
        return {"gaps": len(gaps), "p50_ms": nan, "p99_ms": nan, "p999_ms": nan, "worst_ms": nan}
    q = statistics.quantiles(gaps, n=1000)
    return {
        "gaps": len(gaps),
        "p50_ms": statistics.median(gaps) * 1e3,
        "p99_ms": q[989] * 1e3,
        "p999_ms": q[998] * 1e3,
        "worst_ms": max(gaps) * 1e3,
    }


async def _phase(s: Any, args: argparse.Namespace, upload_file: Path | None) -> dict[str, Any]:
    router_pid, envoy_pid = s.components["router"].pid, s.components["envoy"].pid
    load = Load(s.envoy_url, args.rate, args.tokens)
    rss: list[tuple[float, float, float]] = []  # (t, router, envoy)
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            rss.append((time.perf_counter(), _rss_mib(router_pid), _rss_mib(envoy_pid)))
            await asyncio.sleep(0.05)

    pings: list[tuple[float, float]] = []  # (t, seconds): the router's own answer time, Envoy not involved

    async def ping() -> None:
        pool = Pool(s.router_url)
        while not done.is_set():
            t = time.perf_counter()
            await pool.post("/health/live", b"")  # (a 405, answered on the router's event loop)
            pings.append((t, time.perf_counter() - t))
            await asyncio.sleep(0.02)
        await pool.close()

    sampler = asyncio.create_task(sample())
    pinger = asyncio.create_task(ping())
    runner = asyncio.create_task(load.run())
    await asyncio.sleep(2.0)
    rss_before = _rss_mib(router_pid)
    envoy_before = _rss_mib(envoy_pid)
    uploads: list[dict[str, Any]] = []
    t_up0 = time.perf_counter()
    if upload_file is not None:
        # The uploading clients in one session of their own: one scheduling group
        # (Linux autogroups) instead of twenty processes sharing the stack's group
        # with the router and Envoy.
        outs = [upload_file.parent / f"upload-{i}.out" for i in range(args.uploads)]
        curl = (
            "curl -sS -H 'Expect:' -o {out} -w '%{{http_code}} %{{time_total}}' -F purpose=batch "
            f"-F 'file=@{upload_file};type=application/jsonl' {s.envoy_url}/v1/files > {{out}}.w &"
        )
        # Its group at the lowest weight (autogroup nice 19): the clients' own CPU
        # (reading the file, sending it) stands in for other hosts', not the server's.
        script = "echo 19 > /proc/self/autogroup 2>/dev/null; " + " ".join(curl.format(out=o) for o in outs) + " wait"
        proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)  # noqa: ASYNC220 (polled below)
        while proc.poll() is None:  # noqa: ASYNC110 (a process, not a task)
            await asyncio.sleep(0.05)
        for o in outs:
            code, secs = (Path(f"{o}.w").read_text().split() + ["0", "0"])[:2]  # noqa: ASYNC240 (tiny, after)
            try:
                obj = json.loads(o.read_text())
            except (OSError, ValueError):
                obj = {}
            uploads.append(
                {
                    "status": int(code),
                    "seconds": float(secs),
                    "id": obj.get("id"),
                    "bytes": obj.get("bytes"),
                    "error": obj.get("error"),
                }
            )
    t_up1 = time.perf_counter()
    remaining = max(0.0, args.seconds - (t_up1 - t_up0))
    await asyncio.sleep(remaining)
    load.stop = True
    await runner
    t_after = time.perf_counter()
    if upload_file is not None:  # RSS --after-s (10 s) after the last upload ended
        await asyncio.sleep(max(0.0, args.after_s - (t_after - t_up1)))
    rss_after = _rss_mib(router_pid)
    done.set()
    await sampler
    await pinger
    window = [r for r in rss if t_up0 <= r[0] <= t_up1 + 0.5] or rss
    result: dict[str, Any] = {
        "streams": len(load.streams),
        "failed_streams": load.failed,
        "router_rss_before_mib": rss_before,
        "router_rss_peak_mib": max(r[1] for r in window),
        "router_rss_10s_after_mib": rss_after,
        "envoy_rss_before_mib": envoy_before,
        "envoy_rss_peak_mib": max(r[2] for r in window),
    }
    if upload_file is not None:
        result["uploads_s"] = t_up1 - t_up0
        result["uploads"] = uploads
        result["gaps_during_uploads"] = _gap_stats(load.gaps(t_up0, t_up1))
        result["router_ping_during_uploads"] = _gap_stats([d for t, d in pings if t_up0 <= t <= t_up1])
    result["gaps_all"] = _gap_stats(load.gaps())
    result["router_ping_all"] = _gap_stats([d for _, d in pings])
    return result


def _check_files(s: Any, uploads: list[dict[str, Any]], size: int) -> int:
    """Uploads stored with every byte: their size as listed and as downloaded (streamed)."""
    good = 0
    for u in uploads:
        if u["status"] != 200 or u["bytes"] != size:
            continue
        with requests.get(f"{s.envoy_url}/v1/files/{u['id']}/content", stream=True, timeout=120) as r:
            n = sum(len(c) for c in r.iter_content(1 << 20))
        good += n == size
    return good


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.uploads")
    ap.add_argument("--uploads", type=int, default=20)
    ap.add_argument("--mib", type=int, default=50, help="each upload's size (MiB)")
    ap.add_argument("--rate", type=float, default=20.0, help="streamed chat requests/s")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--seconds", type=float, default=20.0, help="each phase's load (at least the uploads' time)")
    ap.add_argument("--after-s", type=float, default=10.0, help="RSS this long after the last upload")
    ap.add_argument("--out", default="", help="results directory (default bench/results/uploads-<time>)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else results_dir("uploads")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="weir-uploads-bench-"))
    upload_file = _write_file(tmp / "upload.jsonl", args.mib)
    size = upload_file.stat().st_size
    cfg = write_config(
        tmp,
        workers=[sim_worker("sim-0", max_num_seqs=SLOTS, **SIM)],
        batch={"max_file_bytes": max(64 * MIB, size + MIB), "directory": str(tmp / "batches")},
    )
    report: dict[str, Any] = {"args": vars(args), "file_bytes": size}
    try:
        _run(cfg, tmp, args, upload_file, size, report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (the uploads: a GB and more)
    (out / "uploads.json").write_text(json.dumps(report, indent=1))
    text = _markdown(report, argv)
    (out / "README.md").write_text(text)
    print(text)
    return 0


def _run(cfg: Path, tmp: Path, args: argparse.Namespace, upload_file: Path, size: int, report: dict[str, Any]) -> None:
    with stack(cfg, tmp / "run") as s:
        asyncio.run(_warm(s))
        report["alone"] = asyncio.run(_phase(s, args, None))
        print("alone:", json.dumps(report["alone"]), file=sys.stderr)
        report["with_uploads"] = asyncio.run(_phase(s, args, upload_file))
        print(
            "with uploads:",
            json.dumps({k: v for k, v in report["with_uploads"].items() if k != "uploads"}),
            file=sys.stderr,
        )
        report["files_intact"] = _check_files(s, report["with_uploads"]["uploads"], size)


async def _warm(s: Any) -> None:
    load = Load(s.envoy_url, 10.0, 8)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(2.0)
    load.stop = True
    await task


def _markdown(r: dict[str, Any], argv: list[str] | None) -> str:
    a, b = r["alone"], r["with_uploads"]
    ok = sum(u["status"] == 200 for u in b["uploads"])
    ga, gb = a["gaps_all"], b["gaps_during_uploads"]
    secs = sorted(u["seconds"] for u in b["uploads"])
    return header("Uploads beside streams", ["bench.scenarios.uploads", *(argv or [])]) + (
        f"\n{r['args']['uploads']} concurrent uploads of {r['file_bytes'] / MIB:.0f} MiB through Envoy "
        f"({ok} answered 200, {r['files_intact']} downloaded back whole), in {b['uploads_s']:.1f} s "
        f"(each {secs[0]:.1f}-{secs[-1]:.1f} s), beside {r['args']['rate']:.0f} streamed chat requests/s of "
        f"{r['args']['tokens']} tokens on one sim worker.\n\n"
        f"| router RSS | before | peak during the uploads | {r['args']['after_s']:.0f} s after the last |\n"
        "|---|---|---|---|\n"
        f"| MiB | {b['router_rss_before_mib']:.0f} | {b['router_rss_peak_mib']:.0f} "
        f"| {b['router_rss_10s_after_mib']:.0f} "
        f"({b['router_rss_10s_after_mib'] - b['router_rss_before_mib']:+.0f}) |\n\n"
        f"Envoy RSS {b['envoy_rss_before_mib']:.0f} MiB before, {b['envoy_rss_peak_mib']:.0f} MiB at its peak "
        "(uploads stream through it unbuffered: deploy/envoy_config.py's /v1/files route).\n\n"
        "| inter-token gap | gaps | p50 | p99 | p99.9 | worst |\n|---|---|---|---|---|---|\n"
        f"| streams alone | {ga['gaps']} | {ga['p50_ms']:.1f} ms | {ga['p99_ms']:.1f} ms | {ga['p999_ms']:.1f} ms "
        f"| {ga['worst_ms']:.1f} ms |\n"
        f"| during the uploads | {gb['gaps']} | {gb['p50_ms']:.1f} ms | {gb['p99_ms']:.1f} ms "
        f"| {gb['p999_ms']:.1f} ms | {gb['worst_ms']:.1f} ms |\n\n"
        f"The router's own answer time (a request straight to it every 20 ms, Envoy not involved): worst "
        f"{a['router_ping_all']['worst_ms']:.1f} ms alone, {b['router_ping_during_uploads']['worst_ms']:.1f} ms "
        f"during the uploads (p99 {a['router_ping_all']['p99_ms']:.1f} / "
        f"{b['router_ping_during_uploads']['p99_ms']:.1f} ms).\n\n"
        f"Streams: {a['streams']} alone ({a['failed_streams']} failed), {b['streams']} with uploads "
        f"({b['failed_streams']} failed).\n"
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
