"""The KV reservations: the registered workers, what each holds, and the one place
a reservation is made, re-priced and released.

Each worker has a KV budget ``capacity x (1 - kv_safety_margin) x
overcommit``.  A job reserves ``kv_cost(prompt, max_tokens, block)`` (its
worst case, rounded to the worker's block size) at dispatch and releases it
exactly once: on finish/abort/error/cancel, generation deadline or worker
loss."""

from __future__ import annotations

from router.policy.estimate import kv_cost
from router.policy.model import ModelState
from router.policy.records import GONE, PLACED, Entry, WorkerState
from router.policy.types import WorkerSpec
from shared.config import SchedulerConfig


class Reservations:
    """The workers by id, and each model's records by name (made on first use)."""

    def __init__(
        self, cfg: SchedulerConfig, n_classes: int, entries: dict[str, Entry], counters: dict[str, int]
    ) -> None:
        self.cfg = cfg
        self.n_classes = n_classes
        self.models: dict[str, ModelState] = {}
        self.workers: dict[str, WorkerState] = {}
        self.entries = entries
        self.counters = counters

    def model(self, name: str) -> ModelState:
        m = self.models.get(name)
        if m is None:
            m = self.models[name] = ModelState(name, self.n_classes)
        return m

    # ------------------------------------------------------------ workers

    def add_worker(self, spec: WorkerSpec, now: float) -> None:
        """Register a worker not registered now (``remove_worker`` it first)."""
        w = WorkerState(spec, self.cfg)
        self.workers[spec.worker_id] = w
        m = self.model(spec.model)
        m.workers[spec.worker_id] = w
        m.workers = dict(sorted(m.workers.items()))  # by id: ties in placement go to the lowest
        m.free.touch(w)
        m.fleet_changed(now)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        """Forget a worker: the ids of the jobs that ran there, released."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        m = self.models.get(w.spec.model)
        if m is not None:
            m.workers.pop(worker_id, None)
            w.healthy = False
            m.free.touch(w)  # out of the free sets
            m.fleet_changed(now)
        lost = list(w.running)
        for job_id in lost:
            e = self.entries.pop(job_id, None)
            if e is not None:
                e.state = GONE
        w.running.clear()
        w.reserved = 0
        self.counters["lost_with_worker"] += len(lost)
        self.counters["released"] += len(lost)
        return lost

    # ------------------------------------------------------------ reservations

    def reserve(self, m: ModelState, e: Entry, w: WorkerState, cost: int) -> None:
        """``e`` runs on ``w`` now, holding ``cost`` KV tokens there."""
        e.state = PLACED
        e.worker = w.spec.worker_id
        e.cost = cost
        w.running[e.job.job_id] = cost
        w.reserved += cost
        m.free.touch(w)  # one bucket up in its free set, or out of it

    def release(self, e: Entry, now: float, count_rate: bool) -> None:
        """``e`` ended: its reservation goes back (``count_rate``: a completion,
        a sample of the drain rate)."""
        self.entries.pop(e.job.job_id, None)
        e.state = GONE
        w = self.workers.get(e.worker) if e.worker else None
        if w is not None and w.running.pop(e.job.job_id, None) is not None:
            w.reserved -= e.cost
            m = self.model(w.spec.model)
            m.free.touch(w)  # one bucket down in its free set, or into it
            if count_rate:
                m.totals.meter.add(now, e.tokens)
        self.counters["released"] += 1

    def reprice(self, e: Entry) -> None:
        """A running ``e``'s prompt was re-counted: its reservation follows."""
        w = self.workers.get(e.worker) if e.worker else None
        job = e.job
        if w is None or job.job_id not in w.running:
            return
        new = kv_cost(job.prompt_tokens, job.max_tokens, w.spec.block_size, job.n, w.spec.shares_prompt)
        w.reserved += new - e.cost
        w.running[job.job_id] = new
        e.cost = new
