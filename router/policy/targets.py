"""Per-request latency targets: predict a job's time to first token (TTFT)
and time per output token (TPOT) at admission, refuse a sheddable one at
once when no worker is predicted to meet them, place it where they are met
with the most headroom, and learn from what is observed.

TTFT predicted = raw x a calibration factor per model, regime and size
(short / long queue), where raw is, in regime

* "free" (a worker has a free slot and, for a job with a TPOT target,
  meets it): what is queued ahead of it over the measured drain rate
  (router.policy.wait_model), plus the soonest of those workers' start:
  per-request engine work, the prefill of the prompt's uncached part (the
  prefix index's blocks there) and one engine step at its load;
* "full" (every slot taken): the wait for the slot it will get -- the
  (q+1)-th soonest expected end of the jobs running on the workers it may
  run on (``kth_release``), q the jobs the queues serve before it
  (``jobs_ahead``: higher classes, its tenant's, the other tenants' share
  of deficit round robin, the other size's share of the short : long
  round robin from its credit, in whole jobs; plus what that count missed,
  learnt from how many were dispatched before each such job: for a short
  job a constant, for a long one a line in the wait its count predicts --
  the short arrivals served first while it waits: ``miss_line``) -- plus its
  own prefill and a step.  A job's expected end (``expected_end``) is
  counted on its worker's step clock: the worker's engine steps (one
  output message each: ``stepped``) since it was placed, against a step
  per max_tokens x the learnt ratio of steps run to that bound (EOS ends
  jobs early on real engines), at the worker's mean time between steps;
* calibration: observed over raw, a ratio of decayed sums (a mean of
  ratios is pulled up by the short raw predictions).

TPOT predicted on a worker = one engine step at its decode load once the
job joins (min(slots, running + other routers' + 1) sequences; the step
time it registered for a full batch, split into a fixed part and a part
per sequence as the sim engine's calibration splits it) x a
per-model factor calibrated by the TPOT observed when a job ends.

The prediction errors of the last ``SAMPLES`` (|observed - predicted| /
observed) are kept: ``mape`` and ``tpot_mape`` (the policy's snapshot).
Only jobs with a target are predicted (the rest pay nothing).  Pure: no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import TYPE_CHECKING, Any

from router.policy import fairness
from router.policy.types import (
    DEFAULT_PREFILL_TOKEN_S,
    DEFAULT_STEP_FIXED_S,
    DEFAULT_STEP_PER_SEQ_S,
    MIN_RETRY_S,
    SHORT,
    Job,
)
from shared.errors import Code, Refusal

if TYPE_CHECKING:
    from router.fleet.prefix_index import PrefixIndex
    from router.policy.model import ModelState
    from router.policy.placement.ask import Candidate
    from router.policy.records import Entry, WorkerState
    from router.policy.wait_model import WaitModel

SAMPLES = 1000
ALPHA = 0.1  # weight of one observation in a calibration factor
SELF_PART = 0.0
FACTOR_KEEP = 1.0 - 1.0 / 100  # what a TTFT factor's sums keep of the past at each observation
MIN_FACTOR, MAX_FACTOR = 0.2, 5.0
FREE, FULL = 0, 1  # TTFT regimes: a worker has a free slot / every slot is taken
MIN_RELEASES = 8.0  # releases the drain meter must have seen before its mean gap is used
MAX_SCAN = 4096  # running jobs whose ends a prediction looks at (a larger fleet: its first workers')
END_TAU = 200.0  # jobs' worth of weight in the observed / bound ratio of job durations
STEP_ALPHA = 0.05  # weight of one step in a worker's mean time between steps
IDLE_STEPS = 4.0  # a gap between steps longer than this many mean steps: the engine was idle
# per (model, class) counts (``Targets.by_class``): the names, in their order
OUTCOMES = ("ttft_met", "ttft_missed", "ttft_shed", "tpot_met", "tpot_missed", "tpot_shed", "goodput")
TTFT_MET, TTFT_MISSED, TTFT_SHED, TPOT_MET, TPOT_MISSED, TPOT_SHED, GOODPUT = range(7)


def step_parts(w: WorkerState) -> tuple[float, float]:
    """(fixed, per sequence) seconds of one engine step on ``w``: the sim
    calibration's parts, scaled so that a full batch takes the step time it
    registered (a slower engine is slower in both)."""
    spec = w.spec
    if spec.step_time_s is not None and spec.step_time_s > 0:
        scale = spec.step_time_s / (DEFAULT_STEP_FIXED_S + DEFAULT_STEP_PER_SEQ_S * max(1, spec.max_num_seqs))
        return DEFAULT_STEP_FIXED_S * scale, DEFAULT_STEP_PER_SEQ_S * scale
    return DEFAULT_STEP_FIXED_S, DEFAULT_STEP_PER_SEQ_S


def expected_end(placed_step: int, max_tokens: int, ratio: float, w: WorkerState) -> float:
    """When a job placed on ``w`` at its step ``placed_step`` is expected to
    end: a step per output token from there (an upper bound where EOS can
    stop it early) times ``ratio`` (observed / bound, learned), counted on
    ``w``'s step clock from its last step at its mean time between steps;
    one overdue ends at the next step."""
    left = placed_step + (max_tokens if max_tokens > 1 else 1) * ratio - w.steps
    return w.stepped_at + (left if left > 1.0 else 1.0) * w.step_gap


def kth_release(ends: list[float], q: float, now: float, gap: float) -> float:
    """When the job with ``q`` (>= 0, fractional: interpolated) served before
    it gets a slot, the slots' holders ending at ``ends`` (not empty): the
    (q+1)-th soonest of them (any overdue: now); past the last, ``gap``
    seconds per release more."""
    k = int(q)
    frac = q - k
    n = len(ends)
    soonest = heapq.nsmallest(k + 2, ends) if k + 2 < n else sorted(ends)

    def at(i: int) -> float:  # the (i+1)-th release
        if i < n:
            t = soonest[i]
            return t if t > now else now
        last = soonest[-1] if soonest[-1] > now else now
        return last + (i - n + 1) * gap

    return at(k) + frac * (at(k + 1) - at(k))


MIN_LINE_JOBS = 16.0  # long jobs (decayed) before their miss's line in the wait is used
MIN_LINE_SPREAD_S = 0.01  # nor before their waits spread this much (s.d., seconds): else the constant


def miss_line(row: list[float]) -> tuple[float, float] | None:
    """(a, b): a long job's count misses a + b x its predicted wait (b >= 0:
    the short arrivals served first meanwhile), least squares over the
    decayed sums of ``Targets.ahead_err``'s row; None until enough jobs
    with waits spread enough (a slope from a few nearly equal waits, or a
    single tiny one, would be noise scaled up)."""
    n, sw, sww, sm, swm = row[2], row[3], row[4], row[5], row[6]
    if n < MIN_LINE_JOBS:
        return None
    var = sww / n - (sw / n) ** 2
    if var < MIN_LINE_SPREAD_S * MIN_LINE_SPREAD_S:
        return None
    b = max(0.0, (swm / n - (sw / n) * (sm / n)) / var)
    return sm / n - b * sw / n, b


def tpot_raw(w: WorkerState) -> float:
    """Uncalibrated TPOT of a job joining ``w`` now: a step at its decode load with it."""
    fixed, per_seq = step_parts(w)
    n = len(w.running) + w.other_seqs + 1
    return fixed + per_seq * (n if n < w.slots else w.slots)


class Targets:
    __slots__ = (
        "waits",
        "prefix",
        "counters",
        "factor",
        "tpot_factor",
        "pending",
        "decoding",
        "errors",
        "tpot_errors",
        "by_class",
        "factor_sums",
        "entries",
        "last_q",
        "last_w0",
        "moved",
        "ahead_at",
        "model_dispatched",
        "ahead_err",
        "ends",
    )

    def __init__(
        self, waits: WaitModel, prefix: PrefixIndex, counters: dict[str, int], entries: dict[str, Entry] | None = None
    ) -> None:
        self.waits = waits
        self.entries: dict[str, Entry] = entries if entries is not None else {}  # the policy's, by job id
        # per model: [observed, bound] seconds of the jobs that ended, decayed (``end_ratio``)
        self.ends: dict[str, list[float]] = {}
        self.prefix = prefix
        self.counters = counters
        for k in (
            "ttft_target_shed",
            "ttft_target_met",
            "ttft_target_missed",
            "tpot_target_shed",
            "tpot_target_met",
            "tpot_target_missed",
        ):
            counters.setdefault(k, 0)
        # (model, regime, size): observed / raw predicted TTFT
        self.factor: dict[tuple[str, int, int], float] = {}
        self.factor_sums: dict[tuple[str, int, int], list[float]] = {}  # [observed, raw] TTFT, decayed
        self.last_q = 0.0  # the jobs ahead counted by the last prediction with every slot taken
        self.last_w0 = -1.0  # a long job's wait predicted from that count alone (-1: none worked out)
        # job id -> (its model's dispatches at its admission, the jobs ahead counted, model, size, that wait):
        # admitted with a TTFT target while every slot was taken, until it is dispatched
        self.ahead_at: dict[str, tuple[int, float, str, int, float]] = {}
        # model -> jobs dispatched (per model: another model's dispatches do not go before a job)
        self.model_dispatched: dict[str, int] = {}
        # (model, size) -> [sum of (dispatched ahead - counted), jobs; of the long jobs predicted with
        # running jobs to go by, with w the wait their counts predicted and m that miss: n, sum w,
        # sum w^2, sum m, sum w*m] of the jobs counted more than 0 ahead, decayed (``miss_line``)
        self.ahead_err: dict[tuple[str, int], list[float]] = {}
        self.tpot_factor: dict[str, float] = {}  # per model: observed / raw predicted TPOT
        # job id -> (predicted, raw, target, regime, its counts, its size) TTFT: until its first token
        self.pending: dict[str, tuple[float, float, float, int, list[int], int]] = {}
        # job id -> [predicted, raw, target, TTFT missed (0/1), its counts, a worker meets it at a full
        # batch, its model] TPOT: until it ends
        self.decoding: dict[str, list[Any]] = {}
        # (model, class) -> counts by OUTCOMES: attainment and goodput (a job
        # that met every target it had: counted when the last is judged)
        self.by_class: dict[tuple[str, str], list[int]] = {}
        # jobs taken off a worker to run again elsewhere while a prediction of theirs is open: still
        # judged against their targets, but their TTFT / TPOT (the outage in it) teach no calibration
        self.moved: set[str] = set()
        self.errors: deque[float] = deque(maxlen=SAMPLES)
        self.tpot_errors: deque[float] = deque(maxlen=SAMPLES)

    # ------------------------------------------------------------ prediction

    def tpot_s(self, model: str, w: WorkerState) -> float:
        """Calibrated TPOT of a job joining ``w`` now."""
        return tpot_raw(w) * self.tpot_factor.get(model, 1.0)

    def best_tpot(self, m: ModelState) -> tuple[float, float]:
        """(calibrated, raw) TPOT on the usable worker with the lightest decode
        load (inf: none usable)."""
        raw = min(
            (tpot_raw(w) for w in m.workers.values() if w.healthy and w.gpu_block is None),
            default=float("inf"),
        )
        return raw * self.tpot_factor.get(m.name, 1.0), raw

    def service_s(self, m: ModelState, job: Job, now: float, tpot_target: float = 0.0) -> float | None:
        """The soonest a worker with a free slot (and, given ``tpot_target``,
        predicted to meet it) starts ``job``'s first token (None: none)."""
        hits = self.prefix.match(job.model, job.block_hashes, now) if job.block_hashes else None
        best: float | None = None
        prompt = max(1, job.prompt_tokens)
        tf = self.tpot_factor.get(m.name, 1.0)
        for w in m.workers.values():
            n = len(w.running) + w.other_seqs
            if not w.healthy or w.gpu_block is not None or n >= w.slots:
                continue
            if tpot_target > 0.0 and tpot_raw(w) * tf > tpot_target:
                continue
            spec = w.spec
            cached = hits.get(spec.worker_id, 0) * spec.block_size if hits else 0
            fixed, per_seq = step_parts(w)
            s = spec.request_s() + max(0, prompt - cached) * DEFAULT_PREFILL_TOKEN_S + fixed + per_seq * (n + 1)
            if best is None or s < best:
                best = s
        return best

    def predict(self, m: ModelState, e: Entry, now: float, tpot_target: float = 0.0) -> tuple[float, float, int]:
        """(calibrated, raw, regime) predicted TTFT of ``e`` on model ``m``, in seconds."""
        job = e.job
        ahead = 0.0
        if m.totals.queued:
            ahead, _, _ = self.waits.ahead(m, e)
        service = self.service_s(m, job, now, tpot_target)
        regime = FREE
        if service is None:  # every slot taken: it waits for a slot to be released
            regime = FULL
            raw = self._slot_wait(m, e, ahead, now, tpot_target) + self._floor(m, job)
        else:
            wait = 0.0
            if ahead:
                rate = self.waits.drain_rate(m, e.rank, e.tokens, max(0, job.max_tokens), now)
                if rate > 0.0:
                    wait = ahead / rate
            raw = wait + service
        return raw * self.factor.get((job.model, regime, e.size), 1.0), raw, regime

    def _slot_wait(self, m: ModelState, e: Entry, ahead: float, now: float, tpot_target: float) -> float:
        """Seconds until a slot is free for ``e`` when every slot is taken:
        the (q+1)-th soonest expected end (``expected_end``) of the jobs
        running on the workers it may run on (q: the jobs served before it,
        its ``ahead`` tokens over the mean job the drain meter saw released),
        interpolated for a fractional q.  Without running jobs to go by: q+1
        mean gaps between releases."""
        job = e.job
        tokens, jobs, window = m.totals.meter.snapshot(now)
        q = self.jobs_ahead(m, e) if ahead > 0.0 else 0.0
        if q is None:  # (one FIFO: the jobs in its tokens ahead)
            mean_job = tokens / jobs if jobs >= MIN_RELEASES and tokens > 0.0 else float(e.tokens)
            q = ahead / mean_job if mean_job > 0.0 else 0.0
        self.last_q = q
        self.last_w0 = -1.0
        ends: list[float] = []
        scanned = usable = 0
        ratio = self.end_ratio(m.name)
        f = self.tpot_factor.get(m.name, 1.0)
        entries = self.entries
        for w in m.workers.values():
            if not w.healthy or w.gpu_block is not None:
                continue
            usable += 1
            if tpot_target > 0.0:
                fixed, per_seq = step_parts(w)
                if (fixed + per_seq * w.slots) * f > tpot_target:
                    continue  # (it waits for a release on a worker that meets its TPOT target)
            if len(ends) >= MAX_SCAN or w.stepped_at < 0.0:
                continue
            scanned += 1
            for jid in w.running:
                r = entries.get(jid)
                if r is not None and r.placed_step >= 0:
                    ends.append(expected_end(r.placed_step, r.job.max_tokens, ratio, w))
        # of the releases it waits for, the share on the workers looked at: those that meet its TPOT
        # target (the jobs ahead take the others'), in a large fleet the first of them
        share = scanned / usable if scanned < usable else 1.0
        gap = window / jobs if jobs >= MIN_RELEASES and window > 0.0 else 0.0
        if q > 0.0:  # what the count misses (learnt: ``dispatching``)
            row = self.ahead_err.get((m.name, e.size))
            if e.size != SHORT and ends:
                # the short arrivals served first while it waits: a line in the wait its count predicts
                w0 = self.last_w0 = max(0.0, kth_release(ends, q * share, now, gap) - now)
                fit = miss_line(row) if row is not None else None
                if fit is not None:
                    q = max(0.0, q + fit[0] + fit[1] * w0)
                elif row is not None and row[1] > 0.0:
                    q = max(0.0, q + row[0] / row[1])
            elif row is not None and row[1] > 0.0:  # round-robin granularity: a constant
                q = max(0.0, q + row[0] / row[1])
        q *= share
        if not ends:
            if gap <= 0.0:  # (a cold fleet: one job's worth of the drain rate)
                rate = self.waits.drain_rate(m, e.rank, e.tokens, max(0, job.max_tokens), now)
                gap = e.tokens / rate if rate > 0.0 else 0.0
            return (q + 1.0) * gap
        return max(0.0, kth_release(ends, q, now, gap) - now)

    def jobs_ahead(self, m: ModelState, e: Entry) -> float | None:
        """How many queued jobs are served before ``e`` (not yet queued), in
        the order the queues serve them (None: one FIFO): every job queued
        in a higher class; in its own (class, size) queue, its tenant's
        jobs and what deficit round robin serves the other tenants
        meanwhile (their tokens in proportion to their weights, in their
        mean job); and of the class's other size, the tokens its short :
        long share gives it meanwhile, in whole jobs of its mean size (it is
        served a job at a time once its credit is behind).  O(classes)."""
        order = self.waits.order
        if not order.ranked:
            return None
        mq = m.queues
        rank = e.rank
        job = e.job
        n = float(sum(mq.class_count[:rank]))
        q = mq.by_key.get(order.key(rank, e.size))
        served = float(e.tokens)  # tokens its queue dispatches until it is served
        if q is not None and q.count:
            row = m.totals.tenants[rank].get(job.tenant)
            own_tokens = min(float(row[0]) if row is not None else 0.0, float(q.tokens))
            line = q.tenants.get(job.tenant)
            if line is None:  # its tenant has none in this queue (its class's tokens are the other size's)
                own = mine = own_tokens = mine_tokens = 0.0
            elif isinstance(line, deque):
                own = mine = float(min(q.count, len(line)))
                mine_tokens = own_tokens
            else:
                # by fairness id: of its tenant's, its own line's and a round of the other lines'
                # (fairness.tenant_ahead, as admission counts them), in its tenant's mean queued job
                by_id = m.totals.by_id[rank].get(job.tenant)
                ahead = fairness.tenant_ahead(int(own_tokens), e.tokens, by_id or {}, job.fairness_id)
                mine_tokens = min(own_tokens, float(ahead))
                mean = float(row[0]) / row[1] if row is not None and row[1] > 0 else float(e.tokens)
                own = own_tokens / max(1.0, mean)
                mine = mine_tokens / max(1.0, mean)
            n += mine
            served += mine_tokens
            others, others_tokens = q.count - own, q.tokens - own_tokens
            if others > 0 and others_tokens > 0.0:
                w = max(1e-3, job.weight)
                w_others = max(0.0, sum(q.weight.values()) - q.weight.get(job.tenant, 0.0))
                theirs = min(others_tokens, served * w_others / w)
                n += theirs * others / others_tokens
                served += theirs
        other = mq.by_key.get(order.key(rank, 1 - e.size))
        if other is not None and other.count and other.tokens > 0:
            # weighted round robin by tokens: the other size dispatches until its tokens over its share
            # catch up with this one's at this job (from where its credit stands: mq.wrr)
            cfg = order.cfg
            mine_share, other_share = (
                (cfg.short_share, cfg.long_share) if e.size == SHORT else (cfg.long_share, cfg.short_share)
            )
            wrr = mq.wrr[rank]
            at = (wrr[e.size] + served - e.tokens) / max(1, mine_share)
            theirs = (at - wrr[1 - e.size] / max(1, other_share)) * other_share
            if theirs > 0.0:
                # whole jobs: the other size is served until its credit catches up, so a deficit of
                # any size costs at least one of its jobs (counted as a fraction: ~0.3 jobs too few a short one)
                n += min(float(other.count), math.ceil(theirs * other.count / other.tokens))
        return n

    @staticmethod
    def _floor(m: ModelState, job: Job) -> float:
        """A job's own start once a slot is free: prefill and one step at a full batch."""
        step = min((w.spec.step_s() for w in m.workers.values()), default=DEFAULT_STEP_FIXED_S)
        return max(1, job.prompt_tokens) * DEFAULT_PREFILL_TOKEN_S + step

    # ------------------------------------------------------------ admission

    def admit(
        self, m: ModelState, e: Entry, now: float, target: float, tpot_target: float, sheddable: bool, klass: str
    ) -> Refusal | None:
        """Record ``e``'s predictions against its targets (seconds, 0: none);
        a sheddable job predicted to miss one: refused."""
        job = e.job
        counts = self.by_class.get((m.name, klass))
        if counts is None:  # (bounded: models x configured classes)
            counts = self.by_class[(m.name, klass)] = [0] * len(OUTCOMES)
        tpot = tpot_raw_best = 0.0
        if tpot_target > 0.0:
            tpot, tpot_raw_best = self.best_tpot(m)
            if tpot > tpot_target and sheddable:
                self.counters["tpot_target_shed"] += 1
                counts[TPOT_SHED] += 1
                return self._refuse(klass, "TPOT", tpot_target, tpot)
        if target > 0.0:
            predicted, raw, regime = self.predict(m, e, now, tpot_target)
            if predicted > target and sheddable:
                self.counters["ttft_target_shed"] += 1
                counts[TTFT_SHED] += 1
                return self._refuse(klass, "TTFT", target, predicted)
            if len(self.pending) < 1_000_000:  # (bounded: entries leave at first token or at the end)
                self.pending[job.job_id] = (predicted, raw, target, regime, counts, e.size)
                if regime == FULL and self.last_q > 0.0:
                    at = self.model_dispatched.get(m.name, 0)
                    self.ahead_at[job.job_id] = (at, self.last_q, m.name, e.size, self.last_w0)
        if tpot_target > 0.0 and len(self.decoding) < 1_000_000:
            # (and whether some worker meets it even at a full batch: then it waits for one that does)
            meets = self._full_meets(m, tpot_target) > 0.0
            self.decoding[job.job_id] = [tpot, tpot_raw_best, tpot_target, 0, counts, meets, m.name]
        return None

    def _full_meets(self, m: ModelState, tpot_target: float) -> float:
        """The share of usable workers that meet ``tpot_target`` even with a full batch."""
        f = self.tpot_factor.get(m.name, 1.0)
        n = meets = 0
        for w in m.workers.values():
            if w.healthy and w.gpu_block is None:
                n += 1
                fixed, per_seq = step_parts(w)
                if (fixed + per_seq * w.slots) * f <= tpot_target:
                    meets += 1
        return meets / n if n else 0.0

    def dispatched(self, job_id: str, w: WorkerState) -> None:
        """A job with a TPOT target was placed on ``w``: predicted there (what its end is judged by)."""
        d = self.decoding.get(job_id)
        if d is not None:
            raw = tpot_raw(w)
            d[0], d[1] = raw * self.tpot_factor.get(w.spec.model, 1.0), raw

    @staticmethod
    def _refuse(klass: str, what: str, target: float, predicted: float) -> Refusal:
        """429 for a sheddable job predicted to miss its ``what`` ("TTFT", "TPOT") target (seconds)."""
        retry = max(MIN_RETRY_S, round(predicted - target, 1))
        return Refusal(
            Code.TARGET_UNATTAINABLE,
            retry,
            {
                "message": (
                    f"No worker can serve this request within its {what} target of {target * 1000:g} ms "
                    f"(predicted {predicted * 1000:.1f} ms, class `{klass}`); it is sheddable, so it is "
                    f"refused now rather than served late. Retry later, or send it without "
                    f"x-weir-sheddable to have it served anyway."
                )
            },
        )

    # ------------------------------------------------------------ placement

    def place(self, job_id: str, cands: list[Candidate], now: float, arrival: float, due: bool) -> list[float] | None:
        """A load scorer for a job with a target (None: it has none): each
        candidate's headroom to its targets, the smaller of TTFT's and
        TPOT's, as a fraction of the target (higher: more to spare); where
        some candidates meet every target, the others score 4 less.  An
        empty list: none of them meets its TPOT target but a worker of its
        model does even with a full batch, so it waits for one (unless it
        is due: aging bounds that wait)."""
        t = self.pending.get(job_id)
        d = self.decoding.get(job_id)
        if t is None and d is None:
            return None
        if d is not None and d[5] and not due:
            target = d[2]
            if all(self.tpot_s(w.spec.model, w) > target for w, _, _, _ in cands):
                return []
        ttft_left = t[2] - (now - arrival) if t is not None else 0.0
        scores = []
        meets = False
        for w, _, _, n in cands:
            h = 1.0
            if d is not None:
                h = (d[2] - self.tpot_s(w.spec.model, w)) / d[2]
            if t is not None:
                fixed, per_seq = step_parts(w)
                start = w.spec.request_s() + fixed + per_seq * (n + 1)
                h = min(h, (ttft_left - start) / t[2])
            meets = meets or h >= 0.0
            scores.append(h)
        if meets:  # (least_loaded scores 0..3: one that misses never wins over one that meets)
            return [h if h >= 0.0 else h - 4.0 for h in scores]
        return scores

    # ------------------------------------------------------------ observation

    def first_token(self, job_id: str, model: str, ttft: float) -> None:
        """The job's first token came ``ttft`` seconds after its arrival."""
        got = self.pending.pop(job_id, None)
        if got is None or ttft <= 0.0:
            if self.moved and job_id not in self.decoding:
                self.moved.discard(job_id)
            return
        predicted, raw, target, regime, counts, size = got
        met = ttft <= target
        self.counters["ttft_target_met" if met else "ttft_target_missed"] += 1
        counts[TTFT_MET if met else TTFT_MISSED] += 1
        d = self.decoding.get(job_id)
        if d is not None:
            d[3] = 0 if met else 1  # judged with its TPOT at its end
        elif met:
            counts[GOODPUT] += 1
        if self.moved and job_id in self.moved:
            if d is None:
                self.moved.discard(job_id)
            return
        self.errors.append(abs(ttft - predicted) / ttft)
        if raw > 0.0:
            # (a ratio of sums, not a mean of ratios: a short raw prediction's large ratio would pull it up)
            key = (model, regime, size)
            sums = self.factor_sums.get(key)
            if sums is None:
                sums = self.factor_sums[key] = [0.0, 0.0]
            sums[0] = sums[0] * FACTOR_KEEP + ttft
            sums[1] = sums[1] * FACTOR_KEEP + raw
            self.factor[key] = min(MAX_FACTOR, max(MIN_FACTOR, sums[0] / sums[1]))

    def ended(self, job_id: str, tpot: float) -> None:
        """The job ended, its tokens after the first ``tpot`` seconds apart (0: unknown)."""
        got = self.decoding.pop(job_id, None)
        if got is None or tpot <= 0.0:
            self.moved.discard(job_id)
            return
        predicted, raw, target, ttft_missed, counts, _, model = got
        met = tpot <= target
        self.counters["tpot_target_met" if met else "tpot_target_missed"] += 1
        counts[TPOT_MET if met else TPOT_MISSED] += 1
        if met and not ttft_missed:
            counts[GOODPUT] += 1
        if self.moved and job_id in self.moved:
            self.moved.discard(job_id)
            return
        self.tpot_errors.append(abs(tpot - predicted) / tpot)
        if raw > 0.0:
            self.tpot_factor[model] = _learn(self.tpot_factor.get(model, 1.0), tpot / raw)

    def released(self, e: Entry, w: WorkerState) -> None:
        """``e``, placed on ``w``, ended (at ``w``'s last step): a sample of
        how many steps jobs run against their bound (``expected_end``), per
        model."""
        if e.placed_step < 0:
            return
        row = self.ends.get(e.job.model)
        if row is None:
            row = self.ends[e.job.model] = [0.0, 0.0]
        keep = 1.0 - 1.0 / END_TAU
        mt = e.job.max_tokens
        row[0] = row[0] * keep + (w.steps - e.placed_step)
        row[1] = row[1] * keep + (mt if mt > 1 else 1)

    @staticmethod
    def stepped(w: WorkerState, now: float) -> None:
        """``w``'s engine ended a step (its output message came): its step
        clock, and the mean time between steps (a gap is counted as at most
        IDLE_STEPS mean steps: an idle engine's gap is not a step, but an
        engine slower than it registered still teaches its step time)."""
        if w.stepped_at >= 0.0:
            dt = now - w.stepped_at
            if dt > 0.0:
                cap = IDLE_STEPS * w.step_gap
                w.step_gap += STEP_ALPHA * ((dt if dt < cap else cap) - w.step_gap)
        w.steps += 1
        w.stepped_at = now

    def end_ratio(self, model: str) -> float:
        """Observed / bound duration of the model's jobs (1.0 until some ended)."""
        row = self.ends.get(model)
        if row is None or row[1] <= 0.0:
            return 1.0
        return min(MAX_FACTOR, max(MIN_FACTOR, row[0] / row[1]))

    def dispatching(self, job_id: str) -> None:
        """A job is dispatched (before it counts): if it was admitted with
        every slot taken, how many were dispatched before it against how
        many it counted ahead (``jobs_ahead``: learnt per model and size)."""
        got = self.ahead_at.pop(job_id, None)
        if got is None:
            return
        at, q, model, size, w0 = got
        row = self.ahead_err.get((model, size))
        if row is None:
            row = self.ahead_err[(model, size)] = [0.0] * 7
        miss = self.model_dispatched.get(model, 0) - at - q
        k = FACTOR_KEEP
        row[0] = row[0] * k + miss
        row[1] = row[1] * k + 1.0
        if w0 >= 0.0:  # (a long job predicted with running jobs: its miss against its wait, for the line)
            row[2] = row[2] * k + 1.0
            row[3] = row[3] * k + w0
            row[4] = row[4] * k + w0 * w0
            row[5] = row[5] * k + miss
            row[6] = row[6] * k + w0 * miss

    def taken_off(self, job_id: str) -> None:
        """The job was taken off its worker to run again elsewhere: judged
        where it runs next against what was predicted at its admission, but
        what it then observes (its outage included) is no calibration sample."""
        if job_id in self.pending or job_id in self.decoding:
            self.moved.add(job_id)

    def forget(self, job_id: str) -> None:
        self.ahead_at.pop(job_id, None)
        self.pending.pop(job_id, None)
        self.decoding.pop(job_id, None)
        self.moved.discard(job_id)

    def view(self) -> list[dict[str, object]]:
        """Attainment and goodput per (model, class), for /metrics."""
        return [
            {"model": model, "klass": klass, **dict(zip(OUTCOMES, counts, strict=True))}
            for (model, klass), counts in sorted(self.by_class.items())
        ]

    def mape(self) -> float | None:
        """Mean absolute percentage error of the last TTFT predictions (None: none yet)."""
        return sum(self.errors) / len(self.errors) if self.errors else None

    def tpot_mape(self) -> float | None:
        """Mean absolute percentage error of the last TPOT predictions (None: none yet)."""
        return sum(self.tpot_errors) / len(self.tpot_errors) if self.tpot_errors else None


def _learn(f: float, ratio: float) -> float:
    ratio = min(MAX_FACTOR, max(MIN_FACTOR, ratio))
    return min(MAX_FACTOR, max(MIN_FACTOR, (1.0 - ALPHA) * f + ALPHA * ratio))
