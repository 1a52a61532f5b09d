"""The scheduling policy: who waits, who runs where, who is refused.

Pure: no I/O, no asyncio, no clock reads.  The router's event loop (or the
discrete-event simulation in ``simulation.des``) passes ``now`` in, feeds events
(submit / finish / worker changes) and carries out the returned actions.

What belongs here: decisions over the policy's own records -- admission,
queue order, the wait model, placement, KV reservations, the dispatch loop --
and nothing that does I/O, keeps time or knows a socket, an HTTP request or
a job's lifecycle (router.lifecycle drives the policy and owns the job's
``JobState``; an entry here has its own state, ``records.WAITING/PLACED/GONE``).
What it may import: ``shared`` (config, protocol, errors), the prefix index
of ``router.fleet`` (``router.fleet.prefix_index``) and itself; nothing of
the layers above (lifecycle, services, ingress, api), and nothing of
tenancy or observe: the views read the policy, not the other way.  Inside,
imports run one way (no circles, type-only ones included): ``types`` and
``records`` at the bottom, ``facade`` at the top.

Model of the world
------------------
* **Reservations.**  Each worker has a KV budget ``capacity x (1 - kv_safety_margin)
  x overcommit``.  A job reserves ``kv_cost(prompt, max_tokens, block)`` (its
  worst case, rounded to the worker's block size) at dispatch and releases it
  exactly once: on finish/abort/error/cancel (``finish``), generation deadline
  (``AbortJob``) or worker loss (``remove_worker``/re-register).  With
  overcommit 1.0 the engine can never run out of KV, so it never preempts.
  At most ``max_num_seqs`` jobs run per worker (plus ``dispatch_lookahead``,
  default 0), so all waiting -- and all its priorities -- happens here, not
  in an engine's FIFO.  A worker whose GPU
  free memory is under ``gpu_free_floor_bytes``, whose GPU is over a
  temperature or memory threshold (``router.policy.gpu_gate``) or that is unhealthy
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
  first, which keeps batches (and so step times) even (the load scorer,
  ``placement.scorers.least_loaded``).  Ties go to the lowest worker id,
  which keeps runs deterministic.
* **Placement cost.**  Up to ``PLACE_SCAN_ALL`` workers of a model every
  worker is scored, as above.  Beyond, the policy keeps, per model and pool,
  the set of workers with a free sequence slot, sorted by the sequences each
  holds (``FreeSlots``: O(1) upkeep at each dispatch and release, O(change)
  at a heartbeat), and scores ``PLACE_SAMPLE`` drawn at random from those of
  the sets the job may use that are below its class's seq cap (a prefix of
  each set; a second draw if none fits), so placement costs the same at
  1,024 workers as at 16 -- the power of k choices, as SMG's router does; a
  seeded generator keeps runs deterministic.  No worker below the cap: the
  head waits without a draw, and the pass stops (every queue left is of
  that class or a lower one).  A head that fits none drawn is skipped this pass
  (backfill), and once due the closest worker is reserved for it
  (``reserve_target``, a full scan, only then).  The workers whose cache
  holds the job's prefix (below) are scored beside those drawn.
* **Prefix affinity** (``placement.scorers.prefix_cached``, ``placement.picker``): where the prefix index
  (router/fleet/prefix_index.py) says a worker's cache holds the job's leading
  prompt blocks, the score gains ``prefix_affinity_weight x`` the cached
  fraction of the prompt -- only among the workers of the best pool
  preference whose load score is within ``prefix_load_margin`` of the best.
  It only chooses among workers that passed every filter above (KV budget,
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
  is over its weighted share (see ``WaitModel.ahead``); 429 when a count bound --
  memory protection only -- is hit (class queue per model, tenant's queued
  total); 503 when a job waited past its class ``queue_deadline_s``.
* **Predicted wait** = reserved tokens ahead (``WaitModel.ahead``) / drain rate
  (``WaitModel.drain_rate``): tokens released per second of backlog (exponentially
  weighted, 30 s of backlog), blended with a capacity model of the
  registered engines (``capacity_rate``) that alone decides on a cold
  fleet, less the inflow of higher classes.  Retry-After of a wait refusal:
  when the job's place in line, behind earlier refusals of its tenant and
  class, is half a bound away; of the others: the drain time of the queue
  ahead.
* ``policy="fifo"`` (``FifoOrder``): one FIFO per model with the same reservations, limits and pool
  rules (short work may use any worker), no priorities, no backfill (the head
  blocks), priority 0 to vLLM: the baseline the DES compares against.

Layout
------
``types`` (what goes in and out), ``records`` (the policy's own entry and
worker records, and the free sets), ``totals`` (what the wait model
predicts from), ``queues`` (the queues and the queue-order strategies:
``ClassOrder``, ``FifoOrder``), ``model`` (a model's records),
``wait_model`` (drain rate, capacity model, predicted wait, Retry-After),
``placement/`` (a pipeline: ``candidates`` -> ``filters`` -> ``scorers`` ->
``picker``, run by ``ScoredPlacement`` or ``RoundRobin``), ``reservations``
(the KV reservations: ``Reservations``), ``entries`` (the entry table and
the waiting transitions), ``admission``, ``dispatch`` (the dispatch loop and
expiry) and ``facade`` (``Policy``, which composes them).  The strategies
are chosen once, at construction, from ``SchedulerConfig.policy`` and
``.placement``.
"""

from __future__ import annotations

from router.policy.facade import Policy
from router.policy.types import (
    DEFAULT_PREFILL_TOKEN_S,
    DEFAULT_REQUEST_S,
    DEFAULT_STEP_FIXED_S,
    DEFAULT_STEP_PER_SEQ_S,
    LONG,
    MAX_RETRY_S,
    MIN_RETRY_S,
    NO_WORKER_RETRY_S,
    PLACE_SAMPLE,
    PLACE_SCAN_ALL,
    PRIOR_JOBS,
    PRIOR_S,
    RATE_TAU_S,
    SHORT,
    SIZE_NAMES,
    AbortJob,
    Action,
    DispatchJob,
    Job,
    RejectJob,
    WorkerSpec,
)

__all__ = [
    "WorkerSpec",
    "Job",
    "DispatchJob",
    "RejectJob",
    "AbortJob",
    "Action",
    "Policy",
    "SHORT",
    "LONG",
    "SIZE_NAMES",
    "NO_WORKER_RETRY_S",
    "RATE_TAU_S",
    "PRIOR_S",
    "PRIOR_JOBS",
    "DEFAULT_STEP_FIXED_S",
    "DEFAULT_STEP_PER_SEQ_S",
    "DEFAULT_PREFILL_TOKEN_S",
    "DEFAULT_REQUEST_S",
    "MIN_RETRY_S",
    "MAX_RETRY_S",
    "PLACE_SCAN_ALL",
    "PLACE_SAMPLE",
]
