"""Discrete-event simulation of N routers over one fleet (README: Scaling out).

Each router is its own ``Policy`` (queues, DRR, aging, admission, its own
KV ledger) over every worker; each worker's own ``engine_worker.ledger``
admits or refuses what the routers dispatch, and tells a router what the
others hold there -- at once in a refusal, and every ``heartbeat_s`` for
every router -- exactly as the processes do.  Arrivals are spread over the
routers as Envoy's least-request does (to the router with the fewest jobs
in flight, of two drawn).  Router, network and engine-boundary latency are
taken as zero, so what differs from one router is the routers' partial
views alone.

    python -m simulation.routers_des        # N = 1, 2, 4, 8 on des.scenario_mixed's fleet and mix
"""

from __future__ import annotations

import heapq
import math
import random
import sys
import time
from typing import Optional

from engine_worker.ledger import Ledger
from router.policy import AbortJob, DispatchJob, Job, Policy, RejectJob
from shared.config import SchedulerConfig
from simulation import des
from simulation.des import MODEL, Record, Result, SimWorker, Workload, _Engine

_ARRIVE, _STEP, _BEAT, _WAKE = 0, 1, 2, 3


def simulate_routers(cfg: SchedulerConfig, workers: list[SimWorker], workload: Workload, n_routers: int,
                     heartbeat_s: float = 1.0, drain_s: float = 600.0, seed: int = 11) -> tuple[Result, dict]:
    """Run ``workload`` through ``n_routers`` policies over ``workers``;
    the Result, and counts: refusals by a worker's ledger, the worst
    over-commit any engine saw (always 0: the ledger's bound)."""
    wall0 = time.perf_counter()
    rng = random.Random(seed)
    engines = {w.worker_id: _Engine(w) for w in workers}
    routers = [Policy(cfg) for _ in range(n_routers)]
    for p in routers:
        for e in engines.values():
            p.add_worker(e.spec, 0.0)
    ledgers = {wid: Ledger(cfg.kv_budget(e.spec.capacity_tokens), cfg.seq_slots(e.spec.max_num_seqs))
               for wid, e in engines.items()}
    owner: dict[str, int] = {}  # job id -> the router that admitted it
    in_flight = [0] * n_routers
    records: dict[str, Record] = {}
    counts = {"refused_by_worker": 0, "max_overcommit_tokens": 0}
    ev: list = []
    seq = 0
    for i, (t, k, tenant, prompt, max_tokens) in enumerate(des.arrivals(workload)):
        ev.append((t, seq, _ARRIVE, (f"j{i}", k, tenant, prompt, max_tokens)))
        seq += 1
    if n_routers > 1:
        ev.append((heartbeat_s, seq, _BEAT, None))
        seq += 1
    heapq.heapify(ev)
    arrivals_left = sum(1 for x in ev if x[2] == _ARRIVE)
    live = 0
    end = workload.duration_s + drain_s
    now = 0.0
    dirty = set(range(n_routers))  # routers whose policy pass is due
    wake_at = math.inf

    def beat(wid: str) -> None:
        for r, p in enumerate(routers):
            t, s = ledgers[wid].others(r)
            p.update_worker(wid, now, other_tokens=t, other_seqs=s)
            dirty.add(r)

    while ev:
        if ev[0][0] > end:
            now = end
            break
        now = ev[0][0]
        while ev and ev[0][0] == now:
            _, _, kind, data = heapq.heappop(ev)
            if kind == _ARRIVE:
                job_id, k, tenant, prompt, max_tokens = data
                arrivals_left -= 1
                a, b = rng.randrange(n_routers), rng.randrange(n_routers)
                r = a if in_flight[a] <= in_flight[b] else b
                rec = records[job_id] = Record(job_id, k.name, k.klass, tenant, prompt, max_tokens, now)
                rec.attempts, rec.submitted = 1, now
                err = routers[r].submit(Job(job_id, MODEL, tenant, k.klass, prompt, max_tokens, k.task_type, now),
                                        now)
                if err is not None:
                    rec.outcome = rec.first_refusal = err.code or str(err.status)
                else:
                    owner[job_id] = r
                    in_flight[r] += 1
                    live += 1
                    dirty.add(r)
            elif kind == _STEP:
                eng = engines[data]
                eng.busy = False
                for rid, n, fin in eng.pending.outputs:
                    rec = records[rid]
                    if rec.first_token is None:
                        rec.first_token = now
                    if fin is not None:
                        rec.finished, rec.outcome = now, "ok"
                        r = owner.pop(rid)
                        ledgers[data].release(r, rid)
                        routers[r].finish(rid, now)
                        in_flight[r] -= 1
                        dirty.add(r)
                        live -= 1
                eng.pending = None
            elif kind == _WAKE:
                wake_at = math.inf
                dirty.update(range(n_routers))  # deadlines, aging: every router's pass
            elif kind == _BEAT:
                for wid in engines:
                    beat(wid)
                if live or arrivals_left:
                    heapq.heappush(ev, (now + heartbeat_s, seq, _BEAT, None))
                    seq += 1
        while dirty:
            r = dirty.pop()
            p = routers[r]
            for a in p.schedule(now):
                rec = records[a.job_id]
                if isinstance(a, DispatchJob):
                    ledger = ledgers[a.worker_id]
                    if ledger.admit(r, a.job_id, p.cost_of(a.job_id)):
                        rec.dispatched = now
                        engines[a.worker_id].core.add(a.job_id, rec.prompt, rec.max_tokens, a.priority)
                        over = ledger.tokens - ledger.budget
                        counts["max_overcommit_tokens"] = max(counts["max_overcommit_tokens"], over)
                    else:  # RouterCore.refused: the worker's figures, then queued again
                        counts["refused_by_worker"] += 1
                        t, s = ledger.others(r)
                        p.update_worker(a.worker_id, now, other_tokens=t, other_seqs=s)
                        job = p.entries[a.job_id].job
                        p.refused(a.job_id, now)
                        p.submit(job, now, requeue=True)
                        dirty.add(r)
                elif isinstance(a, (RejectJob, AbortJob)):
                    if isinstance(a, AbortJob):
                        engines[a.worker_id].core.abort(a.job_id)
                        ledgers[a.worker_id].release(r, a.job_id)
                    rec.outcome = a.error.code or str(a.error.status)
                    owner.pop(a.job_id, None)
                    in_flight[r] -= 1
                    live -= 1
        for wid, eng in engines.items():
            if not eng.busy and eng.core.has_work:
                res = eng.core.step()
                eng.busy, eng.pending = True, res
                heapq.heappush(ev, (now + max(res.duration_s, 1e-6), seq, _STEP, wid))
                seq += 1
        wake = min((t for p in routers if (t := p.next_wakeup(now)) is not None and t > now), default=math.inf)
        if wake < wake_at:
            wake_at = wake
            heapq.heappush(ev, (wake, seq, _WAKE, None))
            seq += 1
        if live == 0 and arrivals_left == 0 and not any(e.core.has_work for e in engines.values()):
            break
    for rec in records.values():
        if not rec.outcome:
            rec.outcome = "unfinished"
    res = Result(list(records.values()), sum(e.core.preemptions_total for e in engines.values()), now,
                 time.perf_counter() - wall0, {})
    return res, counts


def compare(ns=(1, 2, 4, 8), util: float = 0.9, duration_s: float = 60.0, seed: int = 1,
            workers: Optional[list[SimWorker]] = None) -> tuple[float, dict]:
    """des.scenario_mixed's fleet and mix at ``util`` of saturation, through
    N routers each; {N: (Result, counts)}."""
    workers = workers or des.fleet(kv_tokens=16384)
    mix = (des.SHORT, des.LONG)
    rate = util * des.saturation_rate(workers, mix)
    w = Workload(mix, rate, duration_s, seed)
    return rate, {n: simulate_routers(des.weir_cfg(), workers, w, n) for n in ns}


def main() -> int:
    workers = des.fleet(kv_tokens=16384)
    rate, out = compare(workers=workers)
    print(f"N routers over one fleet (2 workers x 32 seqs, 16k KV tokens; 80 % short / 20 % long at "
          f"90 % of saturation = {rate:.1f} jobs/s; 60 s)")
    print(f"{'N':>3}{'done':>7}{'jobs/s':>8}{'ttft p50':>10}{'ttft p99':>10}{'short e2e p99':>15}"
          f"{'util':>7}{'refused':>9}{'over':>6}{'preempt':>8}  rejected")
    for n, (res, c) in out.items():
        done = res.done()
        span = max(r.finished for r in done) if done else 1.0
        print(f"{n:>3}{len(done):>7}{len(done) / span:>8.1f}{des._ms(res.p(50, 'ttft')):>10}"
              f"{des._ms(res.p(99, 'ttft')):>10}{des._ms(res.p(99, 'e2e', kind='short')):>15}"
              f"{des.utilisation(res, workers):>7.3f}{c['refused_by_worker']:>9}{c['max_overcommit_tokens']:>6}"
              f"{res.preemptions:>8}  {dict(res.rejections())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
