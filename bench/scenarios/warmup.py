"""The first real request's latency on a fresh vLLM worker, with and without warm-up.

For each round, a stack with one vLLM worker on tiny-llama is started with
``warmup = true`` and then with ``warmup = false`` (alternating, so drift on
a shared machine hits both); once the stack is ready, the first request --
a streamed greedy 8-token completion through Envoy -- is timed (TTFT and
E2E), then ``--after`` more as the steady state.  Also how long the stack
took to become ready (the warm-up's cost).

    python -m bench.scenarios.warmup [--rounds 3] [--after 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from pathlib import Path

from bench.scenarios import common

PROMPT = "Hello there, how are you today? Tell me something."
MAX_TOKENS = 8


def _stream_once(url: str) -> tuple[float, float]:
    """(TTFT, E2E) in ms of one streamed completion on a fresh connection."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": common.VLLM_MODEL,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    ttft = None
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: {") and ttft is None:
            ttft = time.perf_counter() - t0
        if line.startswith(b"data: [DONE]"):
            break
    e2e = time.perf_counter() - t0
    conn.close()
    return ttft * 1e3, e2e * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.warmup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--after", type=int, default=5, help="requests after the first (steady state)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    out = args.out or common.results_dir("warmup")
    runs = {"warm": [], "cold": []}
    for rnd in range(args.rounds):
        for mode in ("warm", "cold"):
            d = out / f"{mode}-{rnd}"
            cfg = common.write_config(d, workers=[common.vllm_worker(kv_cache_bytes=16 << 20, warmup=mode == "warm")])
            t0 = time.perf_counter()
            with common.stack(cfg, d / "run") as st:
                ready_s = time.perf_counter() - t0
                first = _stream_once(st.envoy_url)
                after = [_stream_once(st.envoy_url) for _ in range(args.after)]
            runs[mode].append(
                {
                    "ready_s": ready_s,
                    "first_ttft_ms": first[0],
                    "first_e2e_ms": first[1],
                    "after_ttft_ms": statistics.median(a[0] for a in after),
                    "after_e2e_ms": statistics.median(a[1] for a in after),
                }
            )
            print(f"round {rnd} {mode}: {runs[mode][-1]}", flush=True)
    lines = [
        common.header(
            "Warm-up: first request on a fresh vLLM worker (tiny-llama)", ["bench.scenarios.warmup", *(argv or [])]
        ),
        "",
        "| | stack ready (s) | first TTFT (ms) | first E2E (ms) | steady TTFT p50 (ms) | steady E2E p50 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        lines.append(
            f"| warm-up {'on' if mode == 'warm' else 'off'} (median of {len(rs)}) | {med['ready_s']:.1f} | "
            f"{med['first_ttft_ms']:.1f} | {med['first_e2e_ms']:.1f} | {med['after_ttft_ms']:.1f} | "
            f"{med['after_e2e_ms']:.1f} |"
        )
    for mode, rs in runs.items():
        lines.append(f"\n{mode} first E2E per round (ms): " + ", ".join(f"{r['first_e2e_ms']:.1f}" for r in rs))
    summary = "\n".join(lines)
    print(summary)
    (out / "summary.md").write_text(summary + "\n")
    common.save(out, "warmup.json", runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
