"""Embeddings throughput: weir (Envoy -> router -> vLLM pooling worker) versus
``vllm serve`` on the same tiny embedding model (models/tiny-embed) with the
same engine settings, run alternately in one session.

Closed loop: ``--concurrency`` clients each send POST /v1/embeddings
back to back, ``--batch`` inputs per request (short sentences, ~10 tokens),
for ``--seconds`` per server and batch size.  Reported per server: inputs
embedded per second, requests per second, median and p99 request latency,
and whether both servers return the same vectors for the same inputs
(largest absolute difference).

    python -m bench.scenarios.embeddings [--batches 1,16] [--concurrency 16] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench.scenarios import common
from bench.scenarios.versus_vllm import start_vllm_server, stop_group, wait_ready

EMBED_DIR = common.REPO / "models" / "tiny-embed"
MODEL = "tiny-embed"
SERVERS = ("vllm", "weir")


def _inputs(batch: int, seq: int) -> list[str]:
    return [f"The quick brown fox number {seq * batch + i} jumps over the lazy dog." for i in range(batch)]


async def _closed_loop(url: str, batch: int, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:

        async def client(k: int) -> None:
            nonlocal errors
            seq = k * 1_000_000
            while time.perf_counter() < stop:
                seq += 1
                t0 = time.perf_counter()
                r = await c.post(
                    "/embeddings", json={"model": MODEL, "input": _inputs(batch, seq), "encoding_format": "base64"}
                )
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "requests": len(lat),
        "errors": errors,
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(lat) / elapsed, 1),
        "inputs_per_s": round(len(lat) * batch / elapsed, 1),
        "p50_ms": round(statistics.median(lat) * 1e3, 2) if lat else None,
        "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 2) if lat else None,
    }


def _vectors(url: str, texts: list[str]) -> np.ndarray:
    r = httpx.post(url + "/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "float"}, timeout=60)
    r.raise_for_status()
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.embeddings", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16", help="inputs per request, one run each")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10.0, help="per server and batch size")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-bytes", type=int, default=16 << 20)
    ap.add_argument(
        "--dispatch-lookahead",
        type=int,
        default=0,
        help="weir's scheduler.dispatch_lookahead (jobs a worker may hold beyond max_num_seqs)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    out = args.out or common.results_dir("embeddings")
    cfg = common.write_config(
        out / "stack",
        models=[{"name": MODEL, "engine": "vllm", "task": "embed", "path": str(EMBED_DIR), "max_model_len": 512}],
        workers=[
            {
                "id": "embed-0",
                "model": MODEL,
                "max_num_seqs": args.max_num_seqs,
                "kv_cache_bytes": args.kv_cache_bytes,
                "env": dict(common.CPU_ENGINE_ENV),
            }
        ],
        scheduler={"dispatch_lookahead": args.dispatch_lookahead},
    )
    port = common.free_port()
    vllm_url = f"http://127.0.0.1:{port}/v1"
    log = out / "vllm-server.log"
    results: dict[str, dict] = {}
    proc = start_vllm_server(port, args, log, EMBED_DIR, MODEL, ("--runner", "pooling"), common.CPU_ENGINE_ENV)
    try:
        with common.stack(cfg, out / "stack" / "run") as st:
            wait_ready(proc, vllm_url, log)
            urls = {"vllm": vllm_url, "weir": st.envoy_url + "/v1"}
            texts = _inputs(8, 0)
            diff = float(np.abs(_vectors(urls["vllm"], texts) - _vectors(urls["weir"], texts)).max())
            for s in SERVERS:  # warm-up
                asyncio.run(_closed_loop(urls[s], 4, 4, 1.0))
            for i, batch in enumerate(batches):
                for s in SERVERS if i % 2 == 0 else SERVERS[::-1]:
                    r = asyncio.run(_closed_loop(urls[s], batch, args.concurrency, args.seconds))
                    results[f"{s} batch={batch}"] = r
                    print(f"{s:5} batch={batch:3}: {r}", file=sys.stderr)
    finally:
        stop_group(proc)
    report = {
        "argv": argv if argv is not None else sys.argv[1:],
        "machine": os.uname().nodename,
        "max_abs_vector_difference": diff,
        "runs": results,
    }
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# Embeddings: weir vs vllm serve ({MODEL})",
        "",
        f"concurrency {args.concurrency}, {args.seconds:g} s per run, max_num_seqs {args.max_num_seqs}, "
        f"weir's dispatch_lookahead {args.dispatch_lookahead}; same vectors: max |diff| = {diff:.3g}",
        "",
        "| run | inputs/s | requests/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['inputs_per_s']} | {r['requests_per_s']} | {r['p50_ms']} | {r['p99_ms']} | {r['errors']} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
