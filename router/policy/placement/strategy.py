"""The placement strategies: the pipeline that places one job.

``ScoredPlacement`` (the default) runs candidates -> filters -> scorers ->
picker: ``candidates`` (every worker, or a sample in a large fleet),
``filters.takes_work`` and the worker filters, ``filters.fits`` and the
candidate filters, then ``picker.pick`` by the load and affinity scorers
(``scorers``): least loaded first, prefix affinity within a load margin.
``RoundRobin`` (``placement="round_robin"``, a benchmark baseline) has every
filter and ranks by the distance after the worker used last instead of the
load.  The lists are chosen once, at construction."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from router.fleet.prefix_index import PrefixIndex
from router.policy.adapter_placement import AdapterPlacement
from router.policy.estimate import kv_cost
from router.policy.model import ModelState
from router.policy.placement.ask import Ask, Candidate
from router.policy.placement.candidates import candidates
from router.policy.placement.filters import (
    CandidateFilter,
    WorkerFilter,
    class_headroom,
    fits,
    gpu_floor,
    pools,
    preferred_pool,
    takes_work,
)
from router.policy.placement.picker import pick
from router.policy.placement.scorers import LOAD, AffinityScorer, Scorer, prefix_cached
from router.policy.queues import QueueOrder
from router.policy.records import Entry, WorkerState
from router.policy.sessions import SessionTable
from router.policy.types import LONG, PLACE_SCAN_ALL, POOL_ANY, POOL_LONG, POOL_SHORT
from shared.config import SchedulerConfig
from shared.protocol import Pool

if TYPE_CHECKING:
    from router.policy.targets import Targets

# (worker, its KV cost there)
Placed = tuple[WorkerState, int]


class ScoredPlacement:
    remembers = False  # does ``placed`` keep state (else it is not called)?
    sessions: SessionTable | None = None  # session affinity (set by the Policy; None: off)
    targets: Targets | None = None  # latency targets (set by the Policy)

    def __init__(self, cfg: SchedulerConfig, order: QueueOrder, n_classes: int, prefix: PrefixIndex) -> None:
        self.cfg = cfg
        self.n_classes = n_classes
        self.headroom = order.headroom
        self.short_borrows_freely = order.short_borrows_freely
        self.prefix = prefix
        self.affinity = cfg.prefix_affinity
        # which workers hold which LoRA adapters (reported) and their loads in flight
        self.adapters = AdapterPlacement(cfg.adapter_loads_in_flight, cfg.adapter_affinity, cfg.adapter_load_s)
        self.rng = random.Random(0)  # placement samples in large fleets: seeded, runs repeat
        self.scan_all: float = PLACE_SCAN_ALL  # (the DES sets it higher to compare with scoring all)
        # The pipeline: what drops a worker (after ``takes_work``; ``fits``
        # between the two lists), what ranks the rest.
        floor: tuple[WorkerFilter, ...] = (gpu_floor(cfg),) if cfg.gpu_free_floor_bytes > 0 else ()
        self.worker_filters: tuple[WorkerFilter, ...] = (*floor, pools(cfg, self.short_borrows_freely))
        self.candidate_filters: tuple[CandidateFilter, ...] = (class_headroom, preferred_pool)
        self.load: tuple[Scorer, ...] = LOAD
        self.affinity_scorers: tuple[AffinityScorer, ...] = (prefix_cached(cfg),) if cfg.prefix_affinity else ()
        self.margin = cfg.prefix_load_margin
        self.ask: Ask | None = None  # one, reset at each placement
        # the pools a job of each size may use, in order of preference
        self.long_pools = (POOL_LONG, POOL_ANY)
        borrows = self.short_borrows_freely or cfg.borrow_idle_long
        self.short_pools = (POOL_SHORT, POOL_ANY, POOL_LONG) if borrows else (POOL_SHORT, POOL_ANY)
        # limits[rank][top]: what class ``rank`` may fill while ``top`` (above it)
        # is the highest active class, computed once (``limit`` runs at every head)
        self.capped = self.headroom > 0.0 and n_classes > 1
        self.limits = [
            [1.0 - self.headroom * (rank - top) / (n_classes - 1) if self.capped else 1.0 for top in range(rank)]
            for rank in range(n_classes)
        ]

    # ------------------------------------------------------------ per worker, beside the pipeline

    def limit(self, m: ModelState, rank: int, now: float) -> float:
        """Fraction of a worker's KV budget and seq slots class ``rank`` may fill.
        Only classes above it that submitted recently (within the aging bound)
        get room kept for them, so a single-class deployment wastes nothing."""
        if rank == 0 or not self.capped:
            return 1.0
        horizon = now - self.cfg.aging_bound_s
        last_seen = m.queues.last_seen
        for top in range(rank):
            if last_seen[top] >= horizon:
                return self.limits[rank][top]
        return 1.0  # no class above it is active

    def gpu_ok(self, w: WorkerState) -> bool:
        """Does its GPU take new work (the snapshot's health; placement's
        ``takes_work`` and ``gpu_floor`` filters, one worker)?"""
        if w.gpu_block is not None:
            return False
        floor = self.cfg.gpu_free_floor_bytes
        if floor <= 0 or w.spec.gpu_total_bytes <= 0 or w.gpu_used is None:
            return True
        return w.spec.gpu_total_bytes - w.gpu_used >= floor

    def pool_ok(self, w: WorkerState, size: int, m: ModelState | None) -> bool:
        """May a job of this size run on this worker?  ``m`` None: ever (at
        submit), else now (the borrow condition is checked).  (The ``pools``
        filter, one worker: admission and ``reserve_target`` ask it.)"""
        pool = w.spec.pool
        if pool == Pool.ANY:
            return True
        if size == LONG:
            return pool == Pool.LONG
        if pool == Pool.SHORT or self.short_borrows_freely:
            return True
        # a short job on a long worker: only if configured, and while no long work waits
        return self.cfg.borrow_idle_long and (m is None or m.queues.long_queued() == 0)

    def placed(self, m: ModelState, worker_id: str) -> None:
        """A job was dispatched to ``worker_id`` (a strategy that remembers it may)."""

    # ------------------------------------------------------------ placement

    def place(
        self,
        m: ModelState,
        e: Entry,
        exclude: set[str],
        due: bool,
        now: float,
        again: bool = False,
        limit: float = -1.0,
    ) -> Placed | None:
        """Best worker that can take ``e`` now and its KV cost there, or None.
        ``limit``: its class's cap if the caller has it (``room_below_cap``)."""
        if due:
            limit = 1.0
        elif limit < 0.0:
            limit = self.limit(m, e.rank, now)
        size = e.size
        ws, complete = candidates(
            m, self.long_pools if size == LONG else self.short_pools, again, limit, self.scan_all, self.rng
        )
        if not ws:
            return None  # no worker with a free slot below the class's cap
        job = e.job
        hits = self.prefix.match(job.model, job.block_hashes, now) if job.block_hashes and self.affinity else None
        if hits and not complete:  # a sample: the workers holding the prefix are scored too
            workers = m.workers
            ws = [*ws, *(workers[wid] for wid in hits if wid in workers)]
        lora = job.lora_id if self.adapters.enabled else 0
        if lora and not complete:  # a sample: the workers holding (or loading) its adapter are scored too
            workers = m.workers
            ws = [*ws, *(workers[wid] for wid in self.adapters.holders(lora) if wid in workers)]
        load = self.load
        sessions = self.sessions
        if sessions is not None and job.session:
            home = sessions.home(job, now)
            if home is not None:  # its session's worker first, while below the load bound
                load = (*load, sessions.sticky(home))
                if not complete and home in m.workers:
                    ws = [*ws, m.workers[home]]
            else:  # a new session: where the fewest sessions are
                spread = sessions.spread(len(m.workers))
                if spread is not None:
                    load = (*load, spread)
        ask = self.ask
        if ask is None:
            ask = self.ask = Ask(m, e, exclude, limit, hits)
        else:
            ask.reset(m, e, exclude, limit, hits)
        found = takes_work(ask, ws)
        for keep in self.worker_filters:
            if not found:
                break
            found = keep(ask, found)
        cands: list[Candidate] = fits(ask, found) if found else []
        if lora and cands:  # its adapter held, cached or a free slot ahead; none where loads in flight are at the bound
            cands = self.adapters.admissible(cands, lora)
            load = (*load, self.adapters.scorer(lora))
        for keep_c in self.candidate_filters:
            if not cands:
                break
            cands = keep_c(ask, cands)
        targets = self.targets
        if cands and targets is not None and (targets.pending or targets.decoding):
            # a job with a target: where it is met with the most headroom
            headroom = targets.place(job.job_id, cands, now, job.arrival, due)
            if headroom is not None:
                if not headroom:
                    return None  # it waits for a worker that meets its TPOT target
                load = (*load, lambda _ask, _cands: headroom)
        if cands:
            w, cost, _, _ = pick(ask, cands, load, self.affinity_scorers, self.margin)
            return w, cost
        if ask.kv_short and not complete and not again:
            # Nothing drawn had the KV (a KV-heavy job among workers with free
            # slots): one more draw, then it waits this pass.  (Short of slots
            # or class headroom, a redraw rarely finds better and doubled the
            # cost of a miss: 187 -> ~120 us a request at 100,000 queued.)
            return self.place(m, e, exclude, due, now, True, limit)
        return None

    def room_below_cap(self, m: ModelState, rank: int, now: float) -> float:
        """Class ``rank``'s cap (``limit``) if any worker of the model has a
        free slot below it now, else -1.0: then no head of the class, or of
        a class below it (whose cap is no higher), can be placed until a job
        ends, and the dispatch pass stops."""
        limit = self.limit(m, rank, now)
        if limit >= 1.0 or m.free.any_below_cap(limit):
            return limit
        return -1.0

    def reserve_target(self, m: ModelState, e: Entry, exclude: set[str]) -> str | None:
        """The worker a due head is waiting for: the eligible one closest to fitting it."""
        job = e.job
        prompt = max(1, job.prompt_tokens)
        total = prompt + max(0, job.max_tokens)
        best = None
        best_key = None
        for wid, w in m.workers.items():
            if wid in exclude or not w.healthy or w.gpu_block is not None or not self.pool_ok(w, e.size, m):
                continue
            if total > w.spec.max_model_len:
                continue
            cost = kv_cost(prompt, job.max_tokens, w.spec.block_size, job.n, w.spec.shares_prompt)
            if cost > w.budget:
                continue
            key = (w.budget - w.reserved - w.other_tokens - cost, -len(w.running) - w.other_seqs)
            if best_key is None or key > best_key:
                best, best_key = wid, key
        return best


class RoundRobin(ScoredPlacement):
    """Every filter of ``ScoredPlacement``; the one load scorer is the
    distance after the worker used last (a benchmark baseline)."""

    remembers = True

    def __init__(self, cfg: SchedulerConfig, order: QueueOrder, n_classes: int, prefix: PrefixIndex) -> None:
        super().__init__(cfg, order, n_classes, prefix)
        self.next_index = 0  # the index (in worker id order) after the worker used last
        self.load = (self.after_last,)

    def after_last(self, ask: Ask, cands: list[Candidate]) -> list[float]:
        """Nearest after the worker used last first (in worker id order)."""
        order = list(ask.m.workers)
        start = self.next_index
        return [-float((order.index(w.spec.worker_id) - start) % len(order)) for w, _, _, _ in cands]

    def placed(self, m: ModelState, worker_id: str) -> None:
        self.next_index = list(m.workers).index(worker_id) + 1


def placement(cfg: SchedulerConfig, order: QueueOrder, n_classes: int, prefix: PrefixIndex) -> ScoredPlacement:
    cls = RoundRobin if cfg.placement == "round_robin" else ScoredPlacement
    return cls(cfg, order, n_classes, prefix)
