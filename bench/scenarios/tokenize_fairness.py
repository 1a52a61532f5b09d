"""Tokenizer fairness: a tenant's TTFT for long prompts while another tenant
floods /tokenize with 1 MiB texts.

A simulated model with a real tokenizer (tiny-llama's) and a 200k-token
context, through Envoy.  The quiet tenant sends a streamed completion with a
fresh ~8k-token prompt every ``--every`` seconds (open loop) and records its
TTFT (send to first token): first alone, then while the noisy tenant keeps
``--calls`` /tokenize calls of ~1 MiB each in flight (each of its loops sends
the next when the last is answered).  Reported: TTFT p50 / p90 / max in both
phases and their ratio (goal: p50 under load <= 1.2x alone), and the noisy
tenant's calls answered, refused (503 tokenizer_busy) and their latency.

    python -m bench.scenarios.tokenize_fairness [--requests 20] [--calls 32]

``--pythonpath DIR`` runs the stack's processes from another checkout (e.g.
/work/main) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from bench.scenarios import common
from shared.keys import digest

MODEL = common.LONG_MODEL
WORD = "word "  # two tokens of tiny-llama
KEY_QUIET, KEY_NOISY = "sk-bench-quiet-tok-00000000", "sk-bench-noisy-tok-11111111"


def _rev(checkout: str) -> str:
    got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return got.stdout.strip() or "?"


def _q(xs: list[float], f: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * f))]


async def _ttfts(url: str, text: str, n: int, every: float, tag: str) -> list[float]:
    """n streamed completions, one every ``every`` s (open loop): their TTFT in ms."""
    import httpx

    out: list[float] = []
    async with httpx.AsyncClient(timeout=300) as c:

        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": f"{tag} {i} " + text, "max_tokens": 4, "stream": True}
            t0 = time.perf_counter()
            async with c.stream(
                "POST", url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY_QUIET}"}
            ) as r:
                assert r.status_code == 200, await r.aread()
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):  # the first token's chunk
                        out.append((time.perf_counter() - t0) * 1e3)
                        break
                async for _ in lines:  # (the rest of the stream)
                    pass

        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(every)
        await asyncio.gather(*tasks)
    return out


async def _flood(url: str, text: str, calls: int, stop: asyncio.Event, stats: dict) -> None:
    import httpx

    body = {"model": MODEL, "prompt": text}
    limits = httpx.Limits(max_connections=calls + 4, max_keepalive_connections=calls + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:

        async def loop() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = await c.post(url + "/tokenize", json=body, headers={"authorization": f"Bearer {KEY_NOISY}"})
                except httpx.HTTPError:
                    stats["errors"] += 1
                    continue
                if r.status_code == 200:
                    stats["ok"] += 1
                    stats["ms"].append((time.perf_counter() - t0) * 1e3)
                else:
                    stats.setdefault(r.status_code, 0)
                    stats[r.status_code] += 1
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))

        tasks = [asyncio.ensure_future(loop()) for _ in range(calls)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.scenarios.tokenize_fairness", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--requests", type=int, default=20, help="quiet tenant's requests per phase")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between the quiet tenant's requests")
    ap.add_argument("--tokens", type=int, default=8000, help="approximate prompt tokens")
    ap.add_argument("--calls", type=int, default=32, help="noisy tenant's /tokenize calls in flight")
    ap.add_argument("--call-bytes", type=int, default=1_000_000, help="each call's text (Envoy's limit: 1 MiB)")
    common.checkout_options(ap)
    args = ap.parse_args(argv)
    common.use_checkout(args)
    import uvloop

    out = args.out or common.results_dir("tokenize-fairness")
    text = WORD * (args.tokens // 2)
    big = WORD * (args.call_bytes // len(WORD))
    cfg = common.write_long_context_config(
        out / "stack",
        16,
        {"kv_capacity_tokens": 1_000_000, "max_prefill_tokens": 8192},
        api_keys=[
            {"key_sha256": digest(KEY_QUIET), "tenant": "quiet"},
            {"key_sha256": digest(KEY_NOISY), "tenant": "noisy"},
        ],
    )

    async def scenario(url: str) -> tuple[list[float], list[float], dict]:
        await _ttfts(url, text, 3, 0.2, "warm")  # (first-use costs: template, imports)
        alone = await _ttfts(url, text, args.requests, args.every, "alone")
        stop = asyncio.Event()
        stats: dict = {"ok": 0, "errors": 0, "ms": []}
        flood = asyncio.ensure_future(_flood(url, big, args.calls, stop, stats))
        await asyncio.sleep(2.0)  # the calls are queued and running
        loaded = await _ttfts(url, text, args.requests, args.every, "loaded")
        stop.set()
        await flood
        return alone, loaded, stats

    with common.stack(cfg, out / "stack" / "run") as st:
        alone, loaded, stats = uvloop.run(scenario(st.envoy_url))
    ratio = statistics.median(loaded) / statistics.median(alone)
    refused = {k: v for k, v in stats.items() if isinstance(k, int)}
    lines = [
        common.header("Tokenizer fairness", ["bench.scenarios.tokenize_fairness", *(argv or sys.argv[1:])]),
        f"quiet tenant: {args.requests} streamed completions of ~{args.tokens} tokens, one every {args.every} s; "
        f"noisy tenant: {args.calls} /tokenize calls of {len(big)} bytes in flight"
        + (f"; stack from {args.pythonpath} (git {_rev(args.pythonpath)})" if args.pythonpath else ""),
        "",
        f"| {'quiet TTFT (ms)':30s} | {'p50':>8s} | {'p90':>8s} | {'max':>8s} |",
        "|---|---|---|---|",
        f"| {'alone':30s} | {statistics.median(alone):8.1f} | {_q(alone, 0.9):8.1f} | {max(alone):8.1f} |",
        f"| {'with the /tokenize flood':30s} | {statistics.median(loaded):8.1f} | {_q(loaded, 0.9):8.1f} | "
        f"{max(loaded):8.1f} |",
        "",
        f"p50 ratio: {ratio:.2f}x (goal <= 1.2x)",
        f"noisy calls answered: {stats['ok']}"
        + (f", median {statistics.median(stats['ms']):.0f} ms" if stats["ms"] else "")
        + f"; refused: {refused or 'none'}; transport errors: {stats['errors']}",
    ]
    print("\n".join(lines))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    common.save(
        out,
        "tokenize_fairness.json",
        {
            "alone_ms": alone,
            "loaded_ms": loaded,
            "ratio_p50": ratio,
            "noisy_ok": stats["ok"],
            "noisy_ms": stats["ms"],
            "noisy_refused": refused,
            "noisy_errors": stats["errors"],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
