"""Who waits in what order: the per-model queues and the queue-order
strategies.

``ClassOrder`` (the default): one queue per (class, size); inside a queue
tenants share by deficit round robin weighted by tokens; strict class order
across queues except for due (aged) queues; short and long queues of one
class share the tokens dispatched; a head that fits nowhere is skipped
(backfill).  ``FifoOrder`` (``policy="fifo"``): one FIFO per model, no
priorities, no backfill -- the baseline the DES compares against.  The
strategy is chosen once, at construction; the hot paths read its plain
attributes."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from operator import attrgetter

from router.policy.fairness import FairLines
from router.policy.records import WAITING, Entry
from router.policy.types import LONG, SHORT
from shared.config import SchedulerConfig

QueueKey = tuple[int, int]  # (class rank, size)


class TenantQueue:
    """One (model, class, size) queue: FIFO per tenant, deficit round robin
    by tokens across tenants (and inside a tenant across its fairness ids:
    fairness.FairLines).  Entries that left (finish) are skipped lazily."""

    __slots__ = (
        "rank",
        "size",
        "quantum",
        "by_tenant",
        "tenants",
        "active",
        "deficit",
        "weight",
        "visited",
        "count",
        "tokens",
        "last_dispatch",
    )

    def __init__(self, rank: int, size: int, quantum: int, by_tenant: bool = True) -> None:
        self.rank = rank
        self.size = size
        self.quantum = max(1, quantum)
        self.by_tenant = by_tenant  # False: one FIFO for everyone (FifoOrder)
        # a tenant's entries: a deque, or by fairness id once one is sent (fairness.FairLines)
        self.tenants: dict[str, deque[Entry] | FairLines] = {}
        self.active: deque[str] = deque()  # round-robin order of tenants with work
        self.deficit: dict[str, float] = {}
        self.weight: dict[str, float] = {}
        self.visited = False  # the front tenant got its quantum for this visit
        self.count = 0  # live queued entries
        self.tokens = 0  # their prompt+max_tokens, for drain estimates
        self.last_dispatch = -math.inf

    def push(self, e: Entry) -> None:
        job = e.job
        t = job.tenant if self.by_tenant else ""
        dq = self.tenants.get(t)
        if dq is None:
            dq = self.tenants[t] = deque()
        if job.fairness_id and self.by_tenant and not isinstance(dq, FairLines):
            dq = self.tenants[t] = FairLines(self.quantum, dq)  # its users share its turn from now on
        if t not in self.deficit:  # (a tenant with entries is active: only an empty one is not)
            self.active.append(t)
            self.deficit[t] = 0.0
        w = job.weight
        self.weight[t] = w if w > 1e-3 else 1e-3  # max(1e-3, w), without the call
        insert_by_arrival(dq.line_for(e) if isinstance(dq, FairLines) else dq, e)
        e.queue = self
        self.count += 1
        self.tokens += e.tokens

    def forget(self, e: Entry) -> None:
        """Bookkeeping for an entry that left without being dispatched."""
        self.count -= 1
        self.tokens -= e.tokens
        e.queue = None

    def _head(self, t: str) -> Entry | None:
        dq = self.tenants[t]
        if isinstance(dq, FairLines):
            return dq.pick()
        while dq and dq[0].state != WAITING:
            dq.popleft()
        return dq[0] if dq else None

    def _deactivate_front(self) -> None:
        t = self.active.popleft()
        del self.deficit[t]
        del self.tenants[t]
        self.weight.pop(t, None)
        self.visited = False

    def peek(self) -> Entry | None:
        """The entry DRR serves next (advances round state; idempotent until pop)."""
        misses = 0
        active = self.active
        while active:
            t = active[0]
            dq = self.tenants[t]  # (``_head``, inlined: this runs at every head served)
            if dq.__class__ is FairLines:
                head = dq.pick()
                if head is None:
                    self._deactivate_front()
                    continue
            else:
                while dq and dq[0].state != WAITING:
                    dq.popleft()
                if not dq:
                    self._deactivate_front()
                    continue
                head = dq[0]
            if not self.visited:
                self.deficit[t] += self.quantum * self.weight[t]
                self.visited = True
            if head.tokens <= self.deficit[t]:
                return head
            self.visited = False
            self.active.rotate(-1)
            misses += 1
            if misses >= len(self.active):
                # A whole round served nobody: grant the rounds the closest
                # tenant still needs in one go (exact DRR, bounded work).
                need = [
                    math.ceil((h.tokens - self.deficit[u]) / (self.quantum * self.weight[u]))
                    for u in self.active
                    if (h := self._head(u)) is not None
                ]
                rounds = min(need) if need else 0
                if rounds > 1:
                    for u in self.active:
                        self.deficit[u] += (rounds - 1) * self.quantum * self.weight[u]
                misses = 0
        return None

    def pop(self, e: Entry) -> None:
        """``e`` (the last peek) was dispatched."""
        t = self.active[0]
        dq = self.tenants[t]
        assert dq[0] is e
        dq.popleft()
        self.deficit[t] -= e.tokens
        self.count -= 1
        self.tokens -= e.tokens
        e.queue = None
        if self._head(t) is None:
            self._deactivate_front()


def insert_by_arrival(index: deque[Entry], e: Entry) -> None:
    """Into ``index`` (in arrival order) after every entry that arrived no
    later than ``e``."""
    arrival = e.job.arrival
    if not index or index[-1].job.arrival <= arrival:
        index.append(e)
        return
    # A requeued job (its worker was lost): back to its place, found by
    # bisection -- a scan from the end cost ~5 ms per job at 100,000 queued,
    # ~0.3 s for the jobs of one lost worker.
    index.insert(bisect_right(index, arrival, key=_arrival), e)


_arrival = attrgetter("job.arrival")


class ModelQueues:
    """A model's queued work: its queues and the counts and indexes over them."""

    __slots__ = ("by_key", "class_count", "wrr", "by_arrival", "last_seen", "start_floor")

    def __init__(self, n_classes: int) -> None:
        self.by_key: dict[QueueKey, TenantQueue] = {}
        self.class_count = [0] * n_classes
        # per class: tokens dispatched (short, long) while both waited
        self.wrr = [[0, 0] for _ in range(n_classes)]
        # per (class, size): queued entries by arrival, lazily pruned -- queue
        # deadlines and the oldest wait in O(1) whatever the number of tenants
        self.by_arrival: dict[QueueKey, deque[Entry]] = {
            (r, s): deque() for r in range(n_classes) for s in (SHORT, LONG)
        }
        self.last_seen = [-math.inf] * n_classes  # last submit per class: which classes are active
        # At most the start (last dispatch, or its oldest entry's arrival if
        # later) of every queue with work: while now is less than the aging
        # delay past it, no queue is due and ``ClassOrder.pick`` skips the
        # check.  A push lowers it (``queued``), a check that finds no queue
        # due raises it; dispatches and departures only raise starts.
        self.start_floor = math.inf

    def dequeued(self, rank: int) -> None:
        """One entry of class ``rank`` left the queued state (``class_count``
        already lowered).  When none is left, the arrival indexes of that
        class hold only dead entries: drop them now, so that the hot paths
        may skip empty classes without leaving their indexes to grow."""
        if self.class_count[rank] == 0:
            self.by_arrival[(rank, SHORT)].clear()
            self.by_arrival[(rank, LONG)].clear()

    def queued(self, q: TenantQueue, e: Entry) -> None:
        """``e`` joined ``q``: its start may be earlier than any so far."""
        start = q.last_dispatch
        arrival = e.job.arrival
        if arrival > start:
            start = arrival
        if start < self.start_floor:
            self.start_floor = start

    def long_queued(self) -> int:
        return sum(q.count for (_, size), q in self.by_key.items() if size == LONG)

    def oldest(self, rank: int, size: int) -> Entry | None:
        """The longest-waiting queued entry of (class, size)."""
        index = self.by_arrival[(rank, size)]
        while index and index[0].state != WAITING:
            index.popleft()  # dispatched or ended since
        return index[0] if index else None


class QueueOrder:
    """The queue-order strategy: which queue a job joins, which queue is
    served next, and what a strict order forbids.  Plain attributes, read by
    the hot paths without a call."""

    by_tenant = True  # tenants share a queue by DRR (else one FIFO)
    backfill = True  # a head that fits nowhere may be skipped
    ages = True  # queues become due after aging_bound_s / 2
    ranked = True  # the class rank orders work (and is vLLM's priority)
    short_borrows_freely = False  # short work may use any worker, long pool included
    headroom = 0.0  # class headroom (fraction of a worker kept for higher classes)

    def __init__(self, cfg: SchedulerConfig, n_classes: int) -> None:
        self.cfg = cfg
        self.n_classes = n_classes

    def key(self, rank: int, size: int) -> QueueKey:
        return (rank, size)

    def classes_ahead(self, rank: int) -> int:
        """How many classes, from the top, a job of class ``rank`` waits behind."""
        return rank + 1

    def pick(self, mq: ModelQueues, now: float, skipped: set[QueueKey]) -> tuple[TenantQueue, bool] | None:
        """The queue to serve next and whether it is due (aged)."""
        raise NotImplementedError

    def sizes_compete(self, mq: ModelQueues, q: TenantQueue, skipped: set[QueueKey]) -> bool:
        """Do ``q`` and the other size of its class both wait (their dispatched
        tokens then count toward the short : long share)?"""
        return False


class ClassOrder(QueueOrder):
    """Strict by class rank, due queues first, short : long shares, backfill."""

    def __init__(self, cfg: SchedulerConfig, n_classes: int) -> None:
        super().__init__(cfg, n_classes)
        self.backfill = cfg.backfill
        self.headroom = max(0.0, min(0.9, cfg.priority_headroom))
        self.promote_after = cfg.aging_bound_s / 2.0

    def pick(self, mq: ModelQueues, now: float, skipped: set[QueueKey]) -> tuple[TenantQueue, bool] | None:
        promote_after = self.promote_after
        due_best = None
        due_start = 0.0
        best_rank = -1
        first = second = None  # the (at most two) queues of the best class, in queue order
        # May a queue be due?  Else no queue's start is looked at (``start_floor``).
        check = now - mq.start_floor >= promote_after
        floor = math.inf  # the least start seen, if every queue with work is checked
        for key, q in mq.by_key.items():
            if q.count == 0:
                continue
            if skipped and key in skipped:
                floor = -math.inf  # (not checked: the floor stays as it was)
                continue
            if check:
                start = q.last_dispatch
                if now - start >= promote_after:
                    oldest = mq.oldest(q.rank, q.size)  # only looked up when the queue may be due
                    if oldest is None:
                        continue
                    start = max(start, oldest.job.arrival)
                    if now - start >= promote_after and (due_best is None or start < due_start):
                        due_best, due_start = q, start
                if start < floor:
                    floor = start
            r = q.rank
            if first is None or r < best_rank:
                best_rank, first, second = r, q, None
            elif r == best_rank:
                second = q
        if check and floor > mq.start_floor:
            mq.start_floor = floor
        if due_best is not None:
            return due_best, True
        if first is None:
            return None
        if second is None:
            q = first
            other = mq.by_key.get((q.rank, 1 - q.size))
            if other is None or other.count == 0:
                shares = mq.wrr[q.rank]  # nothing to share with: no credit is banked
                shares[0] = shares[1] = 0
            return q, False
        short_tokens, long_tokens = mq.wrr[first.rank]
        short_q = first if first.size == SHORT else second
        assert short_q is not None
        long_q = second if short_q is first else first
        assert long_q is not None
        # serve short while its dispatches/share are not ahead of long's
        if short_tokens * self.cfg.long_share <= long_tokens * self.cfg.short_share:
            return short_q, False
        return long_q, False

    def sizes_compete(self, mq: ModelQueues, q: TenantQueue, skipped: set[QueueKey]) -> bool:
        other_key = (q.rank, 1 - q.size)
        other = mq.by_key.get(other_key)
        return other is not None and other.count > 0 and other_key not in skipped


class FifoOrder(QueueOrder):
    """One FIFO per model: no priorities, no aging, no backfill (the head
    blocks); short work may use any worker."""

    by_tenant = False
    backfill = False
    ages = False
    ranked = False
    short_borrows_freely = True

    def key(self, rank: int, size: int) -> QueueKey:
        return (0, 0)

    def classes_ahead(self, rank: int) -> int:
        return self.n_classes  # everything queued is ahead

    def pick(self, mq: ModelQueues, now: float, skipped: set[QueueKey]) -> tuple[TenantQueue, bool] | None:
        q = mq.by_key.get((0, 0))
        if q is None or q.count == 0 or (0, 0) in skipped:
            return None
        return q, False


def queue_order(cfg: SchedulerConfig, n_classes: int) -> QueueOrder:
    return FifoOrder(cfg, n_classes) if cfg.policy == "fifo" else ClassOrder(cfg, n_classes)
