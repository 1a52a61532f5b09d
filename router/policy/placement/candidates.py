"""The workers a placement looks at: every worker of a small fleet, else a
sample from the free sets -- so placement costs the same at 1,024 workers
as at 16 (the power of k choices)."""

from __future__ import annotations

import random
from collections.abc import Collection

from router.policy.model import ModelState
from router.policy.records import WorkerState
from router.policy.types import PLACE_SAMPLE


def candidates(
    m: ModelState, pools: tuple[int, ...], again: bool, limit: float, scan_all: float, rng: random.Random
) -> tuple[Collection[WorkerState], bool]:
    """The workers to filter and score, and whether they are all it could
    be: every worker of a fleet of up to ``scan_all`` (in id order), else
    PLACE_SAMPLE from the free sets of ``pools`` (the pools a job of its size
    may use, in order of preference: a short job's short, any, long), each
    cut to the workers below the class's seq cap ``limit`` (a prefix: the
    sets are sorted by occupancy) -- a pool's whole cut while it is smaller
    than what is left to draw -- or, the second time (``again``), drawn
    across all of them alike.  No worker below the cap anywhere: none, at once."""
    if len(m.workers) <= scan_all:
        return m.workers.values(), True
    cuts, total = m.free.below_cap(pools, limit)
    if total <= PLACE_SAMPLE:
        return [w for p, n in cuts for w in p[:n]], True
    draw = rng.random  # (int(draw() * n): a third of randrange's cost)
    out: list[WorkerState] = []
    if not again:
        for p, n in cuts:
            left = PLACE_SAMPLE - len(out)
            if n <= left:
                out.extend(p[:n])
            else:
                out.extend([p[int(draw() * n)] for _ in range(left)])
                break
        return out, False
    for _ in range(PLACE_SAMPLE):
        i = int(draw() * total)
        for p, n in cuts:
            if i < n:
                out.append(p[i])
                break
            i -= n
    return out, False
