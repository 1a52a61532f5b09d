"""How long a job would wait: the capacity model, the predicted wait that
admission bounds, and Retry-After, from a model's totals (``totals``: the
queued tokens, the drain-rate meter, the inflow).

Predicted wait = reserved tokens ahead (``WaitModel.ahead``) / drain rate
(``WaitModel.drain_rate``): tokens released per second of backlog
(exponentially weighted, 30 s of backlog), blended with a capacity model of
the registered engines (``capacity_rate``) that alone decides on a cold
fleet, less the inflow of higher classes."""

from __future__ import annotations

import math

from router.policy import fairness
from router.policy.model import ModelState
from router.policy.queues import QueueOrder
from router.policy.records import Entry
from router.policy.totals import CapacityGroup
from router.policy.types import (
    DEFAULT_PREFILL_TOKEN_S,
    MAX_RETRY_S,
    MIN_RETRY_S,
    NO_WORKER_RETRY_S,
)
from shared.config import ClassConfig
from shared.errors import Code, Refusal


def wait_bound(c: ClassConfig) -> float:
    """The predicted queue wait beyond which a job of class ``c`` is refused at once."""
    b = c.max_predicted_wait_s if c.max_predicted_wait_s is not None else c.queue_deadline_s
    return b if b > 0 else math.inf


def capacity_rate(m: ModelState, tokens: int, decode: int, n: int) -> float:
    """Tokens/s the workers release on ``n`` jobs of these totals, from what
    they registered with: each runs min(max_num_seqs, as many of the mean
    job as its KV budget holds) at once; a job holds its place for a step
    per output token plus one, plus its prompt's prefill; and each job
    costs the engine its per-request work, serially."""
    groups = m.capacity
    if groups is None:  # O(workers) once per fleet change, then O(kinds of worker) per call
        by_kind: dict[tuple[float, float, int, int], CapacityGroup] = {}
        for w in m.workers.values():
            spec = w.spec
            key = (spec.step_s(), spec.request_s(), spec.max_num_seqs, w.budget)
            g = by_kind.get(key)
            if g is None:
                by_kind[key] = [*key, 1]
            else:
                g[4] += 1
        groups = m.capacity = list(by_kind.values())
    rate = 0.0
    prefill = (tokens - decode) * DEFAULT_PREFILL_TOKEN_S
    for step_s, request_s, max_num_seqs, budget, count in groups:
        at_once = max(1.0, min(max_num_seqs, budget * n / tokens))
        rate += count * tokens / (((decode + n) * step_s + prefill) / at_once + n * request_s)
    return rate


class WaitModel:
    """Predicted waits and Retry-After, over a queue-order strategy (what is
    ahead of a job depends on the order it is served in)."""

    def __init__(self, classes: list[ClassConfig], order: QueueOrder, counters: dict[str, int]) -> None:
        self.classes = classes
        self.order = order
        self.counters = counters
        self.bound = [wait_bound(c) for c in classes]  # per class
        # per class: how many classes, from the top, its jobs wait behind (a list: read per admission)
        self.classes_ahead = [order.classes_ahead(r) for r in range(len(classes))]
        # Ranked: tenants and classes ahead of it; a FIFO: everything queued.
        self.ahead_parts = self._ahead_ranked if order.ranked else self._ahead_all

    # The work a new job waits for, in reserved tokens: all that is queued in
    # higher classes, plus -- in its own class, where tenants share by
    # weighted DRR -- its tenant's own queued tokens and, of every other
    # tenant's, at most what DRR serves them meanwhile:
    #     own + min(others, (own + job) x W_others / w)
    # (W_others: the summed weights of the other tenants queued in the class).
    # So a tenant whose own work is within its weighted share of the bound,
    # (own + job) <= w / (w + W_others) x bound x rate, always fits (unless
    # higher classes fill the bound), a flooder is refused once the whole
    # class is full, and a tenant alone may fill all of it.  Over the drain
    # rate (drain_rate) that is seconds.  O(classes): no scan of the queue.
    # Where the tenant's requests carry fairness ids, "own" is what its
    # tenant is served before it (fairness.tenant_ahead: its own id's queued
    # tokens, and of each other id's at most as much), so one user flooding
    # its tenant's share does not make another user's request predicted late;
    # the tenant's whole queue ("own" as without ids) is still held to
    # fairness.TENANT_ROOM times the bound.

    def _ahead_ranked(self, m: ModelState, e: Entry) -> tuple[float, float, float, float]:
        """(tokens ahead of ``e``, its tenant's queued tokens + its own, the
        other tenants' summed weight in its class, the tokens ahead of it
        were its tenant's fairness ids ignored)."""
        rank = e.rank
        t = m.totals
        job = e.job
        row = t.tenants[rank].get(job.tenant)
        own = row[0] if row is not None else 0
        w_others = max(0.0, t.wsum[rank] - (row[2] if row is not None else 0.0))
        others = t.tokens[rank] - own
        w = max(1e-3, job.weight)
        higher = sum(t.tokens[:rank])
        whole = higher + own + min(others, (own + e.tokens) * w_others / w)
        by_id = t.by_id[rank].get(job.tenant)
        if by_id is None and not job.fairness_id:
            return float(whole), float(own + e.tokens), w_others, float(whole)
        # of its tenant's, what is served before it: by fairness id (fairness.py)
        mine = fairness.tenant_ahead(int(own), e.tokens, by_id or {}, job.fairness_id)
        ahead = higher + mine + min(others, (mine + e.tokens) * w_others / w)
        return float(ahead), float(own + e.tokens), w_others, float(whole)

    def ahead(self, m: ModelState, e: Entry) -> tuple[float, float, float]:
        """(tokens ahead of ``e``, its tenant's queued tokens + its own, the
        other tenants' summed weight in its class)."""
        ahead, mine, w_others, _ = self.ahead_parts(m, e)
        return ahead, mine, w_others

    def _ahead_all(self, m: ModelState, e: Entry) -> tuple[float, float, float, float]:
        ahead = float(sum(m.totals.tokens))
        return ahead, float(e.tokens), 0.0, ahead

    def admit(self, m: ModelState, e: Entry, bound: float, now: float) -> Refusal | None:
        """Admit ``e`` (recording its predicted wait) or refuse it with a Retry-After."""
        job = e.job
        t = m.totals
        ahead, mine, w_others, whole = self.ahead_parts(m, e)
        rate = self.drain_rate(m, e.rank, e.tokens, max(0, job.max_tokens), now)
        if rate <= 0.0:
            return None  # nothing to predict from (no capacity known): the deadline still bounds
        if self.order.ranked and e.rank > 0:
            # Higher classes that keep arriving go ahead of this job while it
            # waits: it drains at what they leave, W = ahead / (rate - inflow).
            # (At least 5 % of the rate: aging keeps every class moving.)
            inflow = sum(f.rate(now) for f in t.inflow[: e.rank])
            rate = max(0.05 * rate, rate - inflow)
        wait = ahead / rate
        if wait <= bound and whole <= fairness.TENANT_ROOM * bound * rate:
            e.predicted = wait
            return None
        wait = max(wait, whole / rate / fairness.TENANT_ROOM)  # (refused for its tenant's whole queue)
        # Refused.  Retry-After: when this job's place in line -- behind what
        # is queued and behind everyone of its tenant and class refused before
        # it, each booked at its tenant's share of the drain rate -- will be
        # half the bound away.  A burst refused at once is thus told to come
        # back spread out over the time the fleet needs for it, not all at the
        # same moment (where most would be refused again).
        w = max(1e-3, job.weight)
        share = w / (w + w_others)
        key = (e.rank, job.tenant)
        front = max(t.fronts.get(key, -math.inf), now + wait) + e.tokens / (rate * share)
        front = min(front, now + bound + MAX_RETRY_S)
        if len(t.fronts) >= t.fronts_cap:  # drop fronts in the past: bounded by recent refusals
            t.fronts = {k: f for k, f in t.fronts.items() if f > now}
            t.fronts_cap = max(1024, 2 * len(t.fronts))
        t.fronts[key] = front
        retry = round(min(MAX_RETRY_S, max(MIN_RETRY_S, front - now - bound / 2)), 1)
        name = self.classes[e.rank].name
        fits = bound * rate  # tokens the bound admits
        others = t.tokens[e.rank] - (mine - e.tokens)
        if w_others > 0 and mine > share * fits and others < (1.0 - share) * fits:
            # over its share while the others are not: this tenant, not the class, is full
            self.counters["rejected_tenant_share"] += 1
            return Refusal(
                Code.TENANT_SHARE_EXCEEDED, retry, {"tenant": job.tenant, "klass": name, "wait": wait, "bound": bound}
            )
        self.counters["rejected_predicted_wait"] += 1
        return Refusal(Code.QUEUE_WAIT_EXCEEDED, retry, {"klass": name, "wait": wait, "bound": bound})

    def drain_rate(self, m: ModelState, rank: int, tokens: int, decode: int, now: float) -> float:
        """Reserved tokens/s released by the model's workers: measured while
        work was queued, blended with the capacity model of the work queued
        in class ``rank`` and above plus a job of ``tokens`` (``decode`` of
        them max_tokens)."""
        k = self.classes_ahead[rank]
        t = m.totals
        n = sum(m.queues.class_count[:k]) + (1 if tokens else 0)
        prior = 0.0
        if n:
            prior = capacity_rate(m, tokens + sum(t.tokens[:k]), decode + sum(t.decode[:k]), n)
        return t.meter.rate(now, prior)

    def retry_after(self, m: ModelState, rank: int, own_tokens: int, now: float) -> float:
        """Seconds until the work queued ahead of a job of class ``rank`` (its
        class and higher ones) plus its own should have drained."""
        k = self.classes_ahead[rank]
        ahead = own_tokens + sum(m.totals.tokens[:k])
        rate = self.drain_rate(m, rank, own_tokens, 0, now)
        if rate <= 0.0:
            return NO_WORKER_RETRY_S
        return round(min(MAX_RETRY_S, max(MIN_RETRY_S, ahead / rate)), 1)
