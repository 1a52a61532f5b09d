"""Router loop stall while a long prompt is admitted: what other streams feel.

A simulated model with a real tokenizer (tiny-llama's) and a 200k-token
context; a direct ZeroMQ client keeps one stream running and, every half
second, sends a completion with a ~32k-token prompt.  Reported: the running
stream's inter-token gaps while each long prompt is being admitted (from its
send to its answer) against the gaps in between, and how long tokenizing
that prompt takes in one thread here (what a router that tokenizes on its
event loop would stall for).

    python -m bench.scenarios.long_prompt [--rounds 10] [--tokens 32000]

``--pythonpath DIR`` runs the stack's processes from another checkout (e.g.
a ``git worktree`` of an older commit) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.scenarios import common

MODEL = common.LONG_MODEL
WORD = "word "  # two tokens of tiny-llama


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.long_prompt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32_000, help="approximate prompt tokens")
    common.checkout_options(ap)
    args = ap.parse_args(argv)
    common.use_checkout(args)
    from tokenizers import Tokenizer

    from shared.client import AsyncClient

    out = args.out or common.results_dir("long-prompt")
    text = WORD * (args.tokens // 2)
    tok = Tokenizer.from_file(str(common.TINY_MODEL_DIR / "tokenizer.json"))
    t0 = time.perf_counter()
    n_tokens = len(tok.encode(text).ids)
    tokenize_ms = (time.perf_counter() - t0) * 1e3
    cfg = common.write_long_context_config(
        out / "stack",
        8,
        {"kv_capacity_tokens": 1_000_000, "prefill_token_us": 0.2, "max_prefill_tokens": 8192},
    )

    async def scenario(frontend: str) -> tuple[list[float], list[tuple[float, float]]]:
        arrivals: list[float] = []
        windows: list[tuple[float, float]] = []
        async with AsyncClient(frontend) as c:
            warm = asyncio.Event()  # 100 tokens in: the stream runs steadily

            async def running():
                async for d in c.stream(MODEL, prompt="hello", max_tokens=100_000, ignore_eos=True):
                    if d.num_tokens:
                        arrivals.append(time.perf_counter())
                        if len(arrivals) == 100:
                            warm.set()

            run = asyncio.ensure_future(running())
            warmed = asyncio.ensure_future(warm.wait())
            await asyncio.wait([run, warmed], return_when=asyncio.FIRST_COMPLETED)
            if not warm.is_set():  # the stream ended (or failed) first: waiting on would hang
                warmed.cancel()
                run.result()
                raise RuntimeError(f"the stream ended after {len(arrivals)} tokens")
            await c.complete(MODEL, prompt=text, max_tokens=1)  # warm-up (chat engine imports etc.)
            for _ in range(args.rounds):
                await asyncio.sleep(0.5)
                start = time.perf_counter()
                await c.complete(MODEL, prompt=text, max_tokens=1)
                windows.append((start, time.perf_counter()))
            run.cancel()
        return arrivals, windows

    with common.stack(cfg, out / "stack" / "run") as st:
        arrivals, windows = asyncio.run(scenario(st.zmq_frontend))
    during, between = [], []
    for a, b in zip(arrivals, arrivals[1:]):
        (during if any(b >= s and a <= e for s, e in windows) else between).append((b - a) * 1e3)
    during.sort()
    between.sort()

    def q(xs, f):
        return xs[min(len(xs) - 1, int(len(xs) * f))]

    lines = [
        f"prompt: {n_tokens} tokens; tokenizing it in one thread here: {tokenize_ms:.1f} ms",
        f"{'gaps of the running stream':34s} {'n':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}",
        f"{'while a long prompt is admitted':34s} {len(during):6d} {statistics.median(during):8.2f} "
        f"{q(during, 0.99):8.2f} {during[-1]:8.2f}",
        f"{'otherwise':34s} {len(between):6d} {statistics.median(between):8.2f} "
        f"{q(between, 0.99):8.2f} {between[-1]:8.2f}",
        f"admission of the long prompt (send to answer), median: "
        f"{statistics.median((e - s) * 1e3 for s, e in windows):.1f} ms",
    ]
    print("\n".join(lines))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    common.save(
        out,
        "long_prompt.json",
        {"tokens": n_tokens, "tokenize_ms": tokenize_ms, "during_ms": during, "between_ms": between},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
