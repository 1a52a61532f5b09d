"""Where a job runs: the candidates, the checks every candidate passes, the
score, prefix affinity and sampling in large fleets.

``ScoredPlacement`` (the default) places least loaded first; ``RoundRobin``
(``placement="round_robin"``, a benchmark baseline) takes the next worker
after the one used last.  Both share every check: they differ only in the
score, chosen once per placement."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

from router.fleet.prefix_index import PrefixIndex
from router.policy.estimate import kv_cost
from router.policy.model import ModelState
from router.policy.queues import QueueOrder
from router.policy.records import Entry, WorkerState
from router.policy.sessions import SessionTable
from router.policy.types import LONG, PLACE_SAMPLE, PLACE_SCAN_ALL, POOL_ANY, POOL_LONG, POOL_SHORT, SHORT
from shared.config import SchedulerConfig
from shared.protocol import Pool

# (worker, its KV cost there)
Placed = tuple[WorkerState, int]
# (pool preference, score, worker, cost): the candidates prefix affinity chooses among
Candidate = tuple[int, float, WorkerState, int]
Scorer = Callable[[WorkerState, Entry, int, int], float]


class ScoredPlacement:
    remembers = False  # does ``placed`` keep state (else it is not called)?
    sessions: SessionTable | None = None  # session affinity (set by the Policy; None: off)

    def __init__(self, cfg: SchedulerConfig, order: QueueOrder, n_classes: int, prefix: PrefixIndex) -> None:
        self.cfg = cfg
        self.n_classes = n_classes
        self.headroom = order.headroom
        self.short_borrows_freely = order.short_borrows_freely
        self.prefix = prefix
        self.affinity = cfg.prefix_affinity
        self.rng = random.Random(0)  # placement samples in large fleets: seeded, runs repeat
        self.scan_all: float = PLACE_SCAN_ALL  # (the DES sets it higher to compare with scoring all)
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

    # ------------------------------------------------------------ checks

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
        if w.gpu_block is not None:
            return False
        floor = self.cfg.gpu_free_floor_bytes
        if floor <= 0 or w.spec.gpu_total_bytes <= 0 or w.gpu_used is None:
            return True
        return w.spec.gpu_total_bytes - w.gpu_used >= floor

    def pool_ok(self, w: WorkerState, size: int, m: ModelState | None) -> bool:
        """May a job of this size run on this worker?  ``m`` None: ever (at
        submit), else now (the borrow condition is checked)."""
        pool = w.spec.pool
        if pool == Pool.ANY:
            return True
        if size == LONG:
            return pool == Pool.LONG
        if pool == Pool.SHORT or self.short_borrows_freely:
            return True
        # a short job on a long worker: only if configured, and while no long work waits
        return self.cfg.borrow_idle_long and (m is None or m.queues.long_queued() == 0)

    # ------------------------------------------------------------ scoring

    def score(self, w: WorkerState, e: Entry, after: int, n: int) -> float:
        """How good a home ``w`` is for ``e`` (higher is better), given that
        it may take it: KV budget left once placed (``after`` tokens held),
        seq slots left (``n`` held now) and GPU memory free, each 0..1 --
        least loaded first.  The one place a term of placement goes."""
        budget, max_seqs = w.budget, w.slots
        score = (budget - after) / budget + (max_seqs - n - 1) / max_seqs
        gpu_total = w.spec.gpu_total_bytes
        if gpu_total > 0 and w.gpu_used is not None:
            score += max(0, gpu_total - w.gpu_used) / gpu_total
        return score

    def scorer(self, m: ModelState) -> Scorer:
        """The score ``place`` ranks the candidates of one placement by."""
        return self.score

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
        ``limit``: its class's cap if the caller has it (``room_below_cap``).

        Runs once per dispatch and per worker, so the checks of ``gpu_ok``
        and ``pool_ok`` are inlined and KV costs computed once per block size."""
        if due:
            limit = 1.0
        elif limit < 0.0:
            limit = self.limit(m, e.rank, now)
        size = e.size
        candidates, complete = self.candidates(m, size, again, limit)
        if not candidates:
            return None  # no worker with a free slot below the class's cap
        job = e.job
        prompt = job.prompt_tokens
        if prompt < 1:
            prompt = 1
        max_tokens = job.max_tokens
        total = prompt + (max_tokens if max_tokens > 0 else 0)
        own_pool = POOL_SHORT if size == SHORT else POOL_LONG
        floor = self.cfg.gpu_free_floor_bytes
        may_borrow = self.cfg.borrow_idle_long
        borrow_freely = self.short_borrows_freely
        long_idle = None  # m.queues.long_queued() == 0, looked up only if a borrow is considered
        cost_bs = cost = -1
        seqs = job.n
        cost_shared = False
        cap_of = cap = -1  # the class's seq cap on a worker of cap_of slots, computed once per size
        kv_short = False  # a candidate lacked KV (not a slot): another draw may find one that has it
        best: Placed | None = None
        best_pref = -1
        best_score = 0.0
        score_of = self.scorer(m)
        sessions = self.sessions
        home = sessions.home(job, now) if sessions is not None and job.session else None
        if sessions is not None and home is not None:  # its session's worker first, while below the load bound
            score_of = sessions.sticky(score_of, home)
            if not complete and home in m.workers:
                candidates = [*candidates, m.workers[home]]
        elif sessions is not None and job.session:  # a new session: where the fewest sessions are
            score_of = sessions.spread(score_of, len(m.workers))
        hits = self.prefix.match(job.model, job.block_hashes, now) if job.block_hashes and self.affinity else None
        cands: list[Candidate] | None = [] if hits else None  # affinity chooses among them
        if hits and not complete:  # a sample: the workers holding the prefix are scored too
            workers = m.workers
            candidates = [*candidates, *(workers[wid] for wid in hits if wid in workers)]
        for w in candidates:
            if not w.healthy or w.gpu_block is not None or (exclude and w.spec.worker_id in exclude):
                continue
            spec = w.spec
            if floor > 0:
                gpu_total = spec.gpu_total_bytes
                if gpu_total > 0 and w.gpu_used is not None and gpu_total - w.gpu_used < floor:
                    continue  # gpu_ok
            pool = spec.pool
            if pool != POOL_ANY:  # pool_ok
                if size == LONG:
                    if pool != POOL_LONG:
                        continue
                elif pool != POOL_SHORT and not borrow_freely:
                    if not may_borrow:
                        continue
                    if long_idle is None:
                        long_idle = m.queues.long_queued() == 0
                    if not long_idle:
                        continue
            n = len(w.running) + w.other_seqs
            max_seqs = w.slots
            if n >= max_seqs or total > spec.max_model_len:
                continue
            if spec.block_size != cost_bs or (seqs > 1 and spec.shares_prompt != cost_shared):
                cost_bs, cost_shared = spec.block_size, spec.shares_prompt
                cost = kv_cost(prompt, max_tokens, cost_bs, seqs, cost_shared)
            budget = w.budget
            after = w.reserved + w.other_tokens + cost
            if after > budget:
                kv_short = True
                continue
            if n > 0 and limit < 1.0:
                if max_seqs != cap_of:
                    cap_of, cap = max_seqs, int(max_seqs * limit)
                    if cap < 1:
                        cap = 1  # max(1, ...), without the call
                if n >= cap:
                    continue  # class headroom: the rest is kept for higher classes
                if after > budget * limit:
                    kv_short = True
                    continue
            pref = 2 if pool == own_pool else (1 if pool == POOL_ANY else 0)
            if pref < best_pref:
                continue
            score = score_of(w, e, after, n)
            if cands is not None:
                cands.append((pref, score, w, cost))
            # (pref, score) beats the best so far; ties keep the lower worker id
            if best is None or pref > best_pref or score > best_score:
                best, best_pref, best_score = (w, cost), pref, score
        if best is None and kv_short and not complete and not again:
            # Nothing drawn had the KV (a KV-heavy job among workers with free
            # slots): one more draw, then it waits this pass.  (Short of slots
            # or class headroom, a redraw rarely finds better and doubled the
            # cost of a miss: 187 -> ~120 us a request at 100,000 queued.)
            return self.place(m, e, exclude, due, now, True, limit)
        if cands and best is not None and hits:
            return self.affine(cands, best_pref, best_score, hits, prompt)
        return best

    def affine(
        self, cands: list[Candidate], best_pref: int, best_score: float, hits: dict[str, int], prompt: int
    ) -> Placed | None:
        """Prefix affinity, bounded by load: among the candidates of the best
        pool preference within ``prefix_load_margin`` of the least loaded,
        the highest load score + weight x cached fraction of the prompt."""
        floor = best_score - self.cfg.prefix_load_margin
        weight = self.cfg.prefix_affinity_weight
        best: Placed | None = None
        best_total = 0.0
        for pref, score, w, cost in cands:  # (in worker id order: ties keep the lowest)
            if pref != best_pref or score < floor:
                continue
            cached = hits.get(w.spec.worker_id, 0) * w.spec.block_size
            total = score + weight * min(1.0, cached / prompt)
            if best is None or total > best_total:
                best, best_total = (w, cost), total
        return best

    def candidates(
        self, m: ModelState, size: int, again: bool, limit: float = 1.0
    ) -> tuple[Collection[WorkerState], bool]:
        """The workers ``place`` scores, and whether they are all it could:
        every worker of a small fleet (in id order), else PLACE_SAMPLE from
        the free sets of the pools a job of this size may use, in order of
        preference (a short job: short, any, long), each cut to the workers
        below the class's seq cap ``limit`` (a prefix: the sets are sorted by
        occupancy) -- a pool's whole cut while it is smaller than what is
        left to draw -- or, the second time (``again``), drawn across all of
        them alike.  No worker below the cap anywhere: none, at once."""
        if len(m.workers) <= self.scan_all:
            return m.workers.values(), True
        pools, total = m.free.below_cap(self.long_pools if size == LONG else self.short_pools, limit)
        if total <= PLACE_SAMPLE:
            return [w for p, n in pools for w in p[:n]], True
        draw = self.rng.random  # (int(draw() * n): a third of randrange's cost)
        out: list[WorkerState] = []
        if not again:
            for p, n in pools:
                left = PLACE_SAMPLE - len(out)
                if n <= left:
                    out.extend(p[:n])
                else:
                    out.extend([p[int(draw() * n)] for _ in range(left)])
                    break
            return out, False
        for _ in range(PLACE_SAMPLE):
            i = int(draw() * total)
            for p, n in pools:
                if i < n:
                    out.append(p[i])
                    break
                i -= n
        return out, False

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
    """Every check of ``ScoredPlacement``; the score is the distance after the
    worker used last (a benchmark baseline)."""

    remembers = True

    def __init__(self, cfg: SchedulerConfig, order: QueueOrder, n_classes: int, prefix: PrefixIndex) -> None:
        super().__init__(cfg, order, n_classes, prefix)
        self.next_index = 0  # the index (in worker id order) after the worker used last

    def scorer(self, m: ModelState) -> Scorer:
        order = list(m.workers)
        start = self.next_index

        def nearest_after_last(w: WorkerState, e: Entry, after: int, n: int) -> float:
            return -float((order.index(w.spec.worker_id) - start) % len(order))

        return nearest_after_last

    def placed(self, m: ModelState, worker_id: str) -> None:
        self.next_index = list(m.workers).index(worker_id) + 1


def placement(cfg: SchedulerConfig, order: QueueOrder, n_classes: int, prefix: PrefixIndex) -> ScoredPlacement:
    cls = RoundRobin if cfg.placement == "round_robin" else ScoredPlacement
    return cls(cfg, order, n_classes, prefix)
