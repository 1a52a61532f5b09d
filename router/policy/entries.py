"""The policy's entry table (its ``Entry`` per job it holds) and the
transitions of a waiting entry: into a queue (``enqueue``), out of it
(``unqueue``: dispatched, or ``drop_queued``: expired or ended before it
ran), each keeping every count over the queues exact."""

from __future__ import annotations

from router.policy.model import ModelState
from router.policy.queues import TenantQueue, insert_by_arrival
from router.policy.records import GONE, Entry


class EntryTable:
    """Every entry the policy holds, waiting or placed, by job id, and the
    queued count per tenant (what ``max_queue_per_tenant`` bounds)."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.tenant_count: dict[str, int] = {}
        self.seq = 0  # entries made so far: tells a job's generation-deadline record from a stale one

    def enqueue(self, m: ModelState, q: TenantQueue, e: Entry, now: float) -> None:
        q.push(e)
        mq = m.queues
        mq.queued(q, e)
        rank = e.rank
        job = e.job
        insert_by_arrival(mq.by_arrival[(rank, e.size)], e)
        if now > mq.last_seen[rank]:
            mq.last_seen[rank] = now
        self.entries[job.job_id] = e
        mq.class_count[rank] += 1
        totals = m.totals
        totals.account(e, 1, now)
        totals.inflow[rank].add(now, e.tokens)
        tenant = job.tenant
        self.tenant_count[tenant] = self.tenant_count.get(tenant, 0) + 1

    def unqueue(self, m: ModelState | None, e: Entry, now: float) -> None:
        """``e`` left the queued state (its queue already updated)."""
        if m is not None:
            mq = m.queues
            rank = e.rank
            mq.class_count[rank] -= 1
            if mq.class_count[rank] == 0:
                mq.dequeued(rank)
            m.totals.account(e, -1, now)
        tenant = e.job.tenant
        n = self.tenant_count.get(tenant, 0) - 1
        if n > 0:
            self.tenant_count[tenant] = n
        else:
            self.tenant_count.pop(tenant, None)

    def drop_queued(self, m: ModelState | None, e: Entry, now: float) -> None:
        """A queued ``e`` ended without running (expired, cancelled)."""
        self.entries.pop(e.job.job_id, None)
        e.state = GONE
        if e.queue is not None:
            e.queue.forget(e)
        self.unqueue(m, e, now)
