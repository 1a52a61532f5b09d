"""The scheduling policy: who waits, who runs where, who is refused.

Pure: no I/O, no asyncio, no clock reads.  The router's event loop (or the
discrete-event simulation in ``simulation.des``) passes ``now`` in, feeds events
(submit / finish / worker changes) and carries out the returned actions.

Model of the world
------------------
* **Ledger.**  Each worker has a KV budget ``capacity x (1 - kv_safety_margin)
  x overcommit``.  A job reserves ``kv_cost(prompt, max_tokens, block)`` (its
  worst case, rounded to the worker's block size) at dispatch and releases it
  exactly once: on finish/abort/error/cancel (``finish``), generation deadline
  (``AbortJob``) or worker loss (``remove_worker``/re-register).  With
  overcommit 1.0 the engine can never run out of KV, so it never preempts.
  At most ``max_num_seqs`` jobs run per worker (plus ``dispatch_lookahead``,
  default 0), so all waiting -- and all its priorities -- happens here, not
  in an engine's FIFO.  A worker whose GPU
  free memory is under ``gpu_free_floor_bytes``, whose GPU is over a
  temperature or memory threshold (``router.gpu_gate``) or that is unhealthy
  gets no new work.
* **Queues.**  Per model, one queue per (class, size) where size is short or
  long (``task_type``, or prompt+max_tokens against ``short_threshold_tokens``).
  Inside a queue, tenants share by deficit round robin weighted by tokens
  (quantum ``short_threshold_tokens x weight``); each tenant's jobs are FIFO.
  So FIFO holds within (class, tenant, size).
* **Order across queues.**  Strict by class rank (the order of
  ``SchedulerConfig.classes``; it is also the priority passed to vLLM), except
  that a queue that has made no progress for ``aging_bound_s / 2`` (no
  dispatch since its oldest job arrived or since its last dispatch) is *due*:
  due queues go before everything, oldest first, without class headroom.  Half
  the bound is left to drain a worker for the due head, so no class waits
  longer than the bound behind a stream of higher-class work, provided single
  jobs run well under half the bound.  Short and long queues of one class
  share the *tokens* dispatched ``short_share : long_share`` while both wait
  (by tokens, not requests: a long request holds KV and a slot many times
  longer than a short one).
* **Backfill.**  A head that fits no worker now is skipped and what is behind
  it in the order may go (other queues; FIFO inside a queue is kept).  Once the
  head is due, the worker closest to fitting it is reserved for it: nothing
  else is dispatched there until the head goes.
* **Class headroom** (``priority_headroom`` h): class rank r may fill a
  worker's KV budget and seq slots only up to ``1 - h x (r - top)/(K-1)``,
  where ``top`` is the highest class that submitted work within the aging
  bound.  Room is kept for higher classes only while they are active, so under
  overload a high-priority request starts at once instead of waiting for a
  running job to end, and a deployment that uses one class wastes nothing.  An
  empty worker takes any job that fits its budget.
* **Placement score** among workers that can take the job now: first pool
  preference (a short job prefers a short worker, then "any", then a
  borrowed idle long worker; a long job prefers long, then "any"), then the
  highest sum of three fractions, each 0..1: KV budget left after placing the
  job, seq slots left, GPU memory free (0 without a GPU) -- i.e. least loaded
  first, which keeps batches (and so step times) even (``_score``: one
  function, every term of a candidate's score).  Ties go to the lowest
  worker id, which keeps runs deterministic.
* **Placement cost.**  Up to ``PLACE_SCAN_ALL`` workers of a model every
  worker is scored, as above.  Beyond, the policy keeps, per model and pool,
  the set of workers with a free sequence slot (updated in O(1) at each
  dispatch, release and heartbeat) and scores ``PLACE_SAMPLE`` drawn at
  random from the sets the job may use (a second draw if none fits), so
  placement costs the same at 1,024 workers as at 16 -- the power of k
  choices, as SMG's router does; a seeded generator keeps runs
  deterministic.  A head that fits none drawn is skipped this pass
  (backfill), and once due the closest worker is reserved for it
  (``_reserve_target``, a full scan, only then).  The workers whose cache
  holds the job's prefix (below) are scored beside those drawn.
* **Prefix affinity** (``_affine``): where the prefix index
  (router/prefix_index.py) says a worker's cache holds the job's leading
  prompt blocks, the score gains ``prefix_affinity_weight x`` the cached
  fraction of the prompt -- only among the workers of the best pool
  preference whose load score is within ``prefix_load_margin`` of the best.
  It only chooses among workers that passed every check above (KV ledger,
  slots, headroom, pools, GPU floor): affinity never over-commits, and the
  reservation stays the job's full worst case (cached blocks are shared, not
  pinned: the engine may evict them before the job's prefill).
* **Pools.**  Long work never lands on a short-only worker.  Short work may
  borrow a long-pool worker when ``borrow_idle_long`` and no long work of that
  model is queued (the long worker is idle as far as long work goes).
* **Refusals.**  400 when no registered worker of the job's pool could ever
  hold it (context length or KV budget); 503 when no worker of that
  model/pool is registered; 429 when its predicted queue wait is over its
  class's bound (``max_predicted_wait_s``, default ``queue_deadline_s``):
  ``queue_wait_exceeded``, or ``tenant_share_exceeded`` when its tenant alone
  is over its weighted share (see ``_ahead``); 429 when a count bound --
  memory protection only -- is hit (class queue per model, tenant's queued
  total); 503 when a job waited past its class ``queue_deadline_s``.
* **Predicted wait** = reserved tokens ahead (``_ahead``) / drain rate
  (``_drain_rate``): tokens released per second of backlog (exponentially
  weighted, 30 s of backlog), blended with a capacity model of the
  registered engines (``_capacity_rate``) that alone decides on a cold
  fleet, less the inflow of higher classes.  Retry-After of a wait refusal:
  when the job's place in line, behind earlier refusals of its tenant and
  class, is half a bound away; of the others: the drain time of the queue
  ahead.
* ``policy="fifo"``: one FIFO per model with the same ledger, limits and pool
  rules (short work may use any worker), no priorities, no backfill (the head
  blocks), priority 0 to vLLM: the baseline the DES compares against.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from router.estimate import kv_cost
from router.gpu_gate import gpu_block
from router.prefix_index import PrefixIndex
from shared.config import ClassConfig, SchedulerConfig, SimEngineConfig
from shared.errors import Code, Refusal
from shared.protocol import GpuInfo, Pool, TaskType

__all__ = ["WorkerSpec", "Job", "DispatchJob", "RejectJob", "AbortJob", "Action", "Policy"]

POOL_NAMES = {Pool.ANY: "any", Pool.SHORT: "short", Pool.LONG: "long"}
SHORT, LONG = 0, 1
SIZE_NAMES = ("short", "long")

NO_WORKER_RETRY_S = 2.0  # nothing to drain: a worker registering is what is awaited
RATE_TAU_S = 30.0  # memory of the drain-rate estimate, in seconds of backlog
# The capacity model (from what engines registered with) counts as PRIOR_S
# seconds of measured backlog, fading as releases are seen (_RateMeter): it
# decides a burst on a cold fleet alone.
PRIOR_S = 5.0
PRIOR_JOBS = 8.0
# Engine step time when a worker does not report one: the sim engine's
# calibration on the tiny model (shared/config.py SimEngineConfig, measured
# against vLLM's CPU build): 2.3 ms a step + 60 us per running sequence, i.e.
# 3.3 ms at 16 sequences (vLLM measured 3.30 ms).
DEFAULT_STEP_FIXED_S = SimEngineConfig().step_fixed_ms / 1e3
DEFAULT_STEP_PER_SEQ_S = SimEngineConfig().decode_token_us / 1e6
DEFAULT_PREFILL_TOKEN_S = SimEngineConfig().prefill_token_us / 1e6
# ... and each new request costs the engine 1.1 ms of serial work (vLLM's
# frontend tokenizes and ships it to its EngineCore), which every running
# sequence waits for.
DEFAULT_REQUEST_S = SimEngineConfig().admit_request_us / 1e6
MIN_RETRY_S, MAX_RETRY_S = 1.0, 3600.0
# Placement: up to this many workers of a model, score each one; beyond,
# score PLACE_SAMPLE drawn from those with a free slot (bench/scenarios/placement.py:
# the per-request cost then stays flat from 16 to 1,024 workers).
PLACE_SCAN_ALL = 16
PLACE_SAMPLE = 4

_QUEUED, _RUNNING, _DONE = 0, 1, 2
# Plain ints for the hot loops (an IntEnum attribute lookup costs more than the compare).
_POOL_ANY, _POOL_SHORT, _POOL_LONG = int(Pool.ANY), int(Pool.SHORT), int(Pool.LONG)


@dataclass(slots=True)
class WorkerSpec:
    """What a worker registered with."""

    worker_id: str
    model: str
    pool: Pool
    capacity_tokens: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    gpu_total_bytes: int = 0  # 0 = no GPU / unknown
    # Seconds of one engine step with a full batch (max_num_seqs running), for
    # the wait prediction before anything was measured.  None: the sim
    # calibration, DEFAULT_STEP_FIXED_S + DEFAULT_STEP_PER_SEQ_S x max_num_seqs.
    step_time_s: Optional[float] = None
    request_overhead_s: Optional[float] = None  # engine time per new request; None: DEFAULT_REQUEST_S

    def request_s(self) -> float:
        if self.request_overhead_s is not None and self.request_overhead_s >= 0:
            return self.request_overhead_s
        return DEFAULT_REQUEST_S

    def step_s(self) -> float:
        if self.step_time_s is not None and self.step_time_s > 0:
            return self.step_time_s
        return DEFAULT_STEP_FIXED_S + DEFAULT_STEP_PER_SEQ_S * max(1, self.max_num_seqs)
    shares_prompt: bool = False  # prefix caching: n sequences hold one prompt (estimate.kv_cost)
    prefix_hash: str = ""  # its engine's block hash scheme (Register.prefix_hash); "": cache-blind
    prefix_hash_seed: str = ""


@dataclass(slots=True)
class Job:
    job_id: str
    model: str
    tenant: str
    klass: str  # a class name from config
    prompt_tokens: int  # estimate (router.estimate); corrected by correct_prompt_tokens
    max_tokens: int
    task_type: TaskType
    arrival: float
    weight: float = 1.0  # tenant's fair-share weight inside its class
    n: int = 1  # sequences (OpenAI's n): KV and token budgets count all of them
    block_hashes: Sequence[int] = ()  # the prompt's full blocks (router.block_hash), for prefix affinity


class DispatchJob(NamedTuple):
    job_id: str
    worker_id: str
    priority: int  # for vLLM: lower runs first


class RejectJob(NamedTuple):
    job_id: str
    error: Refusal  # left the queue (queue deadline); nothing was reserved


class AbortJob(NamedTuple):
    job_id: str
    worker_id: str
    error: Refusal  # ran past the generation deadline; ledger already released


Action = Union[DispatchJob, RejectJob, AbortJob]


# ----------------------------------------------------------------- internals


class _Entry:
    """A job inside the policy (queued or running)."""

    __slots__ = ("job", "rank", "size", "tokens", "state", "worker", "cost", "dispatched_at",
                 "seq", "queue", "predicted")

    def __init__(self, job: Job, rank: int, size: int, seq: int) -> None:
        self.job = job
        self.rank = rank
        self.size = size
        p, mt = job.prompt_tokens, job.max_tokens
        self.tokens = (p if p > 1 else 1) + (mt if mt > 0 else 0) * job.n  # max(1, p) + n * max(0, mt)
        self.state = _QUEUED
        self.worker: Optional[str] = None
        self.cost = 0  # KV tokens reserved on self.worker
        self.dispatched_at = 0.0
        self.seq = seq
        self.queue: Optional[_Queue] = None
        self.predicted = -1.0  # queue wait predicted at admission (s); -1: none (no bound)


class _Worker:
    __slots__ = ("spec", "healthy", "gpu_used", "gpu_block", "reserved", "running", "budget", "slots",
                 "other_tokens", "other_seqs", "free_at")

    def __init__(self, spec: WorkerSpec, cfg: SchedulerConfig) -> None:
        self.spec = spec
        self.healthy = True
        self.gpu_used: Optional[int] = None
        self.gpu_block: Optional[str] = None  # router.gpu_gate: why its GPU takes no new work
        self.reserved = 0
        self.running: dict[str, int] = {}  # job id -> reserved KV tokens
        self.budget = cfg.kv_budget(spec.capacity_tokens)
        self.slots = cfg.seq_slots(spec.max_num_seqs)  # jobs it may hold at once
        # Held there for other routers, as the worker last said (heartbeat or
        # refusal; engine_worker.ledger): counted as taken in placement.
        self.other_tokens = 0
        self.other_seqs = 0
        self.free_at = -1  # its index in its model's free set of its pool (-1: full or unhealthy)


class _Queue:
    """One (model, class, size) queue: FIFO per tenant, deficit round robin
    by tokens across tenants.  Entries that left (finish) are skipped lazily."""

    __slots__ = ("rank", "size", "quantum", "by_tenant", "tenants", "active", "deficit", "weight",
                 "visited", "count", "tokens", "last_dispatch")

    def __init__(self, rank: int, size: int, quantum: int, by_tenant: bool = True) -> None:
        self.rank = rank
        self.size = size
        self.quantum = max(1, quantum)
        self.by_tenant = by_tenant  # False: one FIFO for everyone (policy="fifo")
        self.tenants: dict[str, deque[_Entry]] = {}
        self.active: deque[str] = deque()  # round-robin order of tenants with work
        self.deficit: dict[str, float] = {}
        self.weight: dict[str, float] = {}
        self.visited = False  # the front tenant got its quantum for this visit
        self.count = 0  # live queued entries
        self.tokens = 0  # their prompt+max_tokens, for drain estimates
        self.last_dispatch = -math.inf

    def push(self, e: _Entry) -> None:
        t = e.job.tenant if self.by_tenant else ""
        dq = self.tenants.get(t)
        if dq is None:
            dq = self.tenants[t] = deque()
        if not dq:
            if t not in self.deficit:
                self.active.append(t)
                self.deficit[t] = 0.0
        self.weight[t] = max(1e-3, e.job.weight)
        _insert_by_arrival(dq, e)
        e.queue = self
        self.count += 1
        self.tokens += e.tokens

    def forget(self, e: _Entry) -> None:
        """Bookkeeping for an entry that left without being dispatched."""
        self.count -= 1
        self.tokens -= e.tokens
        e.queue = None

    def _head(self, t: str) -> Optional[_Entry]:
        dq = self.tenants[t]
        while dq and dq[0].state != _QUEUED:
            dq.popleft()
        return dq[0] if dq else None

    def _deactivate_front(self) -> None:
        t = self.active.popleft()
        del self.deficit[t]
        del self.tenants[t]
        self.weight.pop(t, None)
        self.visited = False

    def peek(self) -> Optional[_Entry]:
        """The entry DRR serves next (advances round state; idempotent until pop)."""
        misses = 0
        while self.active:
            t = self.active[0]
            head = self._head(t)
            if head is None:
                self._deactivate_front()
                continue
            if not self.visited:
                self.deficit[t] += self.quantum * self.weight[t]
                self.visited = True
            if head.tokens <= self.deficit[t]:
                return head
            self.visited = False
            self.active.rotate(-1)
            misses += 1
            if misses >= len(self.active):
                # A whole round served nobody: grant the rounds the closest
                # tenant still needs in one go (exact DRR, bounded work).
                need = [math.ceil((h.tokens - self.deficit[u]) / (self.quantum * self.weight[u]))
                        for u in self.active if (h := self._head(u)) is not None]
                rounds = min(need) if need else 0
                if rounds > 1:
                    for u in self.active:
                        self.deficit[u] += (rounds - 1) * self.quantum * self.weight[u]
                misses = 0
        return None

    def pop(self, e: _Entry) -> None:
        """``e`` (the last peek) was dispatched."""
        t = self.active[0]
        dq = self.tenants[t]
        assert dq[0] is e
        dq.popleft()
        self.deficit[t] -= e.tokens
        self.count -= 1
        self.tokens -= e.tokens
        e.queue = None
        if self._head(t) is None:
            self._deactivate_front()


class _RateMeter:
    """Drain rate: reserved tokens (prompt + max_tokens) released per second
    *of backlog*, exponentially weighted over ``tau`` seconds of backlog.

    Only time during which work was queued counts, and only releases then:
    an idle or lightly loaded fleet releases what it is offered, not what it
    can do, and a burst after a quiet hour must not be judged by the quiet
    hour.  ``rate`` blends in a prior (the capacity model) worth ``PRIOR_S``
    seconds of backlog until ``PRIOR_JOBS`` releases were seen, then less and
    less: how much a measurement says depends on how many releases it saw."""

    __slots__ = ("tau", "tokens", "jobs", "window", "t", "busy")

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.tokens = 0.0  # decayed tokens released while backlogged
        self.jobs = 0.0  # decayed count of those releases
        self.window = 0.0  # decayed seconds of backlog
        self.t: Optional[float] = None
        self.busy = False

    def _decay(self, now: float) -> tuple[float, float, float]:
        t = self.t
        if t is None or now <= t or not self.busy:
            return self.tokens, self.jobs, self.window
        d = math.exp(-(now - t) / self.tau)
        return self.tokens * d, self.jobs * d, self.window * d + self.tau * (1.0 - d)

    def _advance(self, now: float) -> None:
        self.tokens, self.jobs, self.window = self._decay(now)
        if self.t is None or now > self.t:
            self.t = now

    def set_busy(self, now: float, busy: bool) -> None:
        if busy != self.busy:
            self._advance(now)
            self.busy = busy

    def add(self, now: float, tokens: float) -> None:
        if self.busy:
            self._advance(now)
            self.tokens += tokens
            self.jobs += 1.0

    def rate(self, now: float, prior: float) -> float:
        tokens, jobs, window = self._decay(now)
        weight = PRIOR_S * PRIOR_JOBS / (PRIOR_JOBS + jobs)
        return (tokens + prior * weight) / (window + weight)


class _Flow:
    """Exponentially weighted rate (tokens/s) of admitted work, over wall time."""

    __slots__ = ("value", "t", "t0")

    def __init__(self) -> None:
        self.value = 0.0
        self.t: Optional[float] = None
        self.t0: Optional[float] = None

    def add(self, now: float, tokens: float) -> None:
        if self.t is None:
            self.t = self.t0 = now
        elif now > self.t:
            self.value *= math.exp(-(now - self.t) / RATE_TAU_S)
            self.t = now
        self.value += tokens

    def rate(self, now: float) -> float:
        if self.t is None:
            return 0.0
        window = max(1.0, RATE_TAU_S * (1.0 - math.exp(-max(0.0, now - self.t0) / RATE_TAU_S)))
        return self.value * math.exp(-max(0.0, now - self.t) / RATE_TAU_S) / window


class _Model:
    __slots__ = ("name", "workers", "queues", "class_count", "wrr", "meter", "by_arrival", "last_seen",
                 "eligible", "queued", "tokens", "decode", "tenants", "wsum", "fronts", "fronts_cap",
                 "inflow", "size_count", "free", "capacity_groups")

    def __init__(self, name: str, n_classes: int) -> None:
        self.name = name
        self.workers: dict[str, _Worker] = {}
        self.queues: dict[tuple[int, int], _Queue] = {}
        self.class_count = [0] * n_classes
        # per class: tokens dispatched (short, long) while both waited
        self.wrr = [[0, 0] for _ in range(n_classes)]
        self.meter = _RateMeter(RATE_TAU_S)
        # per (class, size): queued entries by arrival, lazily pruned -- queue
        # deadlines and the oldest wait in O(1) whatever the number of tenants
        self.by_arrival: dict[tuple[int, int], deque[_Entry]] = {
            (r, s): deque() for r in range(n_classes) for s in (SHORT, LONG)}
        self.last_seen = [-math.inf] * n_classes  # last submit per class: which classes are active
        # per size: the workers a job of that size may ever use (submit's checks);
        # None after a worker came or went
        self.eligible: Optional[dict[int, list[_Worker]]] = None
        # What admission predicts from, kept up to date in O(1) per event (Policy._account):
        self.queued = 0  # queued entries, all classes
        self.tokens = [0] * n_classes  # per class: queued prompt+max_tokens
        self.decode = [0] * n_classes  # per class: queued max_tokens (engine steps)
        # per class: tenant -> [queued tokens, queued entries, weight]; wsum: their weights' sum
        self.tenants: list[dict[str, list]] = [{} for _ in range(n_classes)]
        self.wsum = [0.0] * n_classes
        # (class, tenant) -> when the work of everyone refused so far (and told
        # when to come back) will have drained: Retry-After spreads retries
        self.fronts: dict[tuple[int, str], float] = {}
        self.fronts_cap = 1024
        self.inflow = [_Flow() for _ in range(n_classes)]  # per class: admitted tokens/s
        self.size_count = [[0, 0] for _ in range(n_classes)]  # per class and size: queued entries
        # per pool: healthy workers with a free sequence slot, in no order
        # (swap-remove: O(1) updates), for placement in large fleets
        self.free: dict[int, list[_Worker]] = {_POOL_ANY: [], _POOL_SHORT: [], _POOL_LONG: []}
        # the capacity model's inputs, workers grouped by what they registered
        # with: [step_s, request_s, max_num_seqs, budget, count] (None after a change)
        self.capacity_groups: Optional[list[list]] = None

    def touch(self, w: _Worker) -> None:
        """``w``'s running count, health or other routers' share changed: keep
        the free sets right."""
        free = w.healthy and len(w.running) + w.other_seqs < w.slots
        i = w.free_at
        if free == (i >= 0):
            return
        lst = self.free[int(w.spec.pool)]
        if free:
            w.free_at = len(lst)
            lst.append(w)
        else:
            last = lst.pop()
            if last is not w:
                lst[i] = last
                last.free_at = i
            w.free_at = -1

    def has_free(self) -> bool:
        f = self.free
        return bool(f[_POOL_ANY] or f[_POOL_SHORT] or f[_POOL_LONG])

    def dequeued(self, rank: int) -> None:
        """One entry of class ``rank`` left the queued state (``class_count``
        already lowered).  When none is left, the arrival indexes of that
        class hold only dead entries: drop them now, so that the hot paths
        may skip empty classes without leaving their indexes to grow."""
        if self.class_count[rank] == 0:
            self.by_arrival[(rank, SHORT)].clear()
            self.by_arrival[(rank, LONG)].clear()

    def long_queued(self) -> int:
        return sum(q.count for (_, size), q in self.queues.items() if size == LONG)

    def oldest(self, rank: int, size: int) -> Optional[_Entry]:
        """The longest-waiting queued entry of (class, size)."""
        index = self.by_arrival[(rank, size)]
        while index and index[0].state != _QUEUED:
            index.popleft()  # dispatched or ended since
        return index[0] if index else None


def _insert_by_arrival(index: deque, e: _Entry) -> None:
    if not index or index[-1].job.arrival <= e.job.arrival:
        index.append(e)
        return
    i = len(index)  # a requeued job (its worker was lost): back to its place
    while i > 0 and index[i - 1].job.arrival > e.job.arrival:
        i -= 1
    index.insert(i, e)


def _wait_bound(c: ClassConfig) -> float:
    b = c.max_predicted_wait_s if c.max_predicted_wait_s is not None else c.queue_deadline_s
    return b if b > 0 else math.inf


def _remeasure(m: _Model, now: float) -> None:
    """The fleet changed: what was measured no longer says what it drains;
    predict from the capacity model again until the new fleet is measured."""
    m.meter = _RateMeter(RATE_TAU_S)
    m.meter.set_busy(now, m.queued > 0)


def _pct(sorted_vals: list[float], q: float) -> Optional[float]:
    if not sorted_vals:
        return None
    return round(sorted_vals[min(len(sorted_vals) - 1, int(q / 100.0 * len(sorted_vals)))], 4)


# ----------------------------------------------------------------- the policy


class Policy:
    def __init__(self, cfg: SchedulerConfig) -> None:
        if not cfg.classes:
            raise ValueError("scheduler needs at least one class")
        self.cfg = cfg
        self.fifo = cfg.policy == "fifo"
        self.classes = list(cfg.classes)
        self.rank = {c.name: i for i, c in enumerate(self.classes)}
        self.n_classes = len(self.classes)
        self.promote_after = cfg.aging_bound_s / 2.0
        self.headroom = 0.0 if self.fifo else max(0.0, min(0.9, cfg.priority_headroom))
        # per class: the predicted queue wait beyond which a job is refused at once
        self.wait_bound = [_wait_bound(c) for c in self.classes]
        # per class: (predicted, actual) queue wait of the last dispatches, for /admin/queues
        self.wait_samples: list[deque] = [deque(maxlen=2048) for _ in self.classes]
        self.models: dict[str, _Model] = {}
        self.workers: dict[str, _Worker] = {}
        self.entries: dict[str, _Entry] = {}
        self.tenant_count: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # generation deadlines (lazy heap)
        self.prefix = PrefixIndex(cfg.prefix_index_max_blocks, cfg.prefix_speculative_ttl_s)
        self.affinity = cfg.prefix_affinity
        self.round_robin = cfg.placement == "round_robin"
        self._rr = 0  # round-robin placement: the index after the worker used last
        self._seq = 0
        self._rng = random.Random(0)  # placement samples in large fleets: seeded, runs repeat
        self.place_scan_all = PLACE_SCAN_ALL  # (the DES sets it higher to compare with scoring all)
        self.counters: dict[str, int] = {
            "submitted": 0, "requeued": 0, "dispatched": 0, "finished": 0, "released": 0,
            "rejected_no_worker": 0, "rejected_context_length": 0, "rejected_queue_full": 0,
            "rejected_tenant_queue_full": 0, "rejected_predicted_wait": 0,
            "rejected_tenant_share": 0, "expired_queue_deadline": 0,
            "aborted_generation_deadline": 0, "lost_with_worker": 0, "backfilled": 0,
            "aged_dispatches": 0, "refused_by_worker": 0,
        }

    # ------------------------------------------------------------ workers

    def _model(self, name: str) -> _Model:
        m = self.models.get(name)
        if m is None:
            m = self.models[name] = _Model(name, self.n_classes)
        return m

    def add_worker(self, spec: WorkerSpec, now: float) -> list[str]:
        """Register or re-register.  A re-registered worker runs nothing: the
        ids of jobs that ran there are released and returned (router fails them)."""
        lost = self.remove_worker(spec.worker_id, now) if spec.worker_id in self.workers else []
        w = _Worker(spec, self.cfg)
        self.workers[spec.worker_id] = w
        m = self._model(spec.model)
        m.workers[spec.worker_id] = w
        m.workers = dict(sorted(m.workers.items()))  # by id: ties in placement go to the lowest
        m.eligible = None
        m.capacity_groups = None
        m.touch(w)
        _remeasure(m, now)
        if spec.prefix_hash:
            self.prefix.add_worker(spec.worker_id, spec.model, spec.prefix_hash, spec.block_size,
                                   spec.prefix_hash_seed)
        return lost

    def update_worker(self, worker_id: str, now: float, *, healthy: bool = True,
                      gpu_used_bytes: Optional[int] = None, gpu: Optional[GpuInfo] = None,
                      other_tokens: Optional[int] = None, other_seqs: Optional[int] = None) -> None:
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
        self.models[w.spec.model].touch(w)

    def is_healthy(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.healthy

    def cost_of(self, job_id: str) -> int:
        """KV tokens reserved for a running job on its worker (0: not running)."""
        e = self.entries.get(job_id)
        return e.cost if e is not None and e.state == _RUNNING else 0

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        self.prefix.remove_worker(worker_id)
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        m = self.models.get(w.spec.model)
        if m is not None:
            m.workers.pop(worker_id, None)
            m.eligible = None
            m.capacity_groups = None
            w.healthy = False
            m.touch(w)  # out of the free sets
            _remeasure(m, now)
        lost = list(w.running)
        for job_id in lost:
            e = self.entries.pop(job_id, None)
            if e is not None:
                e.state = _DONE
        w.running.clear()
        w.reserved = 0
        self.counters["lost_with_worker"] += len(lost)
        self.counters["released"] += len(lost)
        return lost

    # ------------------------------------------------------------ admission

    def _size(self, job: Job) -> int:
        if job.task_type == TaskType.SHORT:
            return SHORT
        if job.task_type == TaskType.LONG:
            return LONG
        total = max(1, job.prompt_tokens) + max(0, job.max_tokens)
        return SHORT if total <= self.cfg.short_threshold_tokens else LONG

    def _pool_ok(self, w: _Worker, size: int, m: Optional[_Model]) -> bool:
        """May a job of this size run on this worker?  ``m`` None: ever (at
        submit), else now (the borrow condition is checked)."""
        pool = w.spec.pool
        if pool == Pool.ANY:
            return True
        if size == LONG:
            return pool == Pool.LONG
        if pool == Pool.SHORT or self.fifo:
            return True
        # a short job on a long worker: only if configured, and while no long work waits
        return self.cfg.borrow_idle_long and (m is None or m.long_queued() == 0)

    def submit(self, job: Job, now: float, *, requeue: bool = False) -> Optional[Refusal]:
        """Queue a job, or say now why not (a code and its facts).

        ``requeue``: a job admitted before whose worker went (it may have
        streamed output: a continuation).  It is queued even while no worker
        of its model is left -- it waits, up to its queue deadline, for one
        to come back -- and is not measured against the predicted-wait bound
        again; it keeps its place by ``job.arrival``."""
        if job.job_id in self.entries:  # a router bug; keep the ledger exact anyway
            self.finish(job.job_id, now)
        self.counters["requeued" if requeue else "submitted"] += 1
        rank = self.rank.get(job.klass, self.n_classes - 1)  # unknown class: the lowest
        size = self._size(job)
        m = self.models.get(job.model) or self._model(job.model)
        if not m.workers and not requeue:
            self.counters["rejected_no_worker"] += 1
            return Refusal(Code.NO_WORKER, NO_WORKER_RETRY_S, {"model": job.model})
        if m.eligible is None:
            m.eligible = {sz: [w for w in m.workers.values() if self._pool_ok(w, sz, None)]
                          for sz in (SHORT, LONG)}
        eligible = m.eligible[size]
        if not eligible and not requeue:
            self.counters["rejected_no_worker"] += 1
            return Refusal(Code.NO_WORKER, NO_WORKER_RETRY_S, {"model": job.model, "pool": SIZE_NAMES[size]})
        prompt = max(1, job.prompt_tokens)
        total = prompt + max(0, job.max_tokens)
        for w in eligible:  # can any worker ever hold it? (usually the first one says yes)
            spec = w.spec
            if total <= spec.max_model_len and kv_cost(prompt, job.max_tokens, spec.block_size, job.n,
                                                       spec.shares_prompt) <= w.budget:
                break
        else:
            if eligible:  # (a requeued job may wait for a worker that can)
                self.counters["rejected_context_length"] += 1
                max_len = max(w.spec.max_model_len for w in eligible)
                facts = {"prompt": prompt, "completion": job.max_tokens, "max_len": max_len, "n": job.n}
                if total <= max_len:  # fits the context, not any worker's KV budget
                    facts["kv_tokens"] = max(w.budget for w in eligible)
                return Refusal(Code.CONTEXT_LENGTH, None, facts,
                               "n" if job.n > 1 and total <= max_len else "messages")
        # Hard count bounds: memory protection only (a queued request costs
        # the router ~1 KB, bench/README.md), far above what the wait bound admits.
        if m.class_count[rank] >= self.classes[rank].max_queue:
            self.counters["rejected_queue_full"] += 1
            return Refusal(Code.QUEUE_FULL, self._retry_after(m, rank, total, now),
                           {"klass": self.classes[rank].name})
        if self.tenant_count.get(job.tenant, 0) >= self.cfg.max_queue_per_tenant:
            self.counters["rejected_tenant_queue_full"] += 1
            return Refusal(Code.TENANT_QUEUE_FULL, self._retry_after(m, rank, total, now),
                           {"tenant": job.tenant})
        self._seq += 1
        e = _Entry(job, rank, size, self._seq)
        bound = self.wait_bound[rank]
        if bound < math.inf and not requeue:
            if m.queued == 0:
                # Nothing queued: nothing is ahead of it, its predicted wait is 0
                # -- the common case below saturation, and the prediction costs
                # ~15 us (measured in-process: 25 -> 41 us per request without this).
                e.predicted = 0.0
            else:
                refusal = self._admit_by_wait(m, e, bound, now)
                if refusal is not None:
                    return refusal
        key = (0, 0) if self.fifo else (rank, size)
        q = m.queues.get(key)
        if q is None:
            q = m.queues[key] = _Queue(rank, size, self.cfg.short_threshold_tokens,
                                       by_tenant=not self.fifo)
        q.push(e)
        _insert_by_arrival(m.by_arrival[(rank, size)], e)
        m.last_seen[rank] = max(m.last_seen[rank], now)
        self.entries[job.job_id] = e
        m.class_count[rank] += 1
        self._account(m, e, 1, now)
        m.inflow[rank].add(now, e.tokens)
        self.tenant_count[job.tenant] = self.tenant_count.get(job.tenant, 0) + 1
        return None

    # Predicted wait.  The work a new job waits for, in reserved tokens: all
    # that is queued in higher classes, plus -- in its own class, where
    # tenants share by weighted DRR -- its tenant's own queued tokens and, of
    # every other tenant's, at most what DRR serves them meanwhile:
    #     own + min(others, (own + job) x W_others / w)
    # (W_others: the summed weights of the other tenants queued in the class).
    # So a tenant whose own work is within its weighted share of the bound,
    # (own + job) <= w / (w + W_others) x bound x rate, always fits (unless
    # higher classes fill the bound), a flooder is refused once the whole
    # class is full, and a tenant alone may fill all of it.  Over the drain
    # rate (_drain_rate) that is seconds.  O(classes): no scan of the queue.

    def _ahead(self, m: _Model, e: _Entry) -> tuple[float, float, float]:
        """(tokens ahead of ``e``, its tenant's queued tokens + its own, the
        other tenants' summed weight in its class)."""
        rank = e.rank
        if self.fifo:
            return float(sum(m.tokens)), float(e.tokens), 0.0
        row = m.tenants[rank].get(e.job.tenant)
        own = row[0] if row is not None else 0
        w_others = max(0.0, m.wsum[rank] - (row[2] if row is not None else 0.0))
        others = m.tokens[rank] - own
        w = max(1e-3, e.job.weight)
        ahead = sum(m.tokens[:rank]) + own + min(others, (own + e.tokens) * w_others / w)
        return float(ahead), float(own + e.tokens), w_others

    def _admit_by_wait(self, m: _Model, e: _Entry, bound: float, now: float) -> Optional[Refusal]:
        job = e.job
        ahead, mine, w_others = self._ahead(m, e)
        rate = self._drain_rate(m, e.rank, e.tokens, max(0, job.max_tokens), now)
        if rate <= 0.0:
            return None  # nothing to predict from (no capacity known): the deadline still bounds
        if not self.fifo and e.rank > 0:
            # Higher classes that keep arriving go ahead of this job while it
            # waits: it drains at what they leave, W = ahead / (rate - inflow).
            # (At least 5 % of the rate: aging keeps every class moving.)
            inflow = sum(f.rate(now) for f in m.inflow[:e.rank])
            rate = max(0.05 * rate, rate - inflow)
        wait = ahead / rate
        if wait <= bound:
            e.predicted = wait
            return None
        # Refused.  Retry-After: when this job's place in line -- behind what
        # is queued and behind everyone of its tenant and class refused before
        # it, each booked at its tenant's share of the drain rate -- will be
        # half the bound away.  A burst refused at once is thus told to come
        # back spread out over the time the fleet needs for it, not all at the
        # same moment (where most would be refused again).
        w = max(1e-3, job.weight)
        share = w / (w + w_others)
        key = (e.rank, job.tenant)
        front = max(m.fronts.get(key, -math.inf), now + wait) + e.tokens / (rate * share)
        front = min(front, now + bound + MAX_RETRY_S)
        if len(m.fronts) >= m.fronts_cap:  # drop fronts in the past: bounded by recent refusals
            m.fronts = {k: f for k, f in m.fronts.items() if f > now}
            m.fronts_cap = max(1024, 2 * len(m.fronts))
        m.fronts[key] = front
        retry = round(min(MAX_RETRY_S, max(MIN_RETRY_S, front - now - bound / 2)), 1)
        name = self.classes[e.rank].name
        fits = bound * rate  # tokens the bound admits
        others = m.tokens[e.rank] - (mine - e.tokens)
        if w_others > 0 and mine > share * fits and others < (1.0 - share) * fits:
            # over its share while the others are not: this tenant, not the class, is full
            self.counters["rejected_tenant_share"] += 1
            return Refusal(Code.TENANT_SHARE_EXCEEDED, retry,
                           {"tenant": job.tenant, "klass": name, "wait": wait, "bound": bound})
        self.counters["rejected_predicted_wait"] += 1
        return Refusal(Code.QUEUE_WAIT_EXCEEDED, retry, {"klass": name, "wait": wait, "bound": bound})

    def _drain_rate(self, m: _Model, rank: int, tokens: int, decode: int, now: float) -> float:
        """Reserved tokens/s released by the model's workers: measured while
        work was queued, blended with the capacity model of the work queued
        in class ``rank`` and above plus a job of ``tokens`` (``decode`` of
        them max_tokens)."""
        k = self.n_classes if self.fifo else rank + 1
        n = sum(m.class_count[:k]) + (1 if tokens else 0)
        prior = 0.0
        if n:
            prior = self._capacity_rate(m, tokens + sum(m.tokens[:k]), decode + sum(m.decode[:k]), n)
        return m.meter.rate(now, prior)

    @staticmethod
    def _capacity_rate(m: _Model, tokens: int, decode: int, n: int) -> float:
        """Tokens/s the workers release on ``n`` jobs of these totals, from what
        they registered with: each runs min(max_num_seqs, as many of the mean
        job as its KV budget holds) at once; a job holds its place for a step
        per output token plus one, plus its prompt's prefill; and each job
        costs the engine its per-request work, serially."""
        groups = m.capacity_groups
        if groups is None:  # O(workers) once per fleet change, then O(kinds of worker) per call
            by_kind: dict[tuple, list] = {}
            for w in m.workers.values():
                spec = w.spec
                key = (spec.step_s(), spec.request_s(), spec.max_num_seqs, w.budget)
                g = by_kind.get(key)
                if g is None:
                    by_kind[key] = [*key, 1]
                else:
                    g[4] += 1
            groups = m.capacity_groups = list(by_kind.values())
        rate = 0.0
        prefill = (tokens - decode) * DEFAULT_PREFILL_TOKEN_S
        for step_s, request_s, max_num_seqs, budget, count in groups:
            at_once = max(1.0, min(max_num_seqs, budget * n / tokens))
            rate += count * tokens / (((decode + n) * step_s + prefill) / at_once + n * request_s)
        return rate

    def _account(self, m: _Model, e: _Entry, sign: int, now: Optional[float]) -> None:
        """``e`` entered (+1) or left (-1) the queued state: the admission
        totals, and whether the model is backlogged (None: a re-pricing)."""
        r = e.rank
        m.queued += sign
        m.size_count[r][e.size] += sign
        if now is not None:
            m.meter.set_busy(now, m.queued > 0)
        m.tokens[r] += sign * e.tokens
        m.decode[r] += sign * max(0, e.job.max_tokens)
        tab = m.tenants[r]
        t = e.job.tenant
        row = tab.get(t)
        if sign > 0:
            w = max(1e-3, e.job.weight)
            if row is None:
                row = tab[t] = [0, 0, w]
                m.wsum[r] += w
            elif row[2] != w:
                m.wsum[r] += w - row[2]
                row[2] = w
            row[0] += e.tokens
            row[1] += 1
        elif row is not None:
            row[0] -= e.tokens
            row[1] -= 1
            if row[1] <= 0:
                del tab[t]
                m.wsum[r] = m.wsum[r] - row[2] if tab else 0.0

    def _retry_after(self, m: _Model, rank: int, own_tokens: int, now: float) -> float:
        """Seconds until the work queued ahead of a job of class ``rank`` (its
        class and higher ones) plus its own should have drained."""
        k = self.n_classes if self.fifo else rank + 1
        ahead = own_tokens + sum(m.tokens[:k])
        rate = self._drain_rate(m, rank, own_tokens, 0, now)
        if rate <= 0.0:
            return NO_WORKER_RETRY_S
        return round(min(MAX_RETRY_S, max(MIN_RETRY_S, ahead / rate)), 1)

    # ------------------------------------------------------------ scheduling

    def _limit(self, m: _Model, rank: int, now: float) -> float:
        """Fraction of a worker's KV budget and seq slots class ``rank`` may fill.
        Only classes above it that submitted recently (within the aging bound)
        get room kept for them, so a single-class deployment wastes nothing."""
        if rank == 0 or self.headroom <= 0.0 or self.n_classes <= 1:
            return 1.0
        horizon = now - self.cfg.aging_bound_s
        last_seen = m.last_seen
        top = rank
        for r in range(rank):
            if last_seen[r] >= horizon:
                top = r
                break
        return 1.0 - self.headroom * (rank - top) / (self.n_classes - 1)

    def _gpu_ok(self, w: _Worker) -> bool:
        if w.gpu_block is not None:
            return False
        floor = self.cfg.gpu_free_floor_bytes
        if floor <= 0 or w.spec.gpu_total_bytes <= 0 or w.gpu_used is None:
            return True
        return w.spec.gpu_total_bytes - w.gpu_used >= floor

    def _place(self, m: _Model, e: _Entry, exclude: set[str], due: bool,
               now: float, again: bool = False) -> Optional[tuple[_Worker, int]]:
        """Best worker that can take ``e`` now and its KV cost there, or None.

        Runs once per dispatch and per worker, so the checks of ``_gpu_ok``
        and ``_pool_ok`` are inlined and KV costs computed once per block size."""
        job = e.job
        prompt = max(1, job.prompt_tokens)
        max_tokens = job.max_tokens
        total = prompt + max(0, max_tokens)
        limit = 1.0 if due else self._limit(m, e.rank, now)
        size = e.size
        own_pool = _POOL_SHORT if size == SHORT else _POOL_LONG
        floor = self.cfg.gpu_free_floor_bytes
        may_borrow = self.cfg.borrow_idle_long
        long_idle = None  # m.long_queued() == 0, looked up only if a borrow is considered
        cost_bs = cost = -1
        seqs = job.n
        cost_shared = False
        cap_of = cap = -1  # the class's seq cap on a worker of cap_of slots, computed once per size
        kv_short = False  # a candidate lacked KV (not a slot): another draw may find one that has it
        best = None
        best_pref = -1
        best_score = 0.0
        score_of = self._score
        candidates, complete = self._candidates(m, size, again)
        hits = self.prefix.match(job.model, job.block_hashes, now) if job.block_hashes and self.affinity else None
        cands = [] if hits else None  # (pref, score, worker, cost): affinity chooses among them
        if hits and not complete:  # a sample: the workers holding the prefix are scored too
            workers = m.workers
            candidates = [*candidates, *(workers[wid] for wid in hits if wid in workers)]
        order = list(m.workers) if self.round_robin else None
        for w in candidates:
            if not w.healthy or w.gpu_block is not None or (exclude and w.spec.worker_id in exclude):
                continue
            spec = w.spec
            gpu_total = spec.gpu_total_bytes
            if floor > 0 and gpu_total > 0 and w.gpu_used is not None and gpu_total - w.gpu_used < floor:
                continue  # _gpu_ok
            pool = spec.pool
            if pool != _POOL_ANY:  # _pool_ok
                if size == LONG:
                    if pool != _POOL_LONG:
                        continue
                elif pool != _POOL_SHORT and not self.fifo:
                    if not may_borrow:
                        continue
                    if long_idle is None:
                        long_idle = m.long_queued() == 0
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
                    cap_of, cap = max_seqs, max(1, int(max_seqs * limit))
                if n >= cap:
                    continue  # class headroom: the rest is kept for higher classes
                if after > budget * limit:
                    kv_short = True
                    continue
            pref = 2 if pool == own_pool else (1 if pool == _POOL_ANY else 0)
            if pref < best_pref:
                continue
            score = score_of(w, e, after, n)
            if order is not None:  # round robin (a benchmark baseline): the nearest after the last one used
                score = -float((order.index(w.spec.worker_id) - self._rr) % len(order))
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
            return self._place(m, e, exclude, due, now, again=True)
        if cands and best is not None:
            return self._affine(cands, best_pref, best_score, hits, prompt)
        return best

    def _affine(self, cands: list, best_pref: int, best_score: float, hits: dict[str, int],
                prompt: int) -> tuple[_Worker, int]:
        """Prefix affinity, bounded by load: among the candidates of the best
        pool preference within ``prefix_load_margin`` of the least loaded,
        the highest load score + weight x cached fraction of the prompt."""
        floor = best_score - self.cfg.prefix_load_margin
        weight = self.cfg.prefix_affinity_weight
        best = None
        best_total = 0.0
        for pref, score, w, cost in cands:  # (in worker id order: ties keep the lowest)
            if pref != best_pref or score < floor:
                continue
            cached = hits.get(w.spec.worker_id, 0) * w.spec.block_size
            total = score + weight * min(1.0, cached / prompt)
            if best is None or total > best_total:
                best, best_total = (w, cost), total
        return best

    def _score(self, w: _Worker, e: _Entry, after: int, n: int) -> float:
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

    def _candidates(self, m: _Model, size: int, again: bool):
        """The workers ``_place`` scores, and whether they are all it could:
        every worker of a small fleet (in id order), else PLACE_SAMPLE from
        the free sets of the pools a job of this size may use, in order of
        preference (a short job: short, any, long) -- a pool's whole set while
        it is smaller than what is left to draw -- or, the second time
        (``again``), drawn across all of them alike."""
        if len(m.workers) <= self.place_scan_all:
            return m.workers.values(), True
        free = m.free
        if size == LONG:
            pools = (free[_POOL_LONG], free[_POOL_ANY])
        elif self.fifo or self.cfg.borrow_idle_long:
            pools = (free[_POOL_SHORT], free[_POOL_ANY], free[_POOL_LONG])
        else:
            pools = (free[_POOL_SHORT], free[_POOL_ANY])
        total = 0
        for p in pools:
            total += len(p)
        if total <= PLACE_SAMPLE:
            return [w for p in pools for w in p], True
        draw = self._rng.random  # (int(draw() * n): a third of randrange's cost)
        out: list[_Worker] = []
        if not again:
            for p in pools:
                left = PLACE_SAMPLE - len(out)
                n = len(p)
                if n <= left:
                    out.extend(p)
                else:
                    out.extend([p[int(draw() * n)] for _ in range(left)])
                    break
            return out, False
        for _ in range(PLACE_SAMPLE):
            i = int(draw() * total)
            for p in pools:
                if i < len(p):
                    out.append(p[i])
                    break
                i -= len(p)
        return out, False

    def _reserve_target(self, m: _Model, e: _Entry, exclude: set[str]) -> Optional[str]:
        """The worker a due head is waiting for: the eligible one closest to fitting it."""
        job = e.job
        prompt = max(1, job.prompt_tokens)
        total = prompt + max(0, job.max_tokens)
        best = None
        best_key = None
        for wid, w in m.workers.items():
            if wid in exclude or not w.healthy or w.gpu_block is not None or not self._pool_ok(w, e.size, m):
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

    def _pick(self, m: _Model, now: float, skipped: set) -> Optional[tuple[_Queue, bool]]:
        """The queue to serve next and whether it is due (aged)."""
        fifo = self.fifo
        promote_after = self.promote_after
        due_best = None
        due_start = 0.0
        best_rank = -1
        first = second = None  # the (at most two) queues of the best class, in queue order
        for key, q in m.queues.items():
            if q.count == 0 or key in skipped:
                continue
            if not fifo and now - q.last_dispatch >= promote_after:
                oldest = m.oldest(q.rank, q.size)  # only looked up when the queue may be due
                if oldest is None:
                    continue
                start = max(q.last_dispatch, oldest.job.arrival)
                if now - start >= promote_after and (due_best is None or start < due_start):
                    due_best, due_start = q, start
            r = q.rank
            if first is None or r < best_rank:
                best_rank, first, second = r, q, None
            elif r == best_rank:
                second = q
        if due_best is not None:
            return due_best, True
        if first is None:
            return None
        if second is None:
            q = first
            if not fifo:
                other = m.queues.get((q.rank, 1 - q.size))
                if other is None or other.count == 0:
                    shares = m.wrr[q.rank]  # nothing to share with: no credit is banked
                    shares[0] = shares[1] = 0
            return q, False
        s, l = m.wrr[first.rank]
        short_q = first if first.size == SHORT else second
        long_q = second if short_q is first else first
        # serve short while its dispatches/share are not ahead of long's
        if s * self.cfg.long_share <= l * self.cfg.short_share:
            return short_q, False
        return long_q, False

    def has_queued(self) -> bool:
        """Is any job waiting?  If not, ``schedule`` can only expire running
        jobs, which ``next_wakeup`` already times: callers may skip it."""
        for m in self.models.values():
            if any(m.class_count):
                return True
        return False

    def schedule(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self._deadlines:
            self._expire_running(now, actions)
        for m in self.models.values():
            if not any(m.class_count):
                continue  # nothing queued: nothing to expire or dispatch
            self._expire_queued(m, now, actions)
            # cheap exit for the common busy case: every worker full (or unusable)
            if any(m.class_count) and m.has_free():
                self._dispatch_model(m, now, actions)
        return actions

    def _dispatch_model(self, m: _Model, now: float, actions: list[Action]) -> None:
        skipped: set = set()
        reserved: set[str] = set()
        blocked_before = False
        while True:
            picked = self._pick(m, now, skipped)
            if picked is None:
                return
            q, due = picked
            e = q.peek()
            if e is None:  # only dead entries were left
                skipped.add((q.rank, q.size) if not self.fifo else (0, 0))
                continue
            placed = self._place(m, e, reserved, due, now)
            if placed is not None:
                w, cost = placed
                both = False
                if not self.fifo:
                    other = m.queues.get((q.rank, 1 - q.size))
                    both = (other is not None and other.count > 0
                            and (q.rank, 1 - q.size) not in skipped)
                self._dispatch(m, q, e, w, cost, now, actions)
                if both:
                    m.wrr[q.rank][q.size] += e.tokens
                if due:
                    self.counters["aged_dispatches"] += 1
                if blocked_before:
                    self.counters["backfilled"] += 1
                continue
            if self.fifo or not self.cfg.backfill:
                return  # strict order: the head blocks everything behind it
            skipped.add((q.rank, q.size))
            blocked_before = True
            if due:
                target = self._reserve_target(m, e, reserved)
                if target is not None:
                    reserved.add(target)

    def _dispatch(self, m: _Model, q: _Queue, e: _Entry, w: _Worker, cost: int, now: float,
                  actions: list[Action]) -> None:
        q.pop(e)
        q.last_dispatch = now
        job = e.job
        m.class_count[e.rank] -= 1
        m.dequeued(e.rank)
        self._account(m, e, -1, now)
        self._tenant_dec(job.tenant)
        e.state = _RUNNING
        if e.predicted >= 0.0:
            self.wait_samples[e.rank].append((e.predicted, now - job.arrival))
        e.worker = w.spec.worker_id
        e.cost = cost
        e.dispatched_at = now
        w.running[job.job_id] = cost
        w.reserved += cost
        if len(w.running) + w.other_seqs >= w.slots:
            m.touch(w)
        if job.block_hashes and self.affinity:
            self.prefix.speculate(e.worker, job.block_hashes, now)
        if self.round_robin:
            self._rr = list(m.workers).index(e.worker) + 1
        if self.cfg.generation_deadline_s > 0:
            h = self._deadlines
            if len(h) > 1024 and len(h) > 4 * len(self.entries):
                # most entries belong to jobs that already ended: drop them in one pass
                h[:] = [x for x in h if (y := self.entries.get(x[2])) is not None and y.seq == x[1]]
                heapq.heapify(h)
            heapq.heappush(h, (now + self.cfg.generation_deadline_s, e.seq, job.job_id))
        self.counters["dispatched"] += 1
        actions.append(DispatchJob(job.job_id, w.spec.worker_id, 0 if self.fifo else e.rank))

    def _tenant_dec(self, tenant: str) -> None:
        n = self.tenant_count.get(tenant, 0) - 1
        if n > 0:
            self.tenant_count[tenant] = n
        else:
            self.tenant_count.pop(tenant, None)

    def _expire_queued(self, m: _Model, now: float, actions: list[Action]) -> None:
        for rank, n in enumerate(m.class_count):
            if n == 0:
                continue  # nothing of this class queued (and its indexes are empty)
            d = self.classes[rank].queue_deadline_s
            if d <= 0:
                continue
            for size in (SHORT, LONG):
                index = m.by_arrival[(rank, size)]
                while (e := m.oldest(rank, size)) is not None and now - e.job.arrival >= d:
                    index.popleft()
                    self._reject_expired(m, e, now, actions)

    def _reject_expired(self, m: _Model, e: _Entry, now: float, actions: list[Action]) -> None:
        job = e.job
        e.state = _DONE
        if e.queue is not None:
            e.queue.forget(e)
        self.entries.pop(job.job_id, None)
        m.class_count[e.rank] -= 1
        m.dequeued(e.rank)
        self._account(m, e, -1, now)
        self._tenant_dec(job.tenant)
        self.counters["expired_queue_deadline"] += 1
        retry = self._retry_after(m, e.rank, 0, now)
        actions.append(RejectJob(job.job_id, Refusal(Code.QUEUE_DEADLINE, retry, {
            "waited": now - job.arrival, "klass": self.classes[e.rank].name,
            "deadline": self.classes[e.rank].queue_deadline_s})))

    def _expire_running(self, now: float, actions: list[Action]) -> None:
        h = self._deadlines
        while h and h[0][0] <= now:
            _, seq, job_id = heapq.heappop(h)
            e = self.entries.get(job_id)
            if e is None or e.state != _RUNNING or e.seq != seq:
                continue
            wid = e.worker
            self._release(e, now, count_rate=False)
            self.counters["aborted_generation_deadline"] += 1
            actions.append(AbortJob(job_id, wid or "", Refusal(
                Code.GENERATION_DEADLINE, None, {"deadline": self.cfg.generation_deadline_s})))

    # ------------------------------------------------------------ completion

    def _release(self, e: _Entry, now: float, count_rate: bool) -> None:
        self.entries.pop(e.job.job_id, None)
        e.state = _DONE
        w = self.workers.get(e.worker) if e.worker else None
        if w is not None and w.running.pop(e.job.job_id, None) is not None:
            w.reserved -= e.cost
            m = self._model(w.spec.model)
            if w.free_at < 0:
                m.touch(w)
            if count_rate:
                m.meter.add(now, e.tokens)
        self.counters["released"] += 1

    def finish(self, job_id: str, now: float) -> bool:
        """A job ended (done, aborted, errored, cancelled; queued or running).
        Releases exactly once; True iff this call released or removed something."""
        e = self.entries.get(job_id)
        if e is None:
            return False
        if e.state == _QUEUED:
            self.entries.pop(job_id, None)
            e.state = _DONE
            if e.queue is not None:
                e.queue.forget(e)
            m = self.models.get(e.job.model)
            if m is not None:
                m.class_count[e.rank] -= 1
                m.dequeued(e.rank)
                self._account(m, e, -1, now)
            self._tenant_dec(e.job.tenant)
            return True
        self._release(e, now, count_rate=True)
        self.counters["finished"] += 1
        return True

    def refused(self, job_id: str, now: float) -> bool:
        """Its worker refused the dispatch (its own ledger: other routers hold
        the room): release without counting a completion (no drain-rate
        sample); the caller queues it again (``submit(requeue=True)``)."""
        e = self.entries.get(job_id)
        if e is None or e.state != _RUNNING:
            return False
        self._release(e, now, count_rate=False)
        self.counters["refused_by_worker"] += 1
        return True

    def correct_prompt_tokens(self, job_id: str, actual: int) -> None:
        """The engine's exact prompt count: re-price the reservation.  Upward
        corrections are kept even past the budget (that is what the engine
        really holds); new work then waits until it drains."""
        e = self.entries.get(job_id)
        if e is None or actual < 1:
            return
        job = e.job
        queued = e.state == _QUEUED and e.queue is not None
        m = self.models.get(job.model)
        if queued:
            e.queue.tokens -= e.tokens
            if m is not None:
                self._account(m, e, -1, None)
        job.prompt_tokens = actual
        e.tokens = actual + max(0, job.max_tokens) * job.n
        if queued:
            e.queue.tokens += e.tokens
            if m is not None:
                self._account(m, e, 1, None)
        if e.state == _RUNNING:
            w = self.workers.get(e.worker) if e.worker else None
            if w is None or job_id not in w.running:
                return
            new = kv_cost(actual, job.max_tokens, w.spec.block_size, job.n, w.spec.shares_prompt)
            w.reserved += new - e.cost
            w.running[job_id] = new
            e.cost = new

    # ------------------------------------------------------------ lookups

    def worker_of(self, job_id: str) -> Optional[str]:
        """The worker a job runs on (None: queued, ended or unknown)."""
        e = self.entries.get(job_id)
        return e.worker if e is not None and e.state == _RUNNING else None

    def running_on(self, worker_id: str) -> list[str]:
        w = self.workers.get(worker_id)
        return list(w.running) if w is not None else []

    def pool_of(self, worker_id: str) -> str:
        w = self.workers.get(worker_id)
        return POOL_NAMES.get(w.spec.pool, "any") if w is not None else "-"

    # ------------------------------------------------------------ timing / views

    def next_wakeup(self, now: float) -> Optional[float]:
        t: Optional[float] = None
        h = self._deadlines
        while h:
            deadline, seq, job_id = h[0]
            e = self.entries.get(job_id)
            if e is None or e.state != _RUNNING or e.seq != seq:
                heapq.heappop(h)
                continue
            t = deadline
            break
        fifo = self.fifo
        promote_after = self.promote_after
        for m in self.models.values():
            for rank, n in enumerate(m.class_count):
                if n == 0:
                    continue  # nothing of this class queued: no deadline, nothing to age
                d = self.classes[rank].queue_deadline_s
                for size in (SHORT, LONG):
                    e = m.oldest(rank, size)
                    if e is None:
                        continue
                    arrival = e.job.arrival
                    if d > 0 and (t is None or arrival + d < t):
                        t = arrival + d
                    q = m.queues.get((rank, size))
                    if not fifo and q is not None:
                        due_at = max(q.last_dispatch, arrival) + promote_after
                        if due_at > now and (t is None or due_at < t):
                            t = due_at
        return t

    def queued_by_model(self) -> dict[tuple[str, str], int]:
        """Queued requests per (model, pool), all classes: what an autoscaler of
        a model's workers reads (router/ops_metrics.py)."""
        return {(m.name, SIZE_NAMES[size]): sum(c[size] for c in m.size_count)
                for m in self.models.values() for size in (SHORT, LONG)}

    def snapshot(self, now: float) -> dict:
        workers = [{
            "id": w.spec.worker_id, "model": w.spec.model, "pool": POOL_NAMES.get(w.spec.pool, "any"),
            "healthy": w.healthy and self._gpu_ok(w), "capacity_tokens": w.spec.capacity_tokens,
            "budget_tokens": w.budget, "reserved_tokens": w.reserved, "running": len(w.running),
            "max_num_seqs": w.spec.max_num_seqs, "gpu_block": w.gpu_block,
            "other_routers_tokens": w.other_tokens, "other_routers_seqs": w.other_seqs,
        } for w in sorted(self.workers.values(), key=lambda w: w.spec.worker_id)]
        # O(classes x models): /metrics reads this at every scrape, also with 100,000 queued
        queues = []
        for r in range(self.n_classes):
            samples = sorted(abs(a - p) for p, a in self.wait_samples[r])
            for size in (SHORT, LONG):
                n, oldest, by_model = 0, None, {}
                for name, m in self.models.items():
                    k = m.size_count[r][size]
                    if k:
                        n += k
                        by_model[name] = k
                    e = m.oldest(r, size)
                    if e is not None and (oldest is None or e.job.arrival < oldest):
                        oldest = e.job.arrival
                queues.append({
                    "class": self.classes[r].name, "pool": SIZE_NAMES[size], "queued": n,
                    "oldest_wait_s": 0.0 if oldest is None else max(0.0, now - oldest),
                    # |actual - predicted| queue wait of the class's last dispatches
                    "wait_error_p50_s": _pct(samples, 50), "wait_error_p90_s": _pct(samples, 90),
                    "wait_samples": len(samples), "by_model": by_model,
                })
        return {"workers": workers, "queues": queues, "counters": dict(self.counters),
                "policy": self.cfg.policy}
