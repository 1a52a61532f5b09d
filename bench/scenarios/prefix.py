"""Prefix-cache-aware routing: a shared-prefix workload and a no-sharing control.

Many tenants, each with a long system prompt, hold multi-turn conversations
(each turn's prompt = the tenant's system prompt + the conversation so far +
a new question); the control sends prompts of the same lengths that share
nothing.  Poisson arrivals at ``--rate`` through the direct ZeroMQ client,
the same seeded sequence for every placement:

* ``prefix``: weir's placement with prefix affinity (router/fleet/prefix_index.py),
* ``least_loaded``: weir's placement without it (weir before this issue),
* ``round_robin``: the next worker in turn.

Reported per (workload, placement): TTFT p50/p90/p99, output throughput,
prefix hit rate (cached / prompt tokens, the engines' own counts) and load
imbalance (max / mean prompt tokens served per worker).

    python -m bench.scenarios.prefix [--engine sim|vllm] [--workers 4] [--rate 10] [--duration 30]

``--engine sim`` (default): simulated workers with their prefix cache
(``prefix_caching``, calibrated against vLLM's CPU build: bench/README.md).
``--engine vllm``: two real tiny-model vLLM workers (the CPU build; keep the
rate low on a small machine).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time
from pathlib import Path

import requests

from bench.scenarios import common

PLACEMENTS = {
    "prefix": {"prefix_affinity": True},
    "least_loaded": {"prefix_affinity": False},
    "round_robin": {"prefix_affinity": False, "placement": "round_robin"},
}


def _text(rng: random.Random, tokens: int) -> str:
    # The sim counts UTF-8 bytes / 4 as tokens; the tiny model's tokenizer ~3 tokens a word like these.
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(max(1, tokens // 2)))


def make_requests(
    n: int, sharing: bool, tenants: int, system_tokens: int, turn_tokens: int, max_turns: int, seed: int, sim: bool
) -> list[str]:
    rng = random.Random(seed)
    scale = 1 if sim else 3  # sim: ~2 tokens per word of 8 bytes; vLLM's tokenizer: ~6
    systems = [_text(rng, system_tokens // scale) for _ in range(tenants)]
    convs: list[list[str]] = []  # per conversation: its turns so far
    prompts = []
    for _ in range(n):
        if not convs or rng.random() < 1.0 / max_turns or len(convs[-1]) >= max_turns:
            convs.append([])
        conv = rng.choice(convs[-tenants * 2 :])
        t = convs.index(conv) % tenants
        turn = _text(rng, turn_tokens // scale)
        history = " ".join(conv)
        conv.append(turn)
        prompt = systems[t] + " " + history + " " + turn
        if not sharing:  # same length, nothing in common
            prompt = _text(rng, len(prompt) // 8 * 2)
        prompts.append(prompt)
    return prompts


async def drive(frontend: str, model: str, prompts: list[str], rate: float, max_tokens: int, seed: int):
    from shared.client import AsyncClient

    rng = random.Random(seed + 1)
    out = []
    async with AsyncClient(frontend) as c:

        async def one(prompt: str, at: float):
            t0 = time.perf_counter()
            first = None
            last = None
            try:
                async for d in c.stream(model, prompt=prompt, max_tokens=max_tokens, ignore_eos=True):
                    if first is None and d.num_tokens:
                        first = time.perf_counter()
                    last = d
            except Exception as e:  # a refusal counts as such, not as a latency
                out.append({"error": str(e)})
                return
            if first is None or last is None:  # ended without a token (an engine error Delta)
                out.append({"error": getattr(getattr(last, "error", None), "message", "no output")})
                return
            out.append(
                {
                    "ttft": first - t0,
                    "end": time.perf_counter(),
                    "prompt": last.prompt_tokens,
                    "cached": last.cached_tokens,
                    "tokens": last.completion_tokens,
                }
            )

        tasks = []
        start = time.perf_counter()
        at = 0.0
        for prompt in prompts:
            at += rng.expovariate(rate)
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(prompt, at)))
        await asyncio.gather(*tasks)
    return out, start


def per_worker(metrics_url: str, name: str) -> dict[str, float]:
    got: dict[str, float] = {}
    for line in requests.get(metrics_url, timeout=5).text.splitlines():
        m = re.match(r"^" + name + r'\{model="[^"]*",worker="([^"]+)"\} ([0-9.e+]+)$', line)
        if m:
            got[m.group(1)] = float(m.group(2))
    return got


def q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * f))] if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument(
        "--prefill-us",
        type=float,
        default=160.0,
        help="sim prefill cost per token (us): 160 = what a cache hit saved per cached token on the "
        "real tiny vLLM CPU worker with the deployment's one OpenMP thread (bench/README.md)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workloads", default="shared,control")
    ap.add_argument(
        "--kv-mib", type=int, default=16, help="vLLM workers' KV cache (MiB; the tiny model: 2,048 tokens a MiB)"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sim = args.engine == "sim"
    out = args.out or common.results_dir(f"prefix-{args.engine}")
    n = int(args.rate * args.duration)
    if sim:
        model = common.SIM_MODEL
        workers = [
            common.sim_worker(f"sim-{i}", max_num_seqs=64, prefix_caching=True, prefill_token_us=args.prefill_us)
            for i in range(args.workers)
        ]
        models = None
    else:
        model = common.VLLM_MODEL
        workers = [
            common.vllm_worker(f"vllm-{i}", max_num_seqs=16, kv_cache_bytes=args.kv_mib << 20)
            for i in range(min(args.workers, 2))
        ]
        models = common.localconfig.models(vllm_max_model_len=4096)
    rows = []
    ttfts: dict[str, list[float]] = {}
    for sharing in [w == "shared" for w in args.workloads.split(",")]:
        prompts = make_requests(
            n, sharing, args.tenants, args.system_tokens, args.turn_tokens, args.max_turns, args.seed, sim
        )
        for name in args.placements.split(","):
            d = out / f"{'shared' if sharing else 'control'}-{name}"
            cfg = common.write_config(d, workers=workers, models=models, scheduler=PLACEMENTS[name])
            with common.stack(cfg, d / "run") as st:
                res, start = asyncio.run(drive(st.zmq_frontend, model, prompts, args.rate, args.max_tokens, args.seed))
                served = per_worker(st.metrics_url, "weir_prefix_prompt_tokens_total")
            ok = [r for r in res if "ttft" in r]
            span = max(r["end"] for r in ok) - start if ok else float("nan")
            prompt_total = sum(r["prompt"] for r in ok)
            loads = list(served.values()) or [0.0]
            row = {
                "workload": "shared-prefix" if sharing else "no-sharing",
                "placement": name,
                "requests": len(res),
                "errors": len(res) - len(ok),
                "ttft_p50_ms": q([r["ttft"] for r in ok], 0.5) * 1e3,
                "ttft_p90_ms": q([r["ttft"] for r in ok], 0.9) * 1e3,
                "ttft_p99_ms": q([r["ttft"] for r in ok], 0.99) * 1e3,
                "tokens_per_s": sum(r["tokens"] for r in ok) / span,
                "hit_rate": sum(r["cached"] for r in ok) / prompt_total if prompt_total else 0.0,
                "imbalance": max(loads) / statistics.mean(loads) if statistics.mean(loads) else float("nan"),
                "prompt_tokens_mean": prompt_total / max(1, len(ok)),
            }
            rows.append(row)
            ttfts[f"{row['workload']} {name}"] = [r["ttft"] * 1e3 for r in ok]
            print(row, flush=True)
    lines = [
        common.header(
            f"Prefix-aware routing ({args.engine}, {len(workers)} workers)", ["bench.scenarios.prefix", *(argv or [])]
        ),
        f"{n} requests per run at {args.rate:g} req/s (Poisson), "
        f"{'sim prefill %g us/token, ' % args.prefill_us if sim else ''}{args.tenants} tenants x "
        f"{args.system_tokens}-token system prompts, turns of {args.turn_tokens} tokens (up to "
        f"{args.max_turns} per conversation), {args.max_tokens} output tokens; shared 2-core machine.\n",
        "| workload | placement | TTFT p50 ms | p90 ms | p99 ms | output tok/s | hit rate | imbalance | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['placement']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
            f"{r['ttft_p99_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['hit_rate']:.2f} | "
            f"{r['imbalance']:.2f} | {r['errors']} |"
        )
    print("\n".join(lines))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    common.save(out, "prefix.json", {"rows": rows, "ttft_ms": ttfts})
    plot(ttfts, out / f"prefix_{args.engine}_ttft_cdf.png", f"TTFT, {args.engine} workers")
    return 0


def plot(series: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, xs in series.items():
        xs = sorted(xs)
        if xs:
            ax.step(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                where="post",
                label=name,
                linestyle="-" if name.startswith("shared") else ":",
            )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
