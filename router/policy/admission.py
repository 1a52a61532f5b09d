"""Admission: queue a job, or say now why not.

400 when no registered worker of the job's pool could ever hold it (context
length or KV budget); 503 when no worker of that model/pool is registered;
429 when its predicted queue wait is over its class's bound
(``max_predicted_wait_s``, default ``queue_deadline_s``):
``queue_wait_exceeded``, or ``tenant_share_exceeded`` when its tenant alone
is over its weighted share (wait_model); 429 when a count bound -- memory
protection only -- is hit (class queue per model, tenant's queued total)."""

from __future__ import annotations

import math
from typing import Any

from router.policy.entries import EntryTable
from router.policy.estimate import kv_cost
from router.policy.placement import ScoredPlacement
from router.policy.queues import QueueOrder, TenantQueue
from router.policy.records import Entry
from router.policy.reservations import Reservations
from router.policy.targets import Targets
from router.policy.types import LONG, NO_WORKER_RETRY_S, SHORT, SIZE_NAMES, Job
from router.policy.wait_model import WaitModel
from shared.config import ClassConfig, SchedulerConfig
from shared.errors import Code, Refusal
from shared.protocol import TaskType

# Plain ints: an enum member's lookup costs more than the compare (once per submit).
_SHORT_TASK, _LONG_TASK = int(TaskType.SHORT), int(TaskType.LONG)


class Admission:
    targets: Targets | None = None  # latency targets (set by the Policy)

    def __init__(
        self,
        cfg: SchedulerConfig,
        classes: list[ClassConfig],
        table: EntryTable,
        reservations: Reservations,
        order: QueueOrder,
        placement: ScoredPlacement,
        waits: WaitModel,
        counters: dict[str, int],
    ) -> None:
        self.cfg = cfg
        self.classes = classes
        self.rank = {c.name: i for i, c in enumerate(classes)}
        self.n_classes = len(classes)
        self.table = table
        self.reservations = reservations
        self.order = order
        self.placement = placement
        self.waits = waits
        self.counters = counters
        self.keys = [[order.key(r, size) for size in (SHORT, LONG)] for r in range(self.n_classes)]

    def submit(self, job: Job, now: float, requeue: bool) -> Refusal | None:
        """``Policy.submit`` for a job the policy does not hold."""
        self.counters["requeued" if requeue else "submitted"] += 1
        rank = self.rank.get(job.klass, self.n_classes - 1)  # unknown class: the lowest
        prompt = job.prompt_tokens if job.prompt_tokens > 1 else 1
        total = prompt + (job.max_tokens if job.max_tokens > 0 else 0)
        # Its size: as the caller says, else by estimated tokens.
        task_type = job.task_type
        if task_type == _SHORT_TASK:
            size = SHORT
        elif task_type == _LONG_TASK:
            size = LONG
        else:
            size = SHORT if total <= self.cfg.short_threshold_tokens else LONG
        m = self.reservations.models.get(job.model) or self.reservations.model(job.model)
        if not m.workers and not requeue:
            self.counters["rejected_no_worker"] += 1
            return Refusal(Code.NO_WORKER, NO_WORKER_RETRY_S, {"model": job.model})
        if m.eligible is None:
            pool_ok = self.placement.pool_ok
            m.eligible = {sz: [w for w in m.workers.values() if pool_ok(w, sz, None)] for sz in (SHORT, LONG)}
        eligible = m.eligible[size]
        if not eligible and not requeue:
            self.counters["rejected_no_worker"] += 1
            return Refusal(Code.NO_WORKER, NO_WORKER_RETRY_S, {"model": job.model, "pool": SIZE_NAMES[size]})
        for w in eligible:  # can any worker ever hold it? (usually the first one says yes)
            spec = w.spec
            if (
                total <= spec.max_model_len
                and kv_cost(prompt, job.max_tokens, spec.block_size, job.n, spec.shares_prompt) <= w.budget
            ):
                break
        else:
            if eligible:  # (a requeued job may wait for a worker that can)
                self.counters["rejected_context_length"] += 1
                max_len = max(w.spec.max_model_len for w in eligible)
                facts: dict[str, Any] = {"prompt": prompt, "completion": job.max_tokens, "max_len": max_len, "n": job.n}
                if total <= max_len:  # fits the context, not any worker's KV budget
                    facts["kv_tokens"] = max(w.budget for w in eligible)
                return Refusal(Code.CONTEXT_LENGTH, None, facts, "n" if job.n > 1 and total <= max_len else "messages")
        # Hard count bounds: memory protection only (a queued request costs
        # the router ~1 KB, bench/README.md), far above what the wait bound admits.
        if m.queues.class_count[rank] >= self.classes[rank].max_queue:
            self.counters["rejected_queue_full"] += 1
            return Refusal(
                Code.QUEUE_FULL, self.waits.retry_after(m, rank, total, now), {"klass": self.classes[rank].name}
            )
        if self.table.tenant_count.get(job.tenant, 0) >= self.cfg.max_queue_per_tenant:
            self.counters["rejected_tenant_queue_full"] += 1
            return Refusal(Code.TENANT_QUEUE_FULL, self.waits.retry_after(m, rank, total, now), {"tenant": job.tenant})
        table = self.table
        table.seq += 1
        e = Entry(job, rank, size, table.seq)
        bound = self.waits.bound[rank]
        if bound < math.inf and not requeue:
            if m.totals.queued == 0:
                # Nothing queued: nothing is ahead of it, its predicted wait is 0
                # -- the common case below saturation, and the prediction costs
                # ~15 us (measured in-process: 25 -> 41 us per request without this).
                e.predicted = 0.0
            else:
                refusal = self.waits.admit(m, e, bound, now)
                if refusal is not None:
                    return refusal
            if job.lora_id and e.predicted >= 0.0:  # its adapter's load if no worker of its model holds it
                e.predicted += self.placement.adapters.load_wait(m.workers, job.lora_id)
        # (last: a prediction is kept only for a job that is queued)
        targets = self.targets
        if targets is not None and not requeue:
            c = self.classes[rank]
            target = job.ttft_target_s or c.ttft_target_ms / 1000.0
            tpot = job.tpot_target_s or c.tpot_target_ms / 1000.0
            if target > 0.0 or tpot > 0.0:
                refusal = targets.admit(m, e, now, target, tpot, job.sheddable or c.sheddable, c.name)
                if refusal is not None:
                    return refusal
        key = self.keys[rank][size]
        q = m.queues.by_key.get(key)
        if q is None:
            q = m.queues.by_key[key] = TenantQueue(
                rank, size, self.cfg.short_threshold_tokens, by_tenant=self.order.by_tenant
            )
        table.enqueue(m, q, e, now)
        return None
