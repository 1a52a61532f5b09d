"""Per-request latency targets: predict a job's time to first token at
admission, refuse a sheddable one at once when no worker is predicted to
meet its target, and learn from what is observed.

TTFT predicted = (queue wait + the best worker's service start) x a
per-model calibration factor, where

* queue wait: what is queued ahead of it over the measured drain rate
  (router.policy.wait_model), plus one job's drain when no worker has a free
  slot;
* service start, per worker with a free slot: its per-request engine work,
  the prefill of the prompt's uncached part (the prefix index's blocks
  there), and one engine step at its load (running sequences + 1);
* calibration: the observed / predicted ratio's moving average, per model,
  so what the capacity model misses (a slower engine, a loaded host) is
  learnt from the requests that carry a target.

The prediction error of the last ``SAMPLES`` (|observed - predicted| /
observed) is kept: ``mape`` (reported in the policy's snapshot).  Only jobs
with a target are predicted (the rest pay nothing).  Pure: no I/O.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from router.policy.types import (
    DEFAULT_PREFILL_TOKEN_S,
    DEFAULT_STEP_FIXED_S,
    DEFAULT_STEP_PER_SEQ_S,
    MIN_RETRY_S,
    Job,
)
from shared.errors import Code, Refusal

if TYPE_CHECKING:
    from router.fleet.prefix_index import PrefixIndex
    from router.policy.model import ModelState
    from router.policy.records import Entry
    from router.policy.wait_model import WaitModel

SAMPLES = 1000
ALPHA = 0.1  # weight of one observation in the calibration factor
MIN_FACTOR, MAX_FACTOR = 0.2, 5.0


class Targets:
    __slots__ = ("waits", "prefix", "counters", "factor", "pending", "errors")

    def __init__(self, waits: WaitModel, prefix: PrefixIndex, counters: dict[str, int]) -> None:
        self.waits = waits
        self.prefix = prefix
        self.counters = counters
        for k in ("ttft_target_shed", "ttft_target_met", "ttft_target_missed"):
            counters.setdefault(k, 0)
        self.factor: dict[str, float] = {}  # per model: observed / raw predicted TTFT
        self.pending: dict[str, tuple[float, float, float]] = {}  # job id -> (predicted, raw, target)
        self.errors: deque[float] = deque(maxlen=SAMPLES)

    # ------------------------------------------------------------ prediction

    def service_s(self, m: ModelState, job: Job, now: float) -> float | None:
        """The soonest a worker with a free slot starts ``job``'s first token
        (None: none has one)."""
        hits = self.prefix.match(job.model, job.block_hashes, now) if job.block_hashes else None
        best: float | None = None
        prompt = max(1, job.prompt_tokens)
        for w in m.workers.values():
            n = len(w.running) + w.other_seqs
            if not w.healthy or w.gpu_block is not None or n >= w.slots:
                continue
            spec = w.spec
            cached = hits.get(spec.worker_id, 0) * spec.block_size if hits else 0
            per_seq = DEFAULT_STEP_PER_SEQ_S
            if spec.step_time_s is not None and spec.step_time_s > 0:
                per_seq = max(0.0, spec.step_time_s - DEFAULT_STEP_FIXED_S) / max(1, spec.max_num_seqs)
            s = (
                spec.request_s()
                + max(0, prompt - cached) * DEFAULT_PREFILL_TOKEN_S
                + DEFAULT_STEP_FIXED_S
                + per_seq * (n + 1)
            )
            if best is None or s < best:
                best = s
        return best

    def predict(self, m: ModelState, e: Entry, now: float) -> tuple[float, float]:
        """(calibrated, raw) predicted TTFT of ``e`` on model ``m``, in seconds."""
        job = e.job
        wait = 0.0
        rate = 0.0
        if m.totals.queued:
            ahead, _, _ = self.waits.ahead(m, e)
            rate = self.waits.drain_rate(m, e.rank, e.tokens, max(0, job.max_tokens), now)
            if rate > 0.0:
                wait = ahead / rate
        service = self.service_s(m, job, now)
        if service is None:  # every slot taken: it waits for one job's worth to drain too
            if rate <= 0.0:
                rate = self.waits.drain_rate(m, e.rank, e.tokens, max(0, job.max_tokens), now)
            service = (e.tokens / rate if rate > 0.0 else 0.0) + self._floor(m, job)
        raw = wait + service
        return raw * self.factor.get(job.model, 1.0), raw

    @staticmethod
    def _floor(m: ModelState, job: Job) -> float:
        """A job's own start once a slot is free: prefill and one step at a full batch."""
        step = min((w.spec.step_s() for w in m.workers.values()), default=DEFAULT_STEP_FIXED_S)
        return max(1, job.prompt_tokens) * DEFAULT_PREFILL_TOKEN_S + step

    # ------------------------------------------------------------ admission

    def admit(self, m: ModelState, e: Entry, now: float, target: float, sheddable: bool, klass: str) -> Refusal | None:
        """Record ``e``'s prediction against its ``target`` (seconds); a
        sheddable job predicted to miss it: refused."""
        job = e.job
        predicted, raw = self.predict(m, e, now)
        if predicted > target and sheddable:
            self.counters["ttft_target_shed"] += 1
            retry = max(MIN_RETRY_S, round(predicted - target, 1))
            return Refusal(
                Code.TARGET_UNATTAINABLE,
                retry,
                {
                    "message": (
                        f"No worker can start this request within its TTFT target of {target * 1000:g} ms "
                        f"(predicted {predicted * 1000:.0f} ms, class `{klass}`); it is sheddable, so it is "
                        f"refused now rather than served late. Retry later, or send it without "
                        f"x-weir-sheddable to have it served anyway."
                    )
                },
            )
        if len(self.pending) < 1_000_000:  # (bounded: entries leave at first token or at the end)
            self.pending[job.job_id] = (predicted, raw, target)
        return None

    # ------------------------------------------------------------ observation

    def first_token(self, job_id: str, model: str, ttft: float) -> None:
        """The job's first token came ``ttft`` seconds after its arrival."""
        got = self.pending.pop(job_id, None)
        if got is None or ttft <= 0.0:
            return
        predicted, raw, target = got
        self.counters["ttft_target_met" if ttft <= target else "ttft_target_missed"] += 1
        self.errors.append(abs(ttft - predicted) / ttft)
        if raw > 0.0:
            f = self.factor.get(model, 1.0)
            ratio = min(MAX_FACTOR, max(MIN_FACTOR, ttft / raw))
            self.factor[model] = min(MAX_FACTOR, max(MIN_FACTOR, (1.0 - ALPHA) * f + ALPHA * ratio))

    def forget(self, job_id: str) -> None:
        self.pending.pop(job_id, None)

    def mape(self) -> float | None:
        """Mean absolute percentage error of the last predictions (None: none yet)."""
        if not self.errors:
            return None
        return sum(self.errors) / len(self.errors)
