"""Adapter churn on the real tiny model: LoRA adapter loads and TTFT per placement.

``--adapters`` LoRA adapters of tiny-llama (deploy/make_adapter.py, seeds
1..N) on ``--workers`` real vLLM workers (CPU build) whose engines hold
``--max-loras`` adapters each (``max_cpu_loras`` the same: an adapter not in
a slot is loaded from disk, evicting the least recently used).  Requests
arrive at ``--rate`` per second (Poisson), each naming an adapter of Zipf
popularity (s = 1: the first is asked twice as often as the second ...),
a short random prompt and ``--max-tokens`` output tokens.  The same seeded
requests for each placement:

* ``adapter_aware``: weir's default (least loaded, plus the adapter bonus:
  router/policy/adapter_placement.py),
* ``least_loaded``: the same, adapter-blind (``scheduler.adapter_affinity = false``),
* ``round_robin``: the next worker in turn, adapter-blind.

Reported per placement: adapter loads per 1,000 requests (the router's
``weir_adapter_loads_total``: dispatches to a worker whose heartbeats did
not report the adapter held or on its way), evictions, and TTFT p50/p90/p99
(the ZeroMQ client's, from the submit to the first token).

    python -m bench.scenarios.adapter_churn [--requests 240] [--rate 6] [--placements adapter_aware,...]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
from pathlib import Path
from typing import Any

import requests

from bench.scenarios import common

# The placements compared (scheduler overrides), as simulation.agents_des.PLACEMENTS names its own.
PLACEMENTS: dict[str, dict[str, Any]] = {
    "adapter_aware": {"adapter_affinity": True},
    "least_loaded": {"adapter_affinity": False},
    "round_robin": {"adapter_affinity": False, "placement": "round_robin"},
}


def make_requests(n: int, adapters: int, rate: float, seed: int) -> list[tuple[float, int, str]]:
    """(send at, adapter index, prompt) per request: Poisson arrivals, Zipf adapters."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(adapters)]
    at, out = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.randint(4, 12)))
        out.append((at, rng.choices(range(adapters), weights)[0], words))
    return out


async def drive(frontend: str, names: list[str], reqs: list[tuple[float, int, str]], max_tokens: int) -> list[dict]:
    from shared.client import AsyncClient

    out: list[dict] = []
    async with AsyncClient(frontend) as c:

        async def one(at: float, k: int, prompt: str) -> None:
            await asyncio.sleep(at)
            t0 = time.perf_counter()
            first = None
            try:
                async for d in c.stream(names[k], prompt=prompt, max_tokens=max_tokens, ignore_eos=True):
                    if first is None and d.num_tokens:
                        first = time.perf_counter()
            except Exception as e:  # a refusal counts as such, not as a latency
                out.append({"error": str(e)})
                return
            out.append({"ttft": first - t0} if first is not None else {"error": "no output"})

        await asyncio.gather(*(one(*r) for r in reqs))
    return out


def _counter(metrics_url: str, family: str) -> float:
    text = requests.get(metrics_url, timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{family}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * f))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.adapter_churn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=6)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from deploy.make_adapter import build_set

    out_dir = args.out or common.results_dir("adapter-churn")
    paths = build_set(str(out_dir / "lora"), str(common.TINY_MODEL_DIR), count=args.adapters, seed=1)
    names = [f"lora-{k + 1}" for k in range(args.adapters)]
    models = common.localconfig.models()
    models[0]["lora"] = {"max_loras": args.max_loras, "max_lora_rank": 8, "max_cpu_loras": args.max_loras}
    adapters = [{"name": n, "base": common.VLLM_MODEL, "path": str(p)} for n, p in zip(names, paths, strict=True)]
    workers = [common.vllm_worker(f"vllm-{i}", max_num_seqs=16, kv_cache_bytes=16 << 20) for i in range(args.workers)]
    reqs = make_requests(args.requests, args.adapters, args.rate, args.seed)
    rows = []
    for name in args.placements.split(","):
        d = out_dir / name
        cfg = common.write_config(
            d,
            models=models,
            adapters=adapters,
            workers=workers,
            router={"heartbeat_interval_s": 0.25},  # (the router's view of each engine's adapters: fresh)
            scheduler=PLACEMENTS[name],
        )
        with common.stack(cfg, d / "run") as st:
            loads0, evict0 = (
                _counter(st.metrics_url, f) for f in ("weir_adapter_loads_total", "weir_adapter_evictions_total")
            )
            res = asyncio.run(drive(st.zmq_frontend, names, reqs, args.max_tokens))
            time.sleep(1.0)  # (a last heartbeat: the evictions it reports)
            loads1, evict1 = (
                _counter(st.metrics_url, f) for f in ("weir_adapter_loads_total", "weir_adapter_evictions_total")
            )
        ok = [r["ttft"] for r in res if "ttft" in r]
        row = {
            "placement": name,
            "requests": len(res),
            "errors": len(res) - len(ok),
            "loads_per_1000": 1000.0 * (loads1 - loads0) / len(res),
            "evictions": evict1 - evict0,
            "ttft_p50_ms": q(ok, 0.5) * 1e3,
            "ttft_p90_ms": q(ok, 0.9) * 1e3,
            "ttft_p99_ms": q(ok, 0.99) * 1e3,
        }
        rows.append(row)
        print(row, flush=True)
    lines = [
        common.header(
            f"Adapter churn (tiny-llama on {args.workers} vLLM CPU workers)",
            ["bench.scenarios.adapter_churn", *(argv or [])],
        ),
        f"{args.adapters} adapters (rank 8, Zipf s = 1), max_loras = max_cpu_loras = {args.max_loras} per worker; "
        f"{args.requests} requests at {args.rate:g}/s (Poisson), {args.max_tokens} output tokens each.\n",
        "| placement | requests | adapter loads / 1,000 | evictions | TTFT p50 ms | p90 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['placement']} | {r['requests']} | {r['loads_per_1000']:.0f} | {r['evictions']:.0f} | "
            f"{r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['errors']} |"
        )
    print("\n".join(lines))
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    common.save(out_dir, "adapter_churn.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
