"""A burst of long agent prompts: is the tokenizer, not the router, the limit?
And do short requests still get their first token as fast?

A simulated model with a real tokenizer (tiny-llama's), a 200k-token
context and prefix caching (so the router hashes every prompt's blocks too),
through the router's ZeroMQ frontend.  ``--prompts`` (150) distinct prompts
of ``--kb`` (220) KB of text (~150k tokens each), all sent at once,
``max_tokens`` 4.  Reported:

  (a) tokenizing alone: the same prompts tokenized by a thread pool of the
      router's size (``tokenize_threads``: one per core here) in this
      process, before the stack starts -- prompts/s;
  (b) weir's admission throughput: prompts whose first token came back, per
      second from the burst's send to the last one's first token;
      b / a (goal >= 90 %: the tokenizer is the limit, not the router);
  (c) a short-request stream's TTFT (streamed completions of ~2 KB, so
      tokenized on a thread, sent open loop every ``--every`` s): p50 / p99
      alone, then during the burst (goal p99 <= 2x alone).

    python -m bench.scenarios.long_prompts_burst [--prompts 150] [--kb 220]

``--pythonpath DIR`` runs the stack's processes from another checkout (e.g.
a ``git worktree`` of an older commit) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import random
import statistics
import time

from bench.scenarios import common

MODEL = common.LONG_MODEL
WORDS = (
    "the agent reads a file calls a tool and writes code def return import class self value list dict "
    "error test router worker token prompt session cache block queue thread loop request response model"
).split()


def prompts(n: int, kb: int, seed: int = 7) -> list[str]:
    """``n`` distinct prompts of ``kb`` KB: words drawn at random, a unique first line."""
    rng = random.Random(seed)
    body = " ".join(rng.choice(WORDS) for _ in range(kb * 1000 // 4))
    return [(f"task {i}: " + body)[: kb * 1000] for i in range(n)]


def short_prompt(i: int) -> str:
    return f"request {i}: " + "summarise the last change to the router please " * 42  # ~2 KB: over the inline limit


def _q(xs: list[float], f: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * f))]


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads so far, by thread name (``tokenize_1`` -> ``tokenize``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # (a thread that just ended)
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        key = "loop" if tid == str(pid) else name.rstrip("0123456789").rstrip("_")
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def tokenize_alone(texts: list[str], threads: int) -> tuple[float, int, float]:
    """(seconds, mean tokens, CPU seconds) for ``texts`` tokenized by ``threads`` threads, as the router does."""
    from router.lifecycle.prompts import ModelPrompts

    mp = ModelPrompts(str(common.TINY_MODEL_DIR))
    mp.encode("warm up", True)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t0, c0 = time.perf_counter(), time.process_time()
        counts = [len(ids) for ids in pool.map(lambda t: mp.encode(t, True), texts)]
        return time.perf_counter() - t0, sum(counts) // len(counts), time.process_time() - c0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.scenarios.long_prompts_burst", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--prompts", type=int, default=150)
    ap.add_argument("--kb", type=int, default=220, help="KB of text per long prompt")
    ap.add_argument("--every", type=float, default=0.05, help="seconds between short requests")
    ap.add_argument("--alone", type=float, default=4.0, help="seconds of the short stream alone")
    ap.add_argument("--profile", type=float, default=0, help="py-spy the router for this many s of the burst")
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy binary (--profile)")
    common.checkout_options(ap)
    args = ap.parse_args(argv)
    common.use_checkout(args)
    from router.lifecycle.tokenizer_queue import pool_threads
    from shared.client import AsyncClient

    out = args.out or common.results_dir("long-prompts-burst")
    texts = prompts(args.prompts, args.kb)
    threads = pool_threads(0)[0]
    alone_s, mean_tokens, alone_cpu = tokenize_alone(texts, threads)
    print(f"tokenizing alone: {len(texts)} prompts (~{mean_tokens} tokens) on {threads} threads in {alone_s:.2f} s")
    cfg = common.write_long_context_config(
        out / "stack",
        256,
        # the simulated engine is never the limit: ~3 ms of prefill per prompt, room for all of them
        {
            "kv_capacity_tokens": 40_000_000,
            "prefill_token_us": 0.02,
            "max_prefill_tokens": 1_000_000,
            "step_fixed_ms": 1.0,
            "decode_token_us": 5.0,
            "admit_request_us": 50.0,
            "prefix_caching": True,
        },
    )

    with common.stack(cfg, out / "stack" / "run") as st:
        profile = None
        if args.profile:  # py-spy: the router's threads where they hold the GIL (sampled without pausing it)
            argv = [args.py_spy, "record", "--pid", str(st.components["router"].pid)]
            argv += ["--threads", "--gil", "--nonblocking", "--format", "raw", "--rate", "200"]
            argv += ["--duration", str(int(args.profile))]
            profile = (argv, out / "router-py-spy.txt")
        pids = {"router": st.components["router"].pid, "worker": st.components["worker:sim-long-0"].pid}
        pids["bench"] = os.getpid()
        res = asyncio.run(_run(st.zmq_frontend, texts, args, AsyncClient, profile, pids))
    # the same again once the stack is gone (the host is shared: its load moves)
    alone_s2, _, alone_cpu2 = tokenize_alone(texts, threads)
    print(f"tokenizing alone again: {alone_s2:.2f} s")
    alone_rate = 2 * len(texts) / (alone_s + alone_s2)
    b0, b1 = res["burst"]
    weir_rate = len(texts) / (b1 - b0)
    alone_ms = [(e - s) * 1e3 for s, e, _ in res["alone"]]
    during = [r for r in res["during"] if b0 <= r[0] <= b1]
    during_ms = [(e - s) * 1e3 for s, e, _ in during]

    def phases(rs: list) -> str:
        return ", ".join(
            f"{name} {1e3 * statistics.median(r[2][i] for r in rs):.1f} / {1e3 * _q([r[2][i] for r in rs], 0.99):.1f}"
            for i, name in enumerate(("tokenize", "queue", "prefill"))
        )

    long_p50 = statistics.median(e - b0 for _, e, _ in res["long"])
    lines = [
        f"{len(texts)} prompts of {args.kb} KB (~{mean_tokens} tokens of tiny-llama each); "
        f"tokenizer threads: {threads} (+1 for short prompts); {os.cpu_count()} CPUs",
        f"(a) tokenizing alone, {threads} threads: {alone_s:.2f} s before the stack, {alone_s2:.2f} s after: "
        f"{alone_rate:.2f} prompts/s; CPU {alone_cpu / len(texts) * 1e3:.0f} / {alone_cpu2 / len(texts) * 1e3:.0f} "
        "ms a prompt",
        f"(b) weir, send to the last first token: {b1 - b0:.2f} s, {weir_rate:.2f} prompts/s",
        f"    b / a = {100 * weir_rate / alone_rate:.1f} % (goal >= 90 %)",
        f"(c) short stream TTFT alone: n={len(alone_ms)} p50 {statistics.median(alone_ms):.1f} ms, "
        f"p99 {_q(alone_ms, 0.99):.1f} ms",
        f"    during the burst:        n={len(during_ms)} p50 {statistics.median(during_ms):.1f} ms, "
        f"p99 {_q(during_ms, 0.99):.1f} ms  (p99 ratio {_q(during_ms, 0.99) / _q(alone_ms, 0.99):.2f}x, goal <= 2x)",
        f"    the router's phases p50 / p99 ms, alone: {phases(res['alone'])}",
        f"    during the burst: {phases(during)}",
        f"    long prompts' first token after the send: p50 {long_p50:.2f} s",
        "CPU during the burst, ms a long prompt, by process/thread: "
        + ", ".join(f"{k} {v / len(texts) * 1e3:.1f}" for k, v in sorted(res["cpu"].items(), key=lambda kv: -kv[1])),
    ]
    print("\n".join(lines))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    common.save(
        out,
        "long_prompts_burst.json",
        {
            "threads": threads,
            "tokens": mean_tokens,
            "tokenize_alone_s": [alone_s, alone_s2],
            "tokenize_alone_cpu_s": [alone_cpu, alone_cpu2],
            "cpu_during_burst_s": res["cpu"],
            "weir_s": b1 - b0,
            "alone_ms": alone_ms,
            "during_ms": during_ms,
            "long_first_token_s": [e - b0 for _, e, _ in res["long"]],
            "alone_phases_s": [r[2] for r in res["alone"]],
            "during_phases_s": [r[2] for r in during],
        },
    )
    return 0


async def _run(frontend: str, texts: list[str], args: argparse.Namespace, client_cls, profile, pids) -> dict:
    async with client_cls(frontend) as c:

        async def ttft(prompt: str, max_tokens: int) -> tuple[float, float, tuple[float, float, float]]:
            """(sent, first token, the router's phases: tokenize, queue, prefill in s)."""
            t0 = time.perf_counter()
            async for d in c.stream(MODEL, prompt=prompt, max_tokens=max_tokens, ignore_eos=True):
                if d.num_tokens:
                    t = d.timing
                    return t0, time.perf_counter(), (t.tokenize, t.queue, t.prefill) if t else (0.0, 0.0, 0.0)
            raise RuntimeError("no token")

        await ttft(texts[0][:4000], 1)  # warm-up: a short-lane and a long-lane prompt
        await ttft("task warm: " + texts[0][12:], 1)
        results: list[tuple[float, float, tuple[float, float, float]]] = []

        async def one(i: int) -> None:
            results.append(await ttft(short_prompt(i), 4))

        async def short_stream(until: asyncio.Event | float, first: int) -> list:
            results.clear()
            tasks = []
            start = time.perf_counter()
            i = first
            while not (until.is_set() if isinstance(until, asyncio.Event) else time.perf_counter() - start >= until):
                tasks.append(asyncio.ensure_future(one(i)))
                i += 1
                await asyncio.sleep(args.every)
            await asyncio.gather(*tasks)
            return list(results)

        alone = await short_stream(args.alone, 0)
        over = asyncio.Event()
        stream = asyncio.ensure_future(short_stream(over, 100_000))
        await asyncio.sleep(0.2)  # the stream runs before the burst starts
        if profile is not None:
            spy = await asyncio.create_subprocess_exec(
                *profile[0], "-o", str(profile[1]), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
        cpu0 = {name: cpu_by_thread(pid) for name, pid in pids.items()}
        b0 = time.perf_counter()
        long_times = await asyncio.gather(*(ttft(t, 4) for t in texts))
        cpu1 = {name: cpu_by_thread(pid) for name, pid in pids.items()}
        cpu = {
            f"{name}/{t}": cpu1[name][t] - cpu0[name].get(t, 0.0)
            for name in pids
            for t in cpu1[name]
            if cpu1[name][t] - cpu0[name].get(t, 0.0) >= 0.05
        }
        over.set()
        during = await stream
        if profile is not None:
            await spy.wait()
        b1 = max(e for _, e, _ in long_times)
        return {"alone": alone, "burst": (b0, b1), "long": long_times, "during": during, "cpu": cpu}


if __name__ == "__main__":
    raise SystemExit(main())
