"""The dispatch loop and expiry: what ``Policy.schedule`` does at each pass,
and when the next pass is due.

Per model, while a worker has a free slot: the queue order picks a queue,
placement a worker for its head; a head that fits nowhere is skipped
(backfill) unless the order is strict, and once due the worker closest to
fitting it is reserved for it.  Queued jobs past their class
``queue_deadline_s`` are refused; running jobs past ``generation_deadline_s``
are aborted."""

from __future__ import annotations

import heapq
from collections import deque

from router.fleet.prefix_index import PrefixIndex
from router.policy.entries import EntryTable
from router.policy.model import ModelState
from router.policy.placement import ScoredPlacement
from router.policy.queues import QueueKey, QueueOrder, TenantQueue
from router.policy.records import PLACED, Entry, WorkerState
from router.policy.reservations import Reservations
from router.policy.types import LONG, SHORT, AbortJob, Action, DispatchJob, RejectJob
from router.policy.wait_model import WaitModel
from shared.config import ClassConfig, SchedulerConfig
from shared.errors import Code, Refusal


class Dispatcher:
    def __init__(
        self,
        cfg: SchedulerConfig,
        classes: list[ClassConfig],
        table: EntryTable,
        reservations: Reservations,
        order: QueueOrder,
        placement: ScoredPlacement,
        waits: WaitModel,
        prefix: PrefixIndex,
        counters: dict[str, int],
    ) -> None:
        self.cfg = cfg
        self.classes = classes
        self.table = table
        self.entries = table.entries
        self.reservations = reservations
        self.models = reservations.models
        self.order = order
        self.placement = placement
        self.waits = waits
        self.prefix = prefix
        self.counters = counters
        self.affinity = cfg.prefix_affinity
        self.deadlines: list[tuple[float, int, str]] = []  # generation deadlines (lazy heap)
        # per class: (predicted, actual) queue wait of the last dispatches, for /admin/queues
        self.wait_samples: list[deque[tuple[float, float]]] = [deque(maxlen=2048) for _ in classes]
        # (rank, queue deadline) of the classes that have one: what ``_expire_queued`` looks at
        self.queue_deadlines = [(r, c.queue_deadline_s) for r, c in enumerate(classes) if c.queue_deadline_s > 0]

    def has_queued(self) -> bool:
        """Is any job waiting?  If not, ``schedule`` can only expire running
        jobs, which ``next_wakeup`` already times: callers may skip it."""
        for m in self.models.values():
            if any(m.queues.class_count):
                return True
        return False

    def schedule(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self.deadlines:
            self._expire_running(now, actions)
        for m in self.models.values():
            if not any(m.queues.class_count):
                continue  # nothing queued: nothing to expire or dispatch
            self._expire_queued(m, now, actions)
            # cheap exit for the common busy case: every worker full (or unusable)
            if any(m.queues.class_count) and m.free.any_free():
                self._dispatch_model(m, now, actions)
        return actions

    def _dispatch_model(self, m: ModelState, now: float, actions: list[Action]) -> None:
        order = self.order
        place = self.placement.place
        room = self.placement.room_below_cap
        mq = m.queues
        skipped: set[QueueKey] = set()
        reserved: set[str] = set()
        blocked_before = False
        last: TenantQueue | None = None
        while True:
            if last is not None and last.count:
                # The queue just served, not due, with no other size of its
                # class competing: the order picks it again (no queue becomes
                # due within a pass, none gains work, ``skipped`` is as it was).
                q, due = last, False
            else:
                picked = order.pick(mq, now, skipped)
                if picked is None:
                    return
                q, due = picked
            last = None
            e = q.peek()
            if e is None:  # only dead entries were left
                skipped.add(order.key(q.rank, q.size))
                continue
            limit = -1.0
            if not due and order.backfill:
                limit = room(m, q.rank, now)
                if limit < 0.0:
                    # No worker has a free slot below this class's cap.  No due
                    # queue is left (the order serves them first, and none
                    # becomes due within a pass), and every other queue is of
                    # this class or a lower one, whose cap is no higher: each
                    # head would miss.
                    return
            placed = place(m, e, reserved, due, now, False, limit)
            if placed is not None:
                w, cost = placed
                both = order.sizes_compete(mq, q, skipped)
                self._dispatch(m, q, e, w, cost, now, actions)
                if both:
                    mq.wrr[q.rank][q.size] += e.tokens
                elif not due:
                    last = q
                if due:
                    self.counters["aged_dispatches"] += 1
                if blocked_before:
                    self.counters["backfilled"] += 1
                continue
            if not order.backfill:
                return  # strict order: the head blocks everything behind it
            skipped.add((q.rank, q.size))
            blocked_before = True
            if due:
                target = self.placement.reserve_target(m, e, reserved)
                if target is not None:
                    reserved.add(target)

    def _dispatch(
        self, m: ModelState, q: TenantQueue, e: Entry, w: WorkerState, cost: int, now: float, actions: list[Action]
    ) -> None:
        q.pop(e)
        q.last_dispatch = now
        job = e.job
        self.table.unqueue(m, e, now)
        if e.predicted >= 0.0:
            self.wait_samples[e.rank].append((e.predicted, now - job.arrival))
        targets = self.placement.targets
        if targets is not None:
            if targets.decoding:
                targets.dispatched(job.job_id, w)  # (its TPOT there, before it joins the count)
            if targets.ahead_at:
                targets.dispatching(job.job_id)  # (how many went before it: before this one counts)
            md = targets.model_dispatched
            md[m.name] = md.get(m.name, 0) + 1
        self.reservations.reserve(m, e, w, cost)
        e.placed_step = w.steps
        worker_id = w.spec.worker_id
        if job.block_hashes and self.affinity:
            self.prefix.speculate(worker_id, job.block_hashes, now)
        if self.placement.remembers:
            self.placement.placed(m, worker_id)
        if job.lora_id:
            self.placement.adapters.dispatched(worker_id, job.lora_id, now)
        if job.session and self.placement.sessions is not None:
            self.placement.sessions.placed(job, worker_id, now)
        if self.cfg.generation_deadline_s > 0:
            h = self.deadlines
            if len(h) > 1024 and len(h) > 4 * len(self.entries):
                # most entries belong to jobs that already ended: drop them in one pass
                h[:] = [x for x in h if (y := self.entries.get(x[2])) is not None and y.seq == x[1]]
                heapq.heapify(h)
            heapq.heappush(h, (now + self.cfg.generation_deadline_s, e.seq, job.job_id))
        self.counters["dispatched"] += 1
        actions.append(DispatchJob(job.job_id, worker_id, e.rank if self.order.ranked else 0))

    # ------------------------------------------------------------ expiry

    def _expire_queued(self, m: ModelState, now: float, actions: list[Action]) -> None:
        mq = m.queues
        count = mq.class_count
        for rank, d in self.queue_deadlines:
            if count[rank] == 0:
                continue  # nothing of this class queued (and its indexes are empty)
            for size in (SHORT, LONG):
                index = mq.by_arrival[(rank, size)]
                while (e := mq.oldest(rank, size)) is not None and now - e.job.arrival >= d:
                    index.popleft()
                    self._reject_expired(m, e, now, actions)

    def _reject_expired(self, m: ModelState, e: Entry, now: float, actions: list[Action]) -> None:
        job = e.job
        self.table.drop_queued(m, e, now)
        self.counters["expired_queue_deadline"] += 1
        retry = self.waits.retry_after(m, e.rank, 0, now)
        actions.append(
            RejectJob(
                job.job_id,
                Refusal(
                    Code.QUEUE_DEADLINE,
                    retry,
                    {
                        "waited": now - job.arrival,
                        "klass": self.classes[e.rank].name,
                        "deadline": self.classes[e.rank].queue_deadline_s,
                    },
                ),
            )
        )

    def _expire_running(self, now: float, actions: list[Action]) -> None:
        h = self.deadlines
        while h and h[0][0] <= now:
            _, seq, job_id = heapq.heappop(h)
            e = self.entries.get(job_id)
            if e is None or e.state != PLACED or e.seq != seq:
                continue
            wid = e.worker
            self.reservations.release(e, now, count_rate=False)
            self.counters["aborted_generation_deadline"] += 1
            actions.append(
                AbortJob(
                    job_id,
                    wid or "",
                    Refusal(Code.GENERATION_DEADLINE, None, {"deadline": self.cfg.generation_deadline_s}),
                )
            )

    def next_wakeup(self, now: float) -> float | None:
        t: float | None = None
        h = self.deadlines
        while h:
            deadline, seq, job_id = h[0]
            e = self.entries.get(job_id)
            if e is None or e.state != PLACED or e.seq != seq:
                heapq.heappop(h)
                continue
            t = deadline
            break
        ages = self.order.ages
        promote_after = self.cfg.aging_bound_s / 2.0
        for m in self.models.values():
            mq = m.queues
            for rank, n in enumerate(mq.class_count):
                if n == 0:
                    continue  # nothing of this class queued: no deadline, nothing to age
                d = self.classes[rank].queue_deadline_s
                for size in (SHORT, LONG):
                    oldest = mq.oldest(rank, size)
                    if oldest is None:
                        continue
                    arrival = oldest.job.arrival
                    if d > 0 and (t is None or arrival + d < t):
                        t = arrival + d
                    q = mq.by_key.get((rank, size))
                    if ages and q is not None:
                        due_at = max(q.last_dispatch, arrival) + promote_after
                        if due_at > now and (t is None or due_at < t):
                            t = due_at
        return t
