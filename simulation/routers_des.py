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

The virtual-time loop is simulation.driver's, as for one router (simulation.des).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterable

from shared.config import SchedulerConfig
from simulation import des
from simulation.des import Result, Workload
from simulation.driver import Driver, SimWorker


def simulate_routers(
    cfg: SchedulerConfig,
    workers: list[SimWorker],
    workload: Workload,
    n_routers: int,
    heartbeat_s: float = 1.0,
    drain_s: float = 600.0,
    seed: int = 11,
) -> tuple[Result, dict[str, int]]:
    """Run ``workload`` through ``n_routers`` policies over ``workers``;
    the Result, and counts: refusals by a worker's ledger, the worst
    over-commit any engine saw (always 0: the ledger's bound)."""
    wall0 = time.perf_counter()
    driver = Driver(cfg, workers, n_routers, arbitrate=True, heartbeat_s=heartbeat_s, pick=random.Random(seed))
    now = driver.run(des.arrivals(workload), workload.duration_s + drain_s)
    res = Result(list(driver.records.values()), driver.preemptions, now, time.perf_counter() - wall0, {})
    return res, {"refused_by_worker": driver.refused_by_worker, "max_overcommit_tokens": driver.max_overcommit_tokens}


def compare(
    ns: Iterable[int] = (1, 2, 4, 8),
    util: float = 0.9,
    duration_s: float = 60.0,
    seed: int = 1,
    workers: list[SimWorker] | None = None,
) -> tuple[float, dict[int, tuple[Result, dict[str, int]]]]:
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
    print(
        f"N routers over one fleet (2 workers x 32 seqs, 16k KV tokens; 80 % short / 20 % long at "
        f"90 % of saturation = {rate:.1f} jobs/s; 60 s)"
    )
    print(
        f"{'N':>3}{'done':>7}{'jobs/s':>8}{'ttft p50':>10}{'ttft p99':>10}{'short e2e p99':>15}"
        f"{'util':>7}{'refused':>9}{'over':>6}{'preempt':>8}  rejected"
    )
    for n, (res, c) in out.items():
        done = res.done()
        span = max(des.occurred(r.finished) for r in done) if done else 1.0
        print(
            f"{n:>3}{len(done):>7}{len(done) / span:>8.1f}{des._ms(res.p(50, 'ttft')):>10}"
            f"{des._ms(res.p(99, 'ttft')):>10}{des._ms(res.p(99, 'e2e', kind='short')):>15}"
            f"{des.utilisation(res, workers):>7.3f}{c['refused_by_worker']:>9}{c['max_overcommit_tokens']:>6}"
            f"{res.preemptions:>8}  {dict(res.rejections())}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
