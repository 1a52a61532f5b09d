"""The policy's own records: one per job it holds, one per worker, and the
per-pool sets of workers with a free slot, ordered by occupancy."""

from __future__ import annotations

from typing import Protocol

from router.policy.types import POOL_ANY, POOL_LONG, POOL_SHORT, Job, WorkerSpec
from shared.config import SchedulerConfig

# An entry's state in the policy (not the job's lifecycle state, which is
# router.lifecycle.jobs.JobState): WAITING in a queue -> PLACED on a worker,
# holding its reservation (Reservations.reserve) -> GONE (Reservations.release,
# .remove_worker); WAITING -> GONE (EntryTable.drop_queued).  Plain ints:
# compared in the hot loops, where an enum member costs a lookup more.
WAITING, PLACED, GONE = 0, 1, 2


class EntryQueue(Protocol):
    """The queue a queued entry waits in, as the entry's owners use it
    (``queues.TenantQueue``; declared here so that the records import no queue)."""

    tokens: int  # its entries' prompt+max_tokens

    def forget(self, e: Entry) -> None: ...


class Entry:
    """A job inside the policy (waiting or placed).  ``job`` is the policy's
    copy: it may be the caller's object until a re-pricing, which replaces it
    with a copy instead of writing to the caller's."""

    __slots__ = ("job", "rank", "size", "tokens", "state", "worker", "cost", "seq", "queue", "predicted", "placed_step")

    def __init__(self, job: Job, rank: int, size: int, seq: int) -> None:
        self.job = job
        self.rank = rank
        self.size = size
        p, mt = job.prompt_tokens, job.max_tokens
        self.tokens = (p if p > 1 else 1) + (mt if mt > 0 else 0) * job.n  # max(1, p) + n * max(0, mt)
        self.state = WAITING
        self.worker: str | None = None
        self.cost = 0  # KV tokens reserved on self.worker
        self.seq = seq
        self.queue: EntryQueue | None = None
        self.predicted = -1.0  # queue wait predicted at admission (s); -1: none (no bound)
        self.placed_step = -1  # self.worker's step count when it was placed there (router.policy.targets)


class WorkerState:
    """A worker's record: its KV budget, what it holds and whether it may take work."""

    __slots__ = (
        "spec",
        "healthy",
        "gpu_used",
        "gpu_block",
        "reserved",
        "running",
        "budget",
        "slots",
        "other_tokens",
        "other_seqs",
        "free_at",
        "free_key",
        "pool",
        "steps",
        "stepped_at",
        "step_gap",
    )

    def __init__(self, spec: WorkerSpec, cfg: SchedulerConfig) -> None:
        self.spec = spec
        self.healthy = True
        self.gpu_used: int | None = None
        self.gpu_block: str | None = None  # router.policy.gpu_gate: why its GPU takes no new work
        self.reserved = 0
        self.running: dict[str, int] = {}  # job id -> reserved KV tokens
        self.budget = cfg.kv_budget(spec.capacity_tokens)
        self.slots = cfg.seq_slots(spec.max_num_seqs)  # jobs it may hold at once
        # Held there for other routers, as the worker last said (heartbeat or
        # refusal; engine_worker.ledger): counted as taken in placement.
        self.other_tokens = 0
        self.other_seqs = 0
        self.free_at = -1  # its index in its model's free set of its pool (-1: full or unhealthy)
        self.free_key = -1  # the sequences it held when last placed in that set's order (-1: not there)
        self.pool = int(spec.pool)  # (a plain int: int() of the enum costs more than the rest of ``touch``)
        # Its engine's steps (one output message each): how many, when the last ended, and the mean
        # time between two while it is busy (router.policy.targets: when its running jobs end)
        self.steps = 0
        self.stepped_at = -1.0
        self.step_gap = spec.step_s()


class FreeSlots(dict[int, list[WorkerState]]):
    """Per pool: a model's healthy workers with a free sequence slot, sorted
    by the sequences each holds (its own and other routers'), so that those
    below a class's seq cap are a prefix of the list and placement draws
    among them only.  ``starts[pool][k]``: how many hold fewer than ``k``,
    for ``k`` up to the most slots any worker of the pool has had.

    A worker's count moves by one at a dispatch or a release: it swaps with
    the edge of its bucket, O(1); a heartbeat that moves other routers' share
    by ``d`` costs O(d), joining or leaving the set O(slots - count)."""

    __slots__ = ("starts",)

    def __init__(self) -> None:
        super().__init__({POOL_ANY: [], POOL_SHORT: [], POOL_LONG: []})
        self.starts: dict[int, list[int]] = {POOL_ANY: [0], POOL_SHORT: [0], POOL_LONG: [0]}

    def touch(self, w: WorkerState) -> None:
        """``w``'s running count, health or other routers' share changed: keep
        the sets and their order right."""
        n = len(w.running) + w.other_seqs
        k = w.free_key
        if k == n and w.healthy:
            return  # free and still in its place (a count is never -1)
        free = w.healthy and n < w.slots
        if not free and k < 0:
            return
        pool = w.pool
        lst = self[pool]
        starts = self.starts[pool]
        top = len(starts) - 1
        if k < 0:  # joins: at the end (bucket ``top``), then down to its count
            if w.slots > top:
                starts.extend([len(lst)] * (w.slots - top))
                top = w.slots
            w.free_at = len(lst)
            lst.append(w)
            k = top
        if not free:
            n = top  # leaves: up to the last bucket, where it is the last one
        i = w.free_at
        while k < n:  # one bucket up: swap with the last of its bucket
            j = starts[k + 1] - 1
            if i != j:  # (the swap, inlined: this runs at every dispatch and release)
                other = lst[j]
                lst[i], lst[j] = other, w
                other.free_at = i
                i = j
            starts[k + 1] = j
            k += 1
        while k > n:  # one bucket down: swap with the first of its bucket
            j = starts[k]
            if i != j:
                other = lst[j]
                lst[i], lst[j] = other, w
                other.free_at = i
                i = j
            starts[k] = j + 1
            k -= 1
        w.free_at = i
        if free:
            w.free_key = n
        else:
            lst.pop()
            w.free_at = w.free_key = -1

    def below_cap(self, pools: tuple[int, ...], limit: float) -> tuple[list[tuple[list[WorkerState], int]], int]:
        """Per pool of ``pools`` with any: its free set and how many of them
        (a prefix) hold fewer sequences than class cap ``limit`` (a fraction
        of seq slots) allows on the largest worker the pool has had --
        exactly those under their own cap where the pool's workers have as
        many slots, else a superset; and their total."""
        out = []
        total = 0
        for pool in pools:
            lst = self[pool]
            if lst:
                n = len(lst)
                if limit < 1.0:
                    starts = self.starts[pool]
                    top = len(starts) - 1
                    cap = int(top * limit)
                    if cap < 1:
                        cap = 1  # max(1, ...), without the call
                    if cap < top:
                        n = starts[cap]
                if n:
                    out.append((lst, n))
                    total += n
        return out, total

    def any_below_cap(self, limit: float) -> bool:
        """Does any pool have a worker in ``below_cap(..., limit)``?  (Its
        total > 0, without building the cut: the dispatch pass asks at each
        head of a capped class.)"""
        for pool, lst in self.items():
            if lst:
                cap = int((len(self.starts[pool]) - 1) * limit)
                # (sorted: its first holds the fewest; one in the set holds fewer than the top bucket)
                if lst[0].free_key < (cap if cap > 1 else 1):
                    return True
        return False

    def any_free(self) -> bool:
        return bool(self[POOL_ANY] or self[POOL_SHORT] or self[POOL_LONG])
