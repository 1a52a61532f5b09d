"""``Policy``: the one object the router (and the DES) drives.  It composes
the concerns -- admission, the queue order, the wait model, placement, the
reservations and the dispatch loop -- and answers the router's lookups."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from router.fleet.prefix_index import PrefixIndex
from router.policy.admission import Admission
from router.policy.dispatch import Dispatcher
from router.policy.entries import EntryTable
from router.policy.gpu_gate import gpu_block
from router.policy.placement import placement
from router.policy.queues import queue_order
from router.policy.records import PLACED, WAITING
from router.policy.reservations import Reservations
from router.policy.sessions import SessionTable
from router.policy.targets import Targets
from router.policy.types import LONG, SHORT, SIZE_NAMES, Action, Job, WorkerSpec
from router.policy.wait_model import WaitModel
from shared.config import SchedulerConfig
from shared.errors import Refusal
from shared.protocol import POOL_NAMES, GpuInfo


class Policy:
    def __init__(self, cfg: SchedulerConfig) -> None:
        if not cfg.classes:
            raise ValueError("scheduler needs at least one class")
        self.cfg = cfg
        self.classes = list(cfg.classes)
        self.n_classes = len(self.classes)
        self.counters: dict[str, int] = {
            "submitted": 0,
            "requeued": 0,
            "dispatched": 0,
            "finished": 0,
            "released": 0,
            "rejected_no_worker": 0,
            "rejected_context_length": 0,
            "rejected_queue_full": 0,
            "rejected_tenant_queue_full": 0,
            "rejected_predicted_wait": 0,
            "rejected_tenant_share": 0,
            "expired_queue_deadline": 0,
            "aborted_generation_deadline": 0,
            "lost_with_worker": 0,
            "taken_off": 0,
            "backfilled": 0,
            "aged_dispatches": 0,
            "refused_by_worker": 0,
        }
        self.prefix = PrefixIndex(cfg.prefix_index_max_blocks, cfg.prefix_speculative_ttl_s)
        # The strategies, chosen once: the order queued work is served in, and where it runs.
        self.order = queue_order(cfg, self.n_classes)
        self.placement = placement(cfg, self.order, self.n_classes, self.prefix)
        self.sessions = SessionTable(
            cfg.session_max, cfg.session_ttl_s, cfg.session_load_bound, self.counters, cfg.session_max_per_tenant
        )
        if cfg.sessions:
            self.placement.sessions = self.sessions
        self.table = EntryTable()
        self.reservations = Reservations(cfg, self.n_classes, self.table.entries, self.counters)
        self.waits = WaitModel(self.classes, self.order, self.counters)
        self.admission = Admission(
            cfg, self.classes, self.table, self.reservations, self.order, self.placement, self.waits, self.counters
        )
        self.targets = Targets(self.waits, self.prefix, self.counters, self.table.entries)
        self.admission.targets = self.targets
        self.placement.targets = self.targets
        self.dispatcher = Dispatcher(
            cfg,
            self.classes,
            self.table,
            self.reservations,
            self.order,
            self.placement,
            self.waits,
            self.prefix,
            self.counters,
        )
        # The tables, shared with the parts above (read by the router's views and the tests).
        self.models = self.reservations.models
        self.workers = self.reservations.workers
        self.entries = self.table.entries
        self.tenant_count = self.table.tenant_count
        self.wait_samples = self.dispatcher.wait_samples

    @property
    def place_scan_all(self) -> float:
        """Up to this many workers of a model, placement scores every one (the
        DES sets it higher to compare with scoring all)."""
        return self.placement.scan_all

    @place_scan_all.setter
    def place_scan_all(self, n: float) -> None:
        self.placement.scan_all = n

    # ------------------------------------------------------------ workers

    def add_worker(self, spec: WorkerSpec, now: float) -> list[str]:
        """Register or re-register.  A re-registered worker runs nothing: the
        ids of jobs that ran there are released and returned (router fails them)."""
        lost = self.remove_worker(spec.worker_id, now) if spec.worker_id in self.workers else []
        self.reservations.add_worker(spec, now)
        if spec.prefix_hash:
            self.prefix.add_worker(spec.worker_id, spec.model, spec.prefix_hash, spec.block_size, spec.prefix_hash_seed)
        return lost

    def update_worker(
        self,
        worker_id: str,
        now: float,
        *,
        healthy: bool = True,
        gpu_used_bytes: int | None = None,
        gpu: GpuInfo | None = None,
        other_tokens: int | None = None,
        other_seqs: int | None = None,
    ) -> None:
        """A worker's news.  ``other_*``: KV tokens and sequences it holds for
        other routers (several routers over one fleet: README, Scaling out)."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.healthy = healthy
        if gpu_used_bytes is not None:
            w.gpu_used = gpu_used_bytes
        if gpu is not None:
            w.gpu_block = gpu_block(gpu, self.cfg)
        if other_tokens is not None:
            w.other_tokens = max(0, other_tokens)
        if other_seqs is not None:
            w.other_seqs = max(0, other_seqs)
        self.models[w.spec.model].free.touch(w)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        """Forget a worker; the ids of the jobs that ran there, released."""
        self.prefix.remove_worker(worker_id)
        self.placement.adapters.remove_worker(worker_id)
        lost = self.reservations.remove_worker(worker_id, now)
        if self.targets.pending or self.targets.decoding:
            for job_id in lost:  # (moved on by the caller: judged where they run next)
                self.targets.taken_off(job_id)
        return lost

    # ------------------------------------------------------------ jobs

    def submit(self, job: Job, now: float, *, requeue: bool = False) -> Refusal | None:
        """Queue a job, or say now why not (a code and its facts).

        ``requeue``: a job admitted before whose worker went (it may have
        streamed output: a continuation).  It is queued even while no worker
        of its model is left -- it waits, up to its queue deadline, for one
        to come back -- and is not measured against the predicted-wait bound
        again; it keeps its place by ``job.arrival``."""
        if job.job_id in self.entries:  # a router bug; keep the reservations exact anyway
            self.finish(job.job_id, now)
        return self.admission.submit(job, now, requeue)

    def schedule(self, now: float) -> list[Action]:
        """Expire what is past its deadline and dispatch what fits: the actions to carry out."""
        return self.dispatcher.schedule(now)

    def has_queued(self) -> bool:
        """Is any job waiting?  If not, ``schedule`` can only expire running
        jobs, which ``next_wakeup`` already times: callers may skip it."""
        return self.dispatcher.has_queued()

    def next_wakeup(self, now: float) -> float | None:
        """When ``schedule`` has something to do next without news (None: nothing)."""
        return self.dispatcher.next_wakeup(now)

    def finish(self, job_id: str, now: float, tpot_s: float = 0.0) -> bool:
        """A job ended (done, aborted, errored, cancelled; queued or running).
        Releases exactly once; True iff this call released or removed something.
        ``tpot_s``: its tokens after the first came this far apart (0: unknown),
        which judges its TPOT target (router.policy.targets)."""
        targets = self.targets
        if targets.pending or targets.decoding or targets.moved:  # (also where the policy released it already)
            if tpot_s > 0.0 and targets.decoding:
                targets.ended(job_id, tpot_s)
            targets.forget(job_id)
        e = self.entries.get(job_id)
        if e is None:
            return False
        if e.state == WAITING:
            self.table.drop_queued(self.models.get(e.job.model), e, now)
            return True
        if targets.pending and e.worker is not None:  # (while jobs with a TTFT target wait: what predicts them)
            w = self.workers.get(e.worker)
            if w is not None:
                targets.released(e, w)
        self.reservations.release(e, now, count_rate=True)
        self.counters["finished"] += 1
        return True

    def taken_off(self, job_id: str, now: float) -> bool:
        """A running job taken off its worker to run again elsewhere (its
        engine died, it stalled, a drain timed out, its worker is unlinked):
        released, but not as an end -- no drain-rate sample, no sample of how
        long jobs run (``Targets.released``: it was cut), and its latency
        targets are judged where it runs next (the caller queues it again:
        ``submit(requeue=True)``).  True iff it held a place here."""
        if not self._take_back(job_id, now, "taken_off"):
            return False
        self.targets.taken_off(job_id)
        return True

    def _take_back(self, job_id: str, now: float, counter: str) -> bool:
        """Release a placed job that did not end (no drain-rate sample): it is queued again."""
        e = self.entries.get(job_id)
        if e is None or e.state != PLACED:
            return False
        self.reservations.release(e, now, count_rate=False)
        self.counters[counter] += 1
        return True

    def stepped(self, worker_id: str, now: float) -> None:
        """One engine step of the worker ended (its output message came):
        the step clock latency targets predict slot releases by."""
        w = self.workers.get(worker_id)
        if w is not None:
            Targets.stepped(w, now)

    def first_token(self, job_id: str, model: str, ttft: float) -> None:
        """A job's first token, ``ttft`` seconds after its arrival: checks its
        latency target's prediction (router.policy.targets)."""
        if self.targets.pending:
            self.targets.first_token(job_id, model, ttft)

    def refused(self, job_id: str, now: float) -> bool:
        """Its worker refused the dispatch (its own ledger, engine_worker.ledger:
        other routers hold the room): release without counting a completion
        (no drain-rate sample); the caller queues it again
        (``submit(requeue=True)``)."""
        return self._take_back(job_id, now, "refused_by_worker")

    def correct_prompt_tokens(self, job_id: str, actual: int) -> None:
        """The engine's exact prompt count: re-price the policy's copy of the
        job and its reservation (the caller's ``Job`` is not written to).
        Upward corrections are kept even past the budget (that is what the
        engine really holds); new work then waits until it drains."""
        e = self.entries.get(job_id)
        if e is None or actual < 1 or actual == e.job.prompt_tokens:
            return  # (a repeat of the count it holds changes nothing)
        queued = e.state == WAITING and e.queue is not None
        m = self.models.get(e.job.model)
        if queued:
            assert e.queue is not None
            e.queue.tokens -= e.tokens
            if m is not None:
                m.totals.account(e, -1, None)
        job = e.job = replace(e.job, prompt_tokens=actual)
        e.tokens = actual + max(0, job.max_tokens) * job.n
        if queued:
            assert e.queue is not None
            e.queue.tokens += e.tokens
            if m is not None:
                m.totals.account(e, 1, None)
        if e.state == PLACED:
            self.reservations.reprice(e)

    # ------------------------------------------------------------ lookups

    def worker_of(self, job_id: str) -> str | None:
        """The worker a job runs on (None: queued, ended or unknown)."""
        e = self.entries.get(job_id)
        return e.worker if e is not None and e.state == PLACED else None

    def cost_of(self, job_id: str) -> int:
        """KV tokens reserved for a running job on its worker (0: not running)."""
        e = self.entries.get(job_id)
        return e.cost if e is not None and e.state == PLACED else 0

    def running_on(self, worker_id: str) -> list[str]:
        w = self.workers.get(worker_id)
        return list(w.running) if w is not None else []

    def pool_of(self, worker_id: str) -> str:
        w = self.workers.get(worker_id)
        return POOL_NAMES.get(w.spec.pool, "any") if w is not None else "-"

    def is_healthy(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.healthy

    # ------------------------------------------------------------ views

    def queued_by_model(self) -> dict[tuple[str, str], int]:
        """Queued requests per (model, pool), all classes: what an autoscaler of
        a model's workers reads (router/observe/ops_metrics.py)."""
        return {
            (m.name, SIZE_NAMES[size]): sum(c[size] for c in m.totals.size_count)
            for m in self.models.values()
            for size in (SHORT, LONG)
        }

    def snapshot(self, now: float) -> dict[str, Any]:
        gpu_ok = self.placement.gpu_ok
        workers = [
            {
                "id": w.spec.worker_id,
                "model": w.spec.model,
                "pool": POOL_NAMES.get(w.spec.pool, "any"),
                "healthy": w.healthy and gpu_ok(w),
                "capacity_tokens": w.spec.capacity_tokens,
                "budget_tokens": w.budget,
                "reserved_tokens": w.reserved,
                "running": len(w.running),
                "max_num_seqs": w.spec.max_num_seqs,
                "gpu_block": w.gpu_block,
                "other_routers_tokens": w.other_tokens,
                "other_routers_seqs": w.other_seqs,
                **self.placement.adapters.view(w.spec.worker_id),
            }
            for w in sorted(self.workers.values(), key=lambda w: w.spec.worker_id)
        ]
        # O(classes x models): /metrics reads this at every scrape, also with 100,000 queued
        queues = []
        for r in range(self.n_classes):
            samples = sorted(abs(a - p) for p, a in self.wait_samples[r])
            for size in (SHORT, LONG):
                n, oldest, by_model = 0, None, {}
                for name, m in self.models.items():
                    k = m.totals.size_count[r][size]
                    if k:
                        n += k
                        by_model[name] = k
                    e = m.queues.oldest(r, size)
                    if e is not None and (oldest is None or e.job.arrival < oldest):
                        oldest = e.job.arrival
                queues.append(
                    {
                        "class": self.classes[r].name,
                        "pool": SIZE_NAMES[size],
                        "queued": n,
                        "oldest_wait_s": 0.0 if oldest is None else max(0.0, now - oldest),
                        # |actual - predicted| queue wait of the class's last dispatches
                        "wait_error_p50_s": _pct(samples, 50),
                        "wait_error_p90_s": _pct(samples, 90),
                        "wait_samples": len(samples),
                        "by_model": by_model,
                    }
                )
        return {
            "workers": workers,
            "queues": queues,
            "counters": dict(self.counters),
            "policy": self.cfg.policy,
            "ttft_prediction_mape": self.targets.mape(),
            "tpot_prediction_mape": self.targets.tpot_mape(),
            "targets": self.targets.view(),
            "sessions": len(self.sessions),
        }


def _pct(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    return round(sorted_vals[min(len(sorted_vals) - 1, int(q / 100.0 * len(sorted_vals)))], 4)
