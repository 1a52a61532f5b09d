"""What the wait model predicts from, kept per model in O(1) per event: the
queued totals per class and tenant (``AdmissionTotals``), the drain-rate
meter (``RateMeter``) and the inflow of admitted work (``Flow``).  State only:
``wait_model`` turns it into predicted waits and Retry-After."""

from __future__ import annotations

import math

from router.policy.fairness import wait_bucket
from router.policy.records import Entry
from router.policy.types import PRIOR_JOBS, PRIOR_S, RATE_TAU_S

# What the capacity model groups workers by: (step_s, request_s, max_num_seqs, budget) and a count.
CapacityGroup = list[float]


class RateMeter:
    """Drain rate: reserved tokens (prompt + max_tokens) released per second
    *of backlog*, exponentially weighted over ``tau`` seconds of backlog.

    Only time during which work was queued counts, and only releases then:
    an idle or lightly loaded fleet releases what it is offered, not what it
    can do, and a burst after a quiet hour must not be judged by the quiet
    hour.  ``rate`` blends in a prior (the capacity model) worth ``PRIOR_S``
    seconds of backlog until ``PRIOR_JOBS`` releases were seen, then less and
    less: how much a measurement says depends on how many releases it saw."""

    __slots__ = ("tau", "tokens", "jobs", "window", "t", "busy")

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.tokens = 0.0  # decayed tokens released while backlogged
        self.jobs = 0.0  # decayed count of those releases
        self.window = 0.0  # decayed seconds of backlog
        self.t: float | None = None
        self.busy = False

    def _decay(self, now: float) -> tuple[float, float, float]:
        t = self.t
        if t is None or now <= t or not self.busy:
            return self.tokens, self.jobs, self.window
        d = math.exp(-(now - t) / self.tau)
        return self.tokens * d, self.jobs * d, self.window * d + self.tau * (1.0 - d)

    def _advance(self, now: float) -> None:
        self.tokens, self.jobs, self.window = self._decay(now)
        if self.t is None or now > self.t:
            self.t = now

    def set_busy(self, now: float, busy: bool) -> None:
        if busy != self.busy:
            self._advance(now)
            self.busy = busy

    def add(self, now: float, tokens: float) -> None:
        if self.busy:
            self._advance(now)
            self.tokens += tokens
            self.jobs += 1.0

    def snapshot(self, now: float) -> tuple[float, float, float]:
        """(tokens released, releases, seconds of backlog), decayed to ``now``."""
        return self._decay(now)

    def release_gap(self, now: float, min_jobs: float) -> float | None:
        """Mean seconds of backlog between releases (None: fewer than
        ``min_jobs`` releases seen): how long a job waits for a slot once
        every slot is taken (router.policy.targets)."""
        _, jobs, window = self._decay(now)
        return window / jobs if jobs >= min_jobs and window > 0.0 else None

    def rate(self, now: float, prior: float) -> float:
        tokens, jobs, window = self._decay(now)
        weight = PRIOR_S * PRIOR_JOBS / (PRIOR_JOBS + jobs)
        return (tokens + prior * weight) / (window + weight)


class Flow:
    """Exponentially weighted rate (tokens/s) of admitted work, over wall time."""

    __slots__ = ("value", "t", "t0")

    def __init__(self) -> None:
        self.value = 0.0
        self.t: float | None = None
        self.t0: float | None = None

    def add(self, now: float, tokens: float) -> None:
        if self.t is None:
            self.t = self.t0 = now
        elif now > self.t:
            self.value *= math.exp(-(now - self.t) / RATE_TAU_S)
            self.t = now
        self.value += tokens

    def rate(self, now: float) -> float:
        if self.t is None or self.t0 is None:
            return 0.0
        window = max(1.0, RATE_TAU_S * (1.0 - math.exp(-max(0.0, now - self.t0) / RATE_TAU_S)))
        return self.value * math.exp(-max(0.0, now - self.t) / RATE_TAU_S) / window


class AdmissionTotals:
    """What admission predicts from, kept up to date in O(1) per event (``account``)."""

    __slots__ = (
        "queued",
        "size_count",
        "tokens",
        "decode",
        "tenants",
        "wsum",
        "by_id",
        "fronts",
        "fronts_cap",
        "inflow",
        "meter",
    )

    def __init__(self, n_classes: int) -> None:
        self.queued = 0  # queued entries, all classes
        self.size_count = [[0, 0] for _ in range(n_classes)]  # per class and size: queued entries
        self.tokens = [0] * n_classes  # per class: queued prompt+max_tokens
        self.decode = [0] * n_classes  # per class: queued max_tokens (engine steps)
        # per class: tenant -> [queued tokens, queued entries, weight]; wsum: their weights' sum
        self.tenants: list[dict[str, list[float]]] = [{} for _ in range(n_classes)]
        self.wsum = [0.0] * n_classes
        # per class: tenant -> queued tokens of its requests with a fairness id, by fairness.wait_bucket
        self.by_id: list[dict[str, dict[int, int]]] = [{} for _ in range(n_classes)]
        # (class, tenant) -> when the work of everyone refused so far (and told
        # when to come back) will have drained: Retry-After spreads retries
        self.fronts: dict[tuple[int, str], float] = {}
        self.fronts_cap = 1024
        self.inflow = [Flow() for _ in range(n_classes)]  # per class: admitted tokens/s
        self.meter = RateMeter(RATE_TAU_S)

    def account(self, e: Entry, sign: int, now: float | None) -> None:
        """``e`` entered (+1) or left (-1) the queued state: the totals, and
        whether the model is backlogged (None: a re-pricing)."""
        # (one branch per sign, conditionals for max(): this runs twice per request)
        r = e.rank
        job = e.job
        tokens = e.tokens
        mt = job.max_tokens
        if mt < 0:
            mt = 0
        tab = self.tenants[r]
        t = job.tenant
        row = tab.get(t)
        if sign > 0:
            queued = self.queued = self.queued + 1
            self.size_count[r][e.size] += 1
            self.tokens[r] += tokens
            self.decode[r] += mt
            w = job.weight
            w = w if w > 1e-3 else 1e-3
            if row is None:
                row = tab[t] = [0, 0, w]
                self.wsum[r] += w
            elif row[2] != w:
                self.wsum[r] += w - row[2]
                row[2] = w
            row[0] += tokens
            row[1] += 1
        else:
            queued = self.queued = self.queued - 1
            self.size_count[r][e.size] -= 1
            self.tokens[r] -= tokens
            self.decode[r] -= mt
            if row is not None:
                row[0] -= tokens
                row[1] -= 1
                if row[1] <= 0:
                    del tab[t]
                    self.wsum[r] = self.wsum[r] - row[2] if tab else 0.0
        if job.fairness_id:
            self._by_id(r, t, job.fairness_id, tokens * sign)
        if now is not None and (queued > 0) != self.meter.busy:
            self.meter.set_busy(now, queued > 0)

    def _by_id(self, r: int, tenant: str, fid: str, tokens: int) -> None:
        tab = self.by_id[r]
        buckets = tab.get(tenant)
        if buckets is None:
            buckets = tab[tenant] = {}
        b = wait_bucket(fid)
        n = buckets.get(b, 0) + tokens
        if n > 0:
            buckets[b] = n
        else:
            buckets.pop(b, None)
            if not buckets:
                del tab[tenant]

    def remeasure(self, now: float) -> None:
        """The fleet changed: what was measured no longer says what it drains;
        predict from the capacity model again until the new fleet is measured."""
        self.meter = RateMeter(RATE_TAU_S)
        self.meter.set_busy(now, self.queued > 0)
