"""One benchmark run: plan the requests, send them on schedule, collect
records, summarise.  Scenarios call ``run_bench``; ``weir bench`` wraps it."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import platform
import random
import resource
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from .arrivals import Arrivals
from .metrics import INCOMPLETE, Record, summarise_run
from .prompts import PromptMaker
from .spec import Workload
from .targets import Planned

_clock = time.perf_counter
_MIN_SLEEP_S = 0.001  # the event loop's timer resolution


@dataclass
class Limits:
    num_requests: int = 100
    duration_s: float = 60.0  # no request is sent after this
    drain_s: float = 30.0  # in-flight requests get this long after the last send
    warmup: int = 0  # requests sent (sequentially) and discarded first


@dataclass
class RunResult:
    meta: dict
    summary: dict
    records: list[Record] = field(repr=False)

    def to_json(self, with_requests: bool = True) -> dict:
        d = {"meta": self.meta, "summary": self.summary}
        if with_requests:
            d["requests"] = msgspec.to_builtins(self.records)
        return d


def plan(workload: Workload, n: int, prompts: PromptMaker, model: str | None = None) -> list[Planned]:
    """The run's requests, deterministic for a given workload seed."""
    rng = random.Random(workload.seed)
    weights = [c.weight for c in workload.classes]
    out = []
    for i in range(n):
        c = rng.choices(workload.classes, weights=weights)[0]
        p_len = c.prompt_tokens.sample(rng)
        key = rng.choice(c.api_keys) if c.api_keys else c.api_key
        out.append(Planned(i, c, prompts.make(p_len, rng), c.output_tokens.sample(rng), model or workload.model, key))
    return out


def machine() -> dict:
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


class _Progress:
    """tqdm bar refreshed from a timer, so requests pay nothing for it."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        self.done = 0
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)

    async def ticker(self):
        while self.bar is not None:
            self.bar.update(self.done - self.bar.n)
            await asyncio.sleep(0.2)

    def close(self):
        if self.bar is not None:
            self.bar.update(self.done - self.bar.n)
            self.bar.close()
            self.bar = None


async def run_bench(
    workload: Workload,
    target,
    arrivals: Arrivals,
    limits: Limits,
    *,
    model: str | None = None,
    tokenizer: str | None = None,
    progress: bool = True,
    connections: int | None = None,
    label: str = "",
    on_phase: Callable[[str], None] | None = None,
) -> RunResult:
    """``on_phase("start"/"end")`` brackets the measured part (after planning
    and warm-up), e.g. to sample the servers' CPU over exactly that span."""
    planned = plan(workload, limits.num_requests + limits.warmup, PromptMaker(tokenizer), model)
    for p in planned:
        target.prepare(p)
    warm, planned = planned[: limits.warmup], planned[limits.warmup :]
    n = len(planned)
    if connections is None:
        connections = arrivals.concurrency if not arrivals.open_loop else 1
    await target.start(connections)
    for p in warm:
        await target.send(p, Record(cls=p.cls.name))

    records: list[Record | None] = [None] * n
    prog = _Progress(n, progress, label or workload.name)
    ticker = asyncio.ensure_future(prog.ticker())

    async def one(p: Planned, scheduled: float) -> None:
        rec = Record(cls=p.cls.name, scheduled=scheduled)
        records[p.index - limits.warmup] = rec
        try:
            await target.send(p, rec)
        finally:
            prog.done += 1

    # A full collection over thousands of live records stalls the loop for
    # milliseconds, which would show up as server latency: collect now and
    # pause the collector for the measured part (runs are bounded).
    gc.collect()
    gc.freeze()
    gc.disable()
    if on_phase:
        on_phase("start")
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = _clock()
    deadline = t0 + limits.duration_s
    tasks: list[asyncio.Task] = []
    if arrivals.open_loop:
        times = (t0 + arrivals.schedule(n, seed=workload.seed)).tolist()
        i = 0
        while i < n:
            now = _clock()
            if now >= deadline:
                break
            # Launch everything that is due; timers are ~1 ms coarse, so at
            # high rates several go per wake-up (their lag is recorded).
            while i < n and times[i] <= now:
                tasks.append(asyncio.ensure_future(one(planned[i], times[i])))
                i += 1
            if i < n:
                # Never spin on sleep(0) until the next arrival: on a small
                # machine the generator would take a whole core from the
                # servers it measures (it did, above ~2,000 req/s).  uvloop
                # truncates timers to whole milliseconds, so wait at least one.
                await asyncio.sleep(max(times[i] - _clock(), _MIN_SLEEP_S))
    else:
        it = iter(planned)

        async def worker():
            for p in it:
                if _clock() >= deadline:
                    return
                await one(p, _clock())

        tasks = [asyncio.ensure_future(worker()) for _ in range(min(arrivals.concurrency, n))]
    # Closed loop: the workers stop sending at the deadline by themselves.
    issued_until = _clock() if arrivals.open_loop else deadline

    if tasks:
        drain_until = issued_until + limits.drain_s
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, drain_until - _clock()))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
    t_end = _clock()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    if on_phase:
        on_phase("end")
    gc.enable()
    gc.unfreeze()
    ticker.cancel()
    prog.close()

    recs = [r for r in records if r is not None]
    for r in recs:
        if r.status == INCOMPLETE:
            r.end = t_end
            r.error = r.error or "incomplete: time limit reached"
        # Relative to the run's start: small, comparable numbers in JSON.
        r.scheduled -= t0
        r.start -= t0
        r.end -= t0
    # How long requests were offered: the span of send times plus one mean
    # gap, so that offered_rps of an open-loop run is its rate.
    if not recs:
        issue_s = 0.0
    elif arrivals.open_loop and not math.isinf(arrivals.rate):
        issue_s = max(r.scheduled for r in recs) + 1.0 / arrivals.rate
    else:
        issue_s = max(r.start for r in recs) or (t_end - t0)
    summary = summarise_run(recs, workload, issue_s)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    summary["client_cpu_util"] = cpu / max(t_end - t0, 1e-9)
    meta = {
        "label": label or workload.name,
        "workload": msgspec.to_builtins(workload),
        "target": target.describe(),
        "target_kind": target.kind,
        "arrivals": arrivals.describe(),
        "rate": None if arrivals.rate is None or math.isinf(arrivals.rate) else arrivals.rate,
        "burstiness": arrivals.burstiness,
        "concurrency": arrivals.concurrency,
        "limits": {
            "num_requests": limits.num_requests,
            "duration_s": limits.duration_s,
            "drain_s": limits.drain_s,
            "warmup": limits.warmup,
        },
        "model": model or workload.model,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    return RunResult(meta, summary, recs)
