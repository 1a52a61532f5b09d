"""Agent replay in the simulation: coding-agent sessions against the real
policy and simulated engines with their prefix cache, in virtual time.

A session is 3-20 turns; each turn's prompt is everything before it (a
system prompt all agents share, then every earlier turn's input and output)
plus its new input, sent a think time of 1-10 s after the previous turn's
last token (a closed loop, as an agent waits for its answer).  A share of
sessions fan out 2-4 sub-agents from a turn: each starts from its parent's
context at that point and runs 1-3 turns of its own, naming its parent.

The engines are simulation.driver's (engine_worker/sim_model.py) with
``prefix_caching``: their block stores and evictions reach each router's
prefix index as KV events do, one step after they happen; a dispatched
prompt's blocks are speculatively cached at once (router.policy).  Routers
see sessions only where ``scheduler.sessions`` is on.

    python -m simulation.agents_des [--workers 16] [--sessions-per-s 2] [--duration 120]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine_worker.sim_model import SimCore
from router.policy import Job
from shared.config import SchedulerConfig, SimEngineConfig
from shared.protocol import TaskType
from simulation.driver import MODEL, Driver, Kind, SimWorker

BLOCK = 16
_KIND = Kind("agent", 1.0, (1, 1), (1, 1))
_MASK = (1 << 63) - 1

# The placements compared: weir's (sessions + prefix affinity), prefix affinity alone, least loaded, round robin.
PLACEMENTS: dict[str, dict[str, Any]] = {
    "weir": {"sessions": True, "prefix_affinity": True},
    "prefix_only": {"sessions": False, "prefix_affinity": True},
    "least_loaded": {"sessions": False, "prefix_affinity": False},
    "round_robin": {"sessions": False, "prefix_affinity": False, "placement": "round_robin"},
}


@dataclass
class AgentTurn:
    job_id: str
    session: str
    parent: str
    blocks: list[int]  # the prompt's full blocks (its hashes)
    tokens: int  # prompt tokens
    max_tokens: int
    think_s: float  # after the previous turn's end (the session's first: its start)
    next: AgentTurn | None = None  # the session's next turn
    children: list[AgentTurn] = field(default_factory=list)  # sub-agents' first turns, sent with this one's end


@dataclass(frozen=True)
class AgentLoad:
    sessions_per_s: float = 2.0
    duration_s: float = 60.0  # sessions start within it
    turns: tuple[int, int] = (3, 20)
    think_s: tuple[float, float] = (1.0, 10.0)
    fan_out_share: float = 0.2
    sub_agents: tuple[int, int] = (2, 4)
    sub_turns: tuple[int, int] = (1, 3)
    system_tokens: int = 2048
    input_tokens: tuple[int, int] = (128, 1024)  # a turn's new input (tool results, the user's words)
    output_tokens: tuple[int, int] = (32, 256)
    seed: int = 1


def _chain(parent: int, salt: int, n: int) -> list[int]:
    out, h = [], parent
    for i in range(n):
        h = hash((h, salt, i)) & _MASK
        out.append(h)
    return out


def sessions(load: AgentLoad) -> list[tuple[float, AgentTurn]]:
    """Each session's start time and first turn (the rest linked from it)."""
    rng = random.Random(load.seed)
    system = _chain(1, 0, load.system_tokens // BLOCK)
    out: list[tuple[float, AgentTurn]] = []
    t = 0.0
    n = 0

    def run(sid: str, parent: str, context: list[int], turns: int, salt: int, fan_out: bool) -> AgentTurn:
        nonlocal n
        first: AgentTurn | None = None
        prev: AgentTurn | None = None
        ctx = list(context)
        fan_at = rng.randrange(turns) if fan_out else -1
        for k in range(turns):
            new = rng.randint(*load.input_tokens)
            ctx = ctx + _chain(ctx[-1] if ctx else 0, salt * 1000 + k, new // BLOCK)
            out_tokens = rng.randint(*load.output_tokens)
            n += 1
            turn = AgentTurn(
                f"a{n}",
                sid,
                parent,
                ctx,
                len(ctx) * BLOCK + new % BLOCK,
                out_tokens,
                rng.uniform(*load.think_s) if k else 0.0,
            )
            if k == fan_at:
                for c in range(rng.randint(*load.sub_agents)):
                    child = run(f"{sid}.{c}", sid, ctx, rng.randint(*load.sub_turns), salt * 100 + c + 1, False)
                    child.think_s = rng.uniform(0.0, 0.05)  # fanned out at once, a few ms apart
                    turn.children.append(child)
            # what it generates joins the context of its next turn
            ctx = ctx + _chain(ctx[-1], salt * 1000 + k + 500, out_tokens // BLOCK)
            if prev is None:
                first = turn
            else:
                prev.next = turn
            prev = turn
        assert first is not None
        return first

    i = 0
    while True:
        t += rng.expovariate(load.sessions_per_s)
        if t > load.duration_s:
            return out
        i += 1
        out.append((t, run(f"s{i}", "", system, rng.randint(*load.turns), i * 7919, rng.random() < load.fan_out_share)))


class _HashingCore:
    """A SimCore that names each prompt's blocks by its turn's hashes (the
    router sends them with the dispatch: GenerateRequest.block_hashes)."""

    def __init__(self, core: SimCore, turns: dict[str, AgentTurn]) -> None:
        self._core = core
        self._turns = turns

    def add(self, rid: str, prompt: int, max_tokens: int, priority: int = 0, block_hashes: Sequence[int] = ()) -> None:
        self._core.add(rid, prompt, max_tokens, priority, block_hashes=self._turns[rid].blocks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


class AgentDriver(Driver):
    """simulation.driver.Driver with turns that follow each other, block
    hashes and the engines' prefix events fed to every router's index."""

    def __init__(self, cfg: SchedulerConfig, workers: list[SimWorker], starts: list[tuple[float, AgentTurn]]) -> None:
        super().__init__(cfg, workers)
        self.turns: dict[str, AgentTurn] = {}
        stack = [t for _, t in starts]
        while stack:
            t = stack.pop()
            self.turns[t.job_id] = t
            if t.next is not None:
                stack.append(t.next)
            stack.extend(t.children)
        self.starts = starts
        self.cached: dict[str, int] = {}
        self.event_seq: dict[str, int] = {}
        for wid, eng in self.engines.items():
            eng.core = _HashingCore(eng.core, self.turns)  # type: ignore[assignment]
            eng.spec.prefix_hash = "sim"
            for p in self.routers:
                p.remove_worker(wid, 0.0)
                p.add_worker(eng.spec, 0.0)
                p.prefix.snapshot(wid, 0, [])
            self.event_seq[wid] = 0

    def replay(self, end: float) -> float:
        arrivals = [(t, _KIND, "t0", turn.tokens, turn.max_tokens) for t, turn in self.starts]
        # Driver.run names arrivals j<i>: map them to the sessions' first turns
        self._first = {f"j{i}": turn for i, (_, turn) in enumerate(self.starts)}
        return self.run(arrivals, end)

    def _arrive(self, data: tuple[str, Kind, str, int, int], now: float) -> None:
        job_id = data[0]
        turn = self._first.pop(job_id, None) or self.turns[job_id]
        super()._arrive((turn.job_id, data[1], data[2], turn.tokens, turn.max_tokens), now)

    def _submit_job(self, turn: AgentTurn, now: float) -> Job:
        return Job(
            turn.job_id,
            MODEL,
            "t0",
            "normal",
            turn.tokens,
            turn.max_tokens,
            TaskType.AUTO,
            now,
            block_hashes=turn.blocks,
            session=turn.session,
            parent_session=turn.parent,
        )

    def _step_ended(self, worker_id: str, now: float) -> None:
        eng = self.engines[worker_id]
        res = eng.pending
        assert res is not None
        if res.stored or res.removed:
            self.event_seq[worker_id] += 1
            for p in self.routers:
                p.prefix.events(worker_id, self.event_seq[worker_id], res.stored, res.removed)
        self.cached.update(res.cached)
        done = [rid for rid, _, fin in res.outputs if fin is not None]
        super()._step_ended(worker_id, now)
        for rid in done:
            turn = self.turns[rid]
            for nxt in ([turn.next] if turn.next is not None else []) + turn.children:
                self._push(now + nxt.think_s, 0, (nxt.job_id, _KIND, "t0", nxt.tokens, nxt.max_tokens))
                self._arrivals_left += 1


def _patch_submit(driver: AgentDriver) -> None:
    """Driver._arrive builds a plain Job; these carry hashes and sessions."""
    for p in driver.routers:
        submit = p.submit

        def with_turn(job: Job, now: float, *, requeue: bool = False, _submit: Callable[..., Any] = submit) -> Any:
            turn = driver.turns.get(job.job_id)
            if turn is not None and not requeue:
                job = driver._submit_job(turn, job.arrival)
            return _submit(job, now, requeue=requeue)

        p.submit = with_turn  # type: ignore[method-assign]


def run(
    placement: str,
    workers: int,
    load: AgentLoad,
    *,
    max_num_seqs: int = 32,
    prefill_us: float = 50.0,
    kv_tokens: int = 65536,
) -> dict[str, Any]:
    cfg = msgspec.structs.replace(SchedulerConfig(), **PLACEMENTS[placement])
    engine = msgspec.structs.replace(
        SimEngineConfig(), prefix_caching=True, prefill_token_us=prefill_us, kv_capacity_tokens=kv_tokens
    )
    fleet = [
        SimWorker(f"w{i:03d}", max_num_seqs=max_num_seqs, max_model_len=32768, engine=engine) for i in range(workers)
    ]
    d = AgentDriver(cfg, fleet, sessions(load))
    _patch_submit(d)
    d.routers[0].place_scan_all = workers  # score every worker, as at 16; sampled beyond
    end = d.replay(load.duration_s * 20 + 3600)
    recs = [r for r in d.records.values() if r.outcome == "ok" and r.first_token is not None]
    ttft = sorted(r.first_token - r.arrival for r in recs)  # type: ignore[operator]
    prompt = sum(r.prompt for r in recs)
    cached = sum(d.cached.get(r.job_id, 0) for r in recs)

    def pct(q: float) -> float:
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")

    counters = d.routers[0].counters
    return {
        "placement": placement,
        "workers": workers,
        "requests": len(d.records),
        "ok": len(recs),
        "ttft_p50_s": pct(0.5),
        "ttft_p90_s": pct(0.9),
        "ttft_p99_s": pct(0.99),
        "hit_rate": cached / prompt if prompt else 0.0,
        "sessions_moved": counters.get("session_moved", 0),
        "sim_end_s": end,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulation.agents_des", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[16])
    ap.add_argument(
        "--sessions-per-s", type=float, nargs="+", default=None, help="per fleet size (default: 0.125 x workers)"
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which sessions start")
    ap.add_argument("--prefill-us", type=float, default=50.0, help="simulated prefill cost per uncached token")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rates = args.sessions_per_s or [0.125 * w for w in args.workers]
    print("| workers | sessions/s | placement | requests | TTFT p50 s | p90 s | p99 s | KV hit rate | moved |")
    print("|---|---|---|---|---|---|---|---|---|")
    for workers, rate in zip(args.workers, rates, strict=False):
        load = AgentLoad(sessions_per_s=rate, duration_s=args.duration, seed=args.seed)
        for name in args.placements.split(","):
            r = run(name, workers, load, prefill_us=args.prefill_us)
            print(
                f"| {workers} | {rate:g} | {name} | {r['ok']}/{r['requests']} | {r['ttft_p50_s']:.3f} | "
                f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['hit_rate']:.2f} | {r['sessions_moved']} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
