"""Agent replay: coding-agent sessions through a real stack, per placement.

Sessions of several turns, each turn's prompt everything before it (a
system prompt all agents share, the earlier turns' inputs and outputs) plus
its new input, sent a think time after the previous turn's answer; a share
of sessions fan out sub-agents from their parent's context, naming their
parent.  Every request names its session (``Submit.routing``, what the
session headers become over HTTP).  The same seeded sessions for each
placement:

* ``weir``: sessions + prefix affinity (the default scheduler),
* ``prefix_only``: prefix affinity, sessions off,
* ``least_loaded``: neither,
* ``round_robin``: the next worker in turn.

Reported per placement: TTFT p50/p90/p99 and the KV hit rate (cached /
prompt tokens, the engines' own counts).  The default run is short (a
minute or two on a shared 2-core machine: think times scaled by 0.2); the
simulation of the same workload at 16 and 64 workers is
``python -m simulation.agents_des``.

    python -m bench.scenarios.agent_replay [--engine sim|vllm] [--workers 2] [--sessions 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.scenarios import common
from shared import protocol as p
from simulation.agents_des import PLACEMENTS  # (the same four placements as the simulation compares)


@dataclass
class Turn:
    session: str
    parent: str
    prompt: str
    think_s: float
    next: Turn | None = None
    children: list[Turn] = field(default_factory=list)


def _words(rng: random.Random, tokens: int, scale: int) -> str:
    # the sim counts UTF-8 bytes / 4 (a word here ~2 tokens); the tiny model's tokenizer ~6 a word
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(max(1, tokens // (2 * scale))))


def make_sessions(
    n: int,
    seed: int,
    sim: bool,
    turns: tuple[int, int],
    think: tuple[float, float],
    system_tokens: int,
    input_tokens: tuple[int, int],
) -> list[tuple[float, Turn]]:
    """(start, first turn) per session, starts spread over ``n`` x 1.5 s."""
    rng = random.Random(seed)
    scale = 1 if sim else 3
    system = _words(rng, system_tokens, scale)

    def run(sid: str, parent: str, context: str, k_turns: int, fan_out: bool) -> Turn:
        first: Turn | None = None
        prev: Turn | None = None
        fan_at = rng.randrange(k_turns) if fan_out else -1
        ctx = context
        for k in range(k_turns):
            ctx = ctx + " " + _words(rng, rng.randint(*input_tokens), scale)
            turn = Turn(sid, parent, ctx, rng.uniform(*think) if k else 0.0)
            if k == fan_at:
                for c in range(rng.randint(2, 4)):
                    child = run(f"{sid}.{c}", sid, ctx, rng.randint(1, 3), False)
                    child.think_s = rng.uniform(0.0, 0.05)
                    turn.children.append(child)
            ctx = ctx + " " + _words(rng, rng.randint(32, 128), scale)  # what the agent wrote back
            if prev is None:
                first = turn
            else:
                prev.next = turn
            prev = turn
        assert first is not None
        return first

    return [
        (i * 1.5 * rng.random() + i * 0.75, run(f"s{i}-{seed}", "", system, rng.randint(*turns), rng.random() < 0.2))
        for i in range(n)
    ]


async def drive(frontend: str, model: str, starts: list[tuple[float, Turn]], max_tokens: int) -> list[dict]:
    from shared.client import AsyncClient

    out: list[dict] = []
    async with AsyncClient(frontend) as c:

        async def turn(t: Turn) -> None:
            await asyncio.sleep(t.think_s)
            t0 = time.perf_counter()
            first = last = None
            routing = p.Routing(session=t.session, parent_session=t.parent)
            try:
                async for d in c.stream(
                    model, prompt=t.prompt, max_tokens=max_tokens, ignore_eos=True, routing=routing
                ):
                    if first is None and d.num_tokens:
                        first = time.perf_counter()
                    last = d
            except Exception as e:  # a refusal counts as such, not as a latency
                out.append({"error": str(e)})
                return
            if first is None or last is None:
                out.append({"error": "no output"})
                return
            out.append({"ttft": first - t0, "prompt": last.prompt_tokens, "cached": last.cached_tokens})
            await asyncio.gather(*(session(x) for x in ([t.next] if t.next else []) + t.children))

        async def session(t: Turn) -> None:
            await turn(t)

        async def start(at: float, t: Turn) -> None:
            await asyncio.sleep(at)
            await session(t)

        await asyncio.gather(*(start(at, t) for at, t in starts))
    return out


def q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * f))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.agent_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, nargs=2, default=(3, 8), metavar=("MIN", "MAX"))
    ap.add_argument("--think-scale", type=float, default=0.2, help="think times of 1-10 s, times this")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--prefill-us",
        type=float,
        default=160.0,
        help="sim prefill cost per uncached token (us; 160: the tiny vLLM CPU worker's, bench/README.md)",
    )
    ap.add_argument("--kv-mib", type=int, default=16, help="vLLM workers' KV cache (MiB)")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sim = args.engine == "sim"
    out_dir = args.out or common.results_dir(f"agent-replay-{args.engine}")
    think = (1.0 * args.think_scale, 10.0 * args.think_scale)
    if sim:
        model = common.SIM_MODEL
        models = [{"name": model, "engine": "sim", "max_model_len": 32768}]  # sessions' contexts grow past 4,096
        workers = [
            common.sim_worker(
                f"sim-{i}",
                max_num_seqs=16,
                prefix_caching=True,
                prefill_token_us=args.prefill_us,
                kv_capacity_tokens=32768,
            )
            for i in range(args.workers)
        ]
        input_tokens = (128, 512)
    else:
        model = common.VLLM_MODEL
        models = common.localconfig.models(vllm_max_model_len=4096)
        workers = [
            common.vllm_worker(f"vllm-{i}", max_num_seqs=16, kv_cache_bytes=args.kv_mib << 20)
            for i in range(min(args.workers, 2))
        ]
        input_tokens = (32, 128)  # the tiny model's context is 4,096 tokens
    starts = make_sessions(args.sessions, args.seed, sim, tuple(args.turns), think, args.system_tokens, input_tokens)
    rows = []
    for name in args.placements.split(","):
        d = out_dir / name
        cfg = common.write_config(d, workers=workers, models=models, scheduler=PLACEMENTS[name])
        with common.stack(cfg, d / "run") as st:
            res = asyncio.run(drive(st.zmq_frontend, model, starts, args.max_tokens))
        ok = [r for r in res if "ttft" in r]
        prompt = sum(r["prompt"] for r in ok)
        row = {
            "placement": name,
            "requests": len(res),
            "errors": len(res) - len(ok),
            "ttft_p50_ms": q([r["ttft"] for r in ok], 0.5) * 1e3,
            "ttft_p90_ms": q([r["ttft"] for r in ok], 0.9) * 1e3,
            "ttft_p99_ms": q([r["ttft"] for r in ok], 0.99) * 1e3,
            "hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
        }
        rows.append(row)
        print(row, flush=True)
    lines = [
        common.header(
            f"Agent replay ({args.engine}, {len(workers)} workers)", ["bench.scenarios.agent_replay", *(argv or [])]
        ),
        f"{args.sessions} sessions of {args.turns[0]}-{args.turns[1]} turns, think {think[0]:g}-{think[1]:g} s, "
        f"20 % fanning out 2-4 sub-agents, {args.system_tokens}-token shared system prompt, "
        f"{args.max_tokens} output tokens{'; sim prefill %g us/token' % args.prefill_us if sim else ''}.\n",
        "| placement | requests | TTFT p50 ms | p90 ms | p99 ms | KV hit rate | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['placement']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
            f"{r['ttft_p99_ms']:.1f} | {r['hit_rate']:.2f} | {r['errors']} |"
        )
    print("\n".join(lines))
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    common.save(out_dir, "agent_replay.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
