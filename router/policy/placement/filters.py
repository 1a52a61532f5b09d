"""Filters: each drops the workers a job may not use now, for one reason.

Worker filters (``Ask``, workers -> the workers kept) run first:
``takes_work``, then the strategy's ``WorkerFilter``s; ``fits`` then prices
the job on each worker left and keeps those whose context length and KV
budget hold it (``Candidate``s); the ``CandidateFilter``s run last.  Each is
pure but for ``Ask.kv_short``; the order only decides what ``kv_short``
says (a worker lacked KV, not something else).  One list pass each:
placement runs at every dispatch."""

from __future__ import annotations

from collections.abc import Callable, Collection

from router.policy.estimate import kv_cost
from router.policy.placement.ask import Ask, Candidate
from router.policy.records import WorkerState
from router.policy.types import LONG, POOL_ANY, POOL_LONG, POOL_SHORT
from shared.config import SchedulerConfig

WorkerFilter = Callable[[Ask, Collection[WorkerState]], Collection[WorkerState]]
CandidateFilter = Callable[[Ask, list[Candidate]], list[Candidate]]


def takes_work(ask: Ask, ws: Collection[WorkerState]) -> Collection[WorkerState]:
    """Healthy with a free sequence slot (its own and other routers' held:
    exactly the workers in a free set, ``free_at >= 0``, records.FreeSlots),
    its GPU not gated (router.policy.gpu_gate), not held for a due head."""
    exclude = ask.exclude
    if exclude:
        return [w for w in ws if w.free_at >= 0 and w.gpu_block is None and w.spec.worker_id not in exclude]
    for w in ws:
        if w.free_at < 0 or w.gpu_block is not None:
            return [w for w in ws if w.free_at >= 0 and w.gpu_block is None]
    return ws  # (all of them, the usual case: no list made)


def gpu_floor(cfg: SchedulerConfig) -> WorkerFilter:
    """GPU free memory at least ``gpu_free_floor_bytes`` (where the worker
    reports its GPU)."""
    floor = cfg.gpu_free_floor_bytes

    def gpu_free_enough(ask: Ask, ws: Collection[WorkerState]) -> Collection[WorkerState]:
        return [
            w
            for w in ws
            if w.spec.gpu_total_bytes <= 0 or w.gpu_used is None or w.spec.gpu_total_bytes - w.gpu_used >= floor
        ]

    return gpu_free_enough


def pools(cfg: SchedulerConfig, borrow_freely: bool) -> WorkerFilter:
    """Long work never on a short-only worker; short work on a long worker
    only if it borrows freely (``FifoOrder``), or with ``borrow_idle_long``
    while no long work of the model waits."""
    may_borrow = cfg.borrow_idle_long

    def pool_allows(ask: Ask, ws: Collection[WorkerState]) -> Collection[WorkerState]:
        present = ask.m.pools
        if ask.size == LONG:
            return [w for w in ws if w.pool != POOL_SHORT] if POOL_SHORT in present else ws
        if borrow_freely or POOL_LONG not in present:
            return ws
        kept = [w for w in ws if w.pool != POOL_LONG]
        # (whether long work waits: looked up only if a long worker is there to borrow)
        if may_borrow and len(kept) < len(ws) and ask.m.queues.long_queued() == 0:
            return ws
        return kept

    return pool_allows


def fits(ask: Ask, ws: Collection[WorkerState]) -> list[Candidate]:
    """The workers the job fits now: prompt + max_tokens within their context
    length, and its KV cost there (per block size, computed once) within
    what their budget has left; with what they would hold."""
    out: list[Candidate] = []
    append = out.append
    job = ask.e.job
    prompt, max_tokens, seqs = ask.prompt, job.max_tokens, job.n
    total = prompt + (max_tokens if max_tokens > 0 else 0)
    cost_bs = cost = -1
    cost_shared = False
    for w in ws:
        spec = w.spec
        if total > spec.max_model_len:
            continue
        if spec.block_size != cost_bs or (seqs > 1 and spec.shares_prompt != cost_shared):
            cost_bs, cost_shared = spec.block_size, spec.shares_prompt
            cost = kv_cost(prompt, max_tokens, cost_bs, seqs, cost_shared)
        after = w.reserved + w.other_tokens + cost
        if after > w.budget:
            ask.kv_short = True
            continue
        append((w, cost, after, len(w.running) + w.other_seqs))
    return out


def class_headroom(ask: Ask, cands: list[Candidate]) -> list[Candidate]:
    """Class headroom: below the class's cap (``Ask.limit``) of seq slots and
    KV budget, the rest kept for higher classes; an empty worker takes any
    job that fits."""
    limit = ask.limit
    if limit >= 1.0:
        return cands
    out = []
    cap_of = cap = -1  # the cap on a worker of cap_of slots, computed once per size
    for c in cands:
        w, _, after, n = c
        if n > 0:
            if w.slots != cap_of:
                cap_of, cap = w.slots, int(w.slots * limit)
                if cap < 1:
                    cap = 1  # max(1, ...), without the call
            if n >= cap:
                continue
            if after > w.budget * limit:
                ask.kv_short = True
                continue
        out.append(c)
    return out


def preferred_pool(ask: Ask, cands: list[Candidate]) -> list[Candidate]:
    """Those of the most preferred pool among them: a job's own pool (short
    or long), then "any", then a borrowed long worker."""
    if len(cands) == 1 or len(ask.m.pools) == 1:
        return cands  # one pool (usually "any"): nothing to prefer
    present = {c[0].pool for c in cands}
    if len(present) == 1:
        return cands
    own = POOL_SHORT if ask.size != LONG else POOL_LONG
    best = own if own in present else POOL_ANY
    return [c for c in cands if c[0].pool == best]
