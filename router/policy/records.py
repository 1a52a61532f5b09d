"""The policy's own records: one per job it holds, one per worker, and the
per-pool sets of workers with a free slot."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.policy.types import POOL_ANY, POOL_LONG, POOL_SHORT, Job, WorkerSpec
from shared.config import SchedulerConfig

if TYPE_CHECKING:
    from router.policy.queues import TenantQueue

# An entry's state.  Plain ints: compared in the hot loops.  QUEUED -> RUNNING
# (Ledger.reserve) -> DONE (Ledger.release, Ledger.remove_worker); QUEUED -> DONE
# (JobTable.drop_queued).
QUEUED, RUNNING, DONE = 0, 1, 2


class Entry:
    """A job inside the policy (queued or running).  ``job`` is the policy's
    copy: it may be the caller's object until a re-pricing, which replaces it
    with a copy instead of writing to the caller's."""

    __slots__ = ("job", "rank", "size", "tokens", "state", "worker", "cost", "seq", "queue", "predicted")

    def __init__(self, job: Job, rank: int, size: int, seq: int) -> None:
        self.job = job
        self.rank = rank
        self.size = size
        p, mt = job.prompt_tokens, job.max_tokens
        self.tokens = (p if p > 1 else 1) + (mt if mt > 0 else 0) * job.n  # max(1, p) + n * max(0, mt)
        self.state = QUEUED
        self.worker: str | None = None
        self.cost = 0  # KV tokens reserved on self.worker
        self.seq = seq
        self.queue: TenantQueue | None = None
        self.predicted = -1.0  # queue wait predicted at admission (s); -1: none (no bound)


class WorkerState:
    """A worker's ledger: its budget, what it holds and whether it may take work."""

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
    )

    def __init__(self, spec: WorkerSpec, cfg: SchedulerConfig) -> None:
        self.spec = spec
        self.healthy = True
        self.gpu_used: int | None = None
        self.gpu_block: str | None = None  # router.gpu_gate: why its GPU takes no new work
        self.reserved = 0
        self.running: dict[str, int] = {}  # job id -> reserved KV tokens
        self.budget = cfg.kv_budget(spec.capacity_tokens)
        self.slots = cfg.seq_slots(spec.max_num_seqs)  # jobs it may hold at once
        # Held there for other routers, as the worker last said (heartbeat or
        # refusal; engine_worker.ledger): counted as taken in placement.
        self.other_tokens = 0
        self.other_seqs = 0
        self.free_at = -1  # its index in its model's free set of its pool (-1: full or unhealthy)


class FreeSlots(dict[int, list[WorkerState]]):
    """Per pool: a model's healthy workers with a free sequence slot, in no
    order (swap-remove: O(1) updates), for placement in large fleets."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__({POOL_ANY: [], POOL_SHORT: [], POOL_LONG: []})

    def touch(self, w: WorkerState) -> None:
        """``w``'s running count, health or other routers' share changed: keep
        the sets right."""
        free = w.healthy and len(w.running) + w.other_seqs < w.slots
        i = w.free_at
        if free == (i >= 0):
            return
        lst = self[int(w.spec.pool)]
        if free:
            w.free_at = len(lst)
            lst.append(w)
        else:
            last = lst.pop()
            if last is not w:
                lst[i] = last
                last.free_at = i
            w.free_at = -1

    def any_free(self) -> bool:
        return bool(self[POOL_ANY] or self[POOL_SHORT] or self[POOL_LONG])
