"""Policy cost per request against fleet size and queue length (pure, in-process).

The router's scheduling policy (router/policy/) with W workers of 64
slots and 64k KV tokens each, fed 20,000 jobs of three classes and 50
tenants (prompts 32-512 tokens, max_tokens 16-256), a scheduling pass after
each submit, as the router runs it.  Two shapes:

* ``fleet``: the fleet kept ~95 % busy -- once that many jobs run, each new
  submit is preceded by the oldest running job finishing -- so placement
  always searches a busy fleet; W = 1, 16, 64, 256, 1,024.
* ``queue``: Q jobs already queued behind a full fleet of 1,024 workers
  (``--queue-workers``), then 20,000 more submitted, one job finishing
  before each; Q = 1,000, 10,000, 100,000.

Reports microseconds per request (submit + scheduling pass + its share of
finishes), best of ``--repeat`` runs.  ``--policy FILE`` measures a
single-file policy module instead (e.g. ``git show REV:router/policy.py >
old.py`` at a revision where the policy was one file) for a before/after;
without it, the router/policy/ package.  Target: <= 25 us at 1,024 workers
and at 100,000 queued.

    python -m bench.scenarios.placement [--jobs 20000] [--repeat 3] [--policy old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from collections import deque

from shared.config import SchedulerConfig
from shared.protocol import Pool, TaskType

CLASSES = ("critical", "normal", "batch")
SLOTS, KV = 64, 65536


def load_policy(path: str | None):
    if path is None:
        from router import policy

        return policy
    spec = importlib.util.spec_from_file_location("policy_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def _jobs(mod, n: int, seed: int, t0: float = 0.0):
    rng = random.Random(seed)
    return [
        mod.Job(
            f"j{seed}-{i}",
            "m",
            f"t{rng.randrange(50)}",
            rng.choice(CLASSES),
            rng.randint(32, 512),
            rng.randint(16, 256),
            TaskType.AUTO,
            t0 + i * 1e-4,
        )
        for i in range(n)
    ]


def _policy(mod, workers: int):
    # Bounds out of the way: this measures cost, not admission.
    cfg = SchedulerConfig(generation_deadline_s=0.0, max_queue_per_tenant=10**9)
    for c in cfg.classes:
        c.queue_deadline_s, c.max_queue = 0.0, 10**9
    p = mod.Policy(cfg)
    for i in range(workers):
        p.add_worker(mod.WorkerSpec(f"w{i:05d}", "m", Pool.ANY, KV, 16, SLOTS, 4096), 0.0)
    return p


def run(mod, workers: int, jobs: int, queued: int = 0, busy: float = 0.95) -> float:
    """Microseconds per request."""
    p = _policy(mod, workers)
    running: deque = deque()
    DispatchJob = mod.DispatchJob
    now = 0.0

    def schedule():
        for a in p.schedule(now):
            if a.__class__ is DispatchJob:
                running.append(a.job_id)

    fill = workers * SLOTS + queued if queued else 0
    if fill:  # fill the fleet, then the queue
        for job in _jobs(mod, fill, seed=1):
            p.submit(job, now)
        schedule()
    target = int(workers * SLOTS * busy)
    stream = _jobs(mod, jobs, seed=2, t0=fill * 1e-4 + 1.0)  # arriving after what is queued
    t = time.process_time()
    for job in stream:
        now = job.arrival
        while len(running) >= target or (queued and running):
            p.finish(running.popleft(), now)
            if not queued:
                continue
            break  # a queue behind a full fleet: one finish makes room for one
        p.submit(job, now)
        schedule()
    return (time.process_time() - t) / jobs * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 16, 64, 256, 1024])
    ap.add_argument("--queued", type=int, nargs="*", default=[1_000, 10_000, 100_000])
    ap.add_argument("--queue-workers", type=int, default=1024)
    ap.add_argument(
        "--policy",
        default=None,
        help="another policy module to measure (a single-file copy, e.g. an old router/policy.py)",
    )
    args = ap.parse_args(argv)
    mod = load_policy(args.policy)
    print(f"policy {args.policy or 'router.policy'}; {args.jobs} jobs; best of {args.repeat}")
    for w in args.workers:
        us = min(run(mod, w, args.jobs) for _ in range(args.repeat))
        print(f"  fleet  W={w:>5}            {us:7.1f} us/request", flush=True)
    for q in args.queued:
        us = min(run(mod, args.queue_workers, args.jobs, queued=q) for _ in range(max(1, args.repeat - 1)))
        print(f"  queue  W={args.queue_workers:>5} Q={q:>7}  {us:7.1f} us/request", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
