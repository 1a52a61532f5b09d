"""The one driver of the scheduling simulations: routers' policies over a
fleet of simulated engines, in virtual time.

Events at one instant are applied together -- arrivals, engine steps ending,
heartbeats, policy wake-ups -- then every router whose state changed runs a
policy pass and its actions are carried out as router.lifecycle.core carries them out:
a dispatch reaches the engine (through the worker's own ledger when the
workers arbitrate, as with several routers), a refusal or an abort ends the
job.  Engine steps are modelled as vLLM runs them: ``SimCore.step()`` decides
what a step does when it starts, its outputs appear when it ends, and
requests dispatched meanwhile join the next step.  Router, network and
engine-boundary latency are taken as zero.

simulation.des runs one router; simulation.routers_des runs N.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any

from engine_worker.ledger import Ledger
from engine_worker.sim_model import SimCore, StepResult
from router.policy import AbortJob, DispatchJob, Job, Policy, RejectJob, WorkerSpec
from shared.config import SchedulerConfig, SimEngineConfig
from shared.protocol import Pool, TaskType

MODEL = "sim-des"


@dataclass(frozen=True)
class Kind:
    """One slice of a workload mix."""

    name: str
    share: float  # relative arrival share
    prompt: tuple[int, int]  # uniform range, tokens
    max_tokens: tuple[int, int]
    klass: str = "normal"
    tenants: tuple[str, ...] = ("t0",)
    task_type: TaskType = TaskType.AUTO
    # latency targets its requests carry (router.policy.targets; 0: none)
    ttft_target_s: float = 0.0
    tpot_target_s: float = 0.0
    sheddable: bool = False


# (time, kind, tenant, prompt tokens, max_tokens)
Arrival = tuple[float, Kind, str, int, int]


@dataclass(frozen=True)
class SimWorker:
    worker_id: str
    pool: Pool = Pool.ANY
    max_num_seqs: int = 32
    max_model_len: int = 4096
    engine: SimEngineConfig = field(default_factory=SimEngineConfig)


@dataclass
class Record:
    job_id: str
    kind: str
    klass: str
    tenant: str
    prompt: int
    max_tokens: int
    arrival: float
    dispatched: float | None = None
    first_token: float | None = None
    finished: float | None = None
    outcome: str = ""  # "ok" | refusal code | "generation_deadline"
    predicted: float | None = None  # queue wait the policy predicted when it admitted it
    submitted: float | None = None  # its last (admitted or refused) submission
    attempts: int = 0
    first_refusal: str = ""  # code of the first attempt's refusal, if it was refused
    predicted_ttft: float | None = None  # TTFT the policy predicted at admission (a job with a target)
    ttft_regime: int = -1  # the prediction's regime (router.policy.targets: FREE, FULL)


class Engine:
    __slots__ = ("spec", "core", "busy", "pending")

    def __init__(self, w: SimWorker) -> None:
        self.core = SimCore(w.engine, w.max_num_seqs, w.max_model_len)
        self.spec = WorkerSpec(
            worker_id=w.worker_id,
            model=MODEL,
            pool=w.pool,
            capacity_tokens=self.core.kv_capacity_tokens,
            block_size=self.core.block_size,
            max_num_seqs=w.max_num_seqs,
            max_model_len=w.max_model_len,
        )
        c, default = w.engine, SimEngineConfig()
        if (c.step_fixed_ms, c.decode_token_us) != (default.step_fixed_ms, default.decode_token_us):
            # a slower (or faster) engine registers its full batch's step, as engine_worker.sim_engine does
            self.spec.step_time_s = (c.step_fixed_ms * 1e3 + c.decode_token_us * w.max_num_seqs) / 1e6
        self.busy = False
        self.pending: StepResult | None = None


_ARRIVE, _STEP, _BEAT, _WAKE = 0, 1, 2, 3


class Driver:
    """``n_routers`` policies of ``cfg`` over ``workers``.

    ``arbitrate``: each worker's own ledger (engine_worker.ledger) admits or
    refuses what the routers dispatch, and tells each router every
    ``heartbeat_s`` what the others hold there (a refused job is queued again
    at once, with the worker's figures).  ``pick``: arrivals go to the router
    with the fewer jobs in flight of two drawn (Envoy's least-request);
    without it, to the first.  ``retries``: a request refused with a
    Retry-After is sent again after it (rounded up to whole seconds, as the
    HTTP header is), up to that many times.  ``record_predicted``: each
    admitted job's predicted queue wait goes into its record.
    ``pass_each_instant``: a policy pass after every instant, not only after
    a router's state changed: a pass with nothing new can still place a job
    (placement samples candidates in a large fleet).  ``targets``: jobs
    carry their kind's latency targets (else they are sent without them); a
    first token is reported to the policy as router.lifecycle.core reports it.
    """

    def __init__(
        self,
        cfg: SchedulerConfig,
        workers: list[SimWorker],
        n_routers: int = 1,
        *,
        arbitrate: bool = False,
        heartbeat_s: float = 1.0,
        pick: random.Random | None = None,
        retries: int = 0,
        record_predicted: bool = False,
        pass_each_instant: bool = False,
        targets: bool = True,
    ) -> None:
        self.routers = [Policy(cfg) for _ in range(n_routers)]
        self.engines = {w.worker_id: Engine(w) for w in workers}
        for p in self.routers:
            for e in self.engines.values():
                p.add_worker(e.spec, 0.0)
        self.ledgers: dict[str, Ledger] | None = None
        if arbitrate:
            self.ledgers = {
                wid: Ledger(cfg.kv_budget(e.spec.capacity_tokens), cfg.seq_slots(e.spec.max_num_seqs))
                for wid, e in self.engines.items()
            }
        self.heartbeat_s = heartbeat_s
        self.pick = pick
        self.retries = retries
        self.record_predicted = record_predicted
        self.pass_each_instant = pass_each_instant
        self.targets = targets
        self.records: dict[str, Record] = {}
        self.owner: dict[str, int] = {}  # job id -> the router that admitted it
        self.in_flight = [0] * n_routers
        self.refused_by_worker = 0  # dispatches a worker's ledger refused
        self.max_overcommit_tokens = 0  # the most any ledger held over its budget (0: never)
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0  # ties at one instant: in the order pushed
        self._arrivals_left = 0
        self._live = 0  # admitted and not ended
        self._dirty: set[int] = set()  # routers whose policy pass is due
        self._wake_at = math.inf

    def run(self, arrivals: list[Arrival], end: float) -> float:
        """Until every job has ended (or ``end``); the simulated time reached."""
        ev = self._events
        for i, (t, k, tenant, prompt, max_tokens) in enumerate(arrivals):
            ev.append((t, self._seq, _ARRIVE, (f"j{i}", k, tenant, prompt, max_tokens)))
            self._seq += 1
        self._arrivals_left = len(ev)
        if len(self.routers) > 1 and self.ledgers is not None:
            ev.append((self.heartbeat_s, self._seq, _BEAT, None))
            self._seq += 1
        heapq.heapify(ev)
        self._dirty = set(range(len(self.routers)))
        now = 0.0
        while ev:
            if ev[0][0] > end:
                now = end
                break
            now = ev[0][0]
            while ev and ev[0][0] == now:  # everything at this instant, then the policy passes
                _, _, kind, data = heapq.heappop(ev)
                if kind == _ARRIVE:
                    self._arrive(data, now)
                elif kind == _STEP:
                    self._step_ended(data, now)
                elif kind == _WAKE:
                    self._wake_at = math.inf
                    self._dirty.update(range(len(self.routers)))  # deadlines, aging: every router's pass
                else:
                    self._heartbeat(now)
            if self.pass_each_instant:
                self._dirty.update(range(len(self.routers)))
            self._policy_passes(now)
            self._start_steps(now)
            self._schedule_wakeup(now)
            if self._live == 0 and self._arrivals_left == 0 and not any(e.core.has_work for e in self.engines.values()):
                break
        for rec in self.records.values():
            if not rec.outcome:
                rec.outcome = "unfinished"
        return now

    @property
    def preemptions(self) -> int:
        return sum(e.core.preemptions_total for e in self.engines.values())

    def _push(self, t: float, kind: int, data: Any) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, data))
        self._seq += 1

    def _router_for_arrival(self) -> int:
        if self.pick is None:
            return 0
        n = len(self.routers)
        a, b = self.pick.randrange(n), self.pick.randrange(n)
        return a if self.in_flight[a] <= self.in_flight[b] else b

    def _arrive(self, data: tuple[str, Kind, str, int, int], now: float) -> None:
        job_id, k, tenant, prompt, max_tokens = data
        self._arrivals_left -= 1
        r = self._router_for_arrival()
        rec = self.records.get(job_id)
        if rec is None:
            rec = self.records[job_id] = Record(job_id, k.name, k.klass, tenant, prompt, max_tokens, now)
        rec.attempts += 1
        rec.submitted = now
        p = self.routers[r]
        job = Job(job_id, MODEL, tenant, k.klass, prompt, max_tokens, k.task_type, now)
        if self.targets and (k.ttft_target_s or k.tpot_target_s):
            job.ttft_target_s, job.tpot_target_s, job.sheddable = k.ttft_target_s, k.tpot_target_s, k.sheddable
        err = p.submit(job, now)
        if err is not None:
            rec.outcome = err.code or str(err.status)
            if rec.attempts == 1:
                rec.first_refusal = rec.outcome
            if err.retry_after is not None and rec.attempts <= self.retries:
                self._push(now + math.ceil(err.retry_after), _ARRIVE, data)
                self._arrivals_left += 1
            return
        rec.outcome = ""
        if self.record_predicted:
            predicted = p.entries[job_id].predicted
            rec.predicted = predicted if predicted >= 0.0 else None
        pending = p.targets.pending.get(job_id)
        if pending is not None:
            rec.predicted_ttft, rec.ttft_regime = pending[0], pending[3]
        self.owner[job_id] = r
        self.in_flight[r] += 1
        self._live += 1
        self._dirty.add(r)

    def _step_ended(self, worker_id: str, now: float) -> None:
        eng = self.engines[worker_id]
        eng.busy = False
        assert eng.pending is not None
        if eng.pending.outputs:  # (router.lifecycle.core: a worker's output message, one per step)
            for p in self.routers:
                p.stepped(worker_id, now)
        for rid, _, fin in eng.pending.outputs:
            rec = self.records[rid]
            if rec.first_token is None:
                rec.first_token = now
                r = self.owner[rid]
                if self.routers[r].targets.pending:  # (router.lifecycle.core: from its last submission)
                    self.routers[r].first_token(rid, MODEL, now - (rec.submitted or rec.arrival))
            if fin is not None:
                rec.finished, rec.outcome = now, "ok"
                r = self.owner.pop(rid)
                if self.ledgers is not None:
                    self.ledgers[worker_id].release(r, rid)
                first = rec.first_token
                tokens = min(rec.max_tokens, self.engines[worker_id].core.max_model_len - rec.prompt)
                tpot = (now - first) / (tokens - 1) if tokens > 1 and now > first else 0.0
                self.routers[r].finish(rid, now, tpot)
                self.in_flight[r] -= 1
                self._dirty.add(r)
                self._live -= 1
        eng.pending = None

    def _heartbeat(self, now: float) -> None:
        """Each worker's ledger tells each router what the others hold there."""
        assert self.ledgers is not None
        for wid in self.engines:
            for r, p in enumerate(self.routers):
                t, s = self.ledgers[wid].others(r)
                p.update_worker(wid, now, other_tokens=t, other_seqs=s)
                self._dirty.add(r)
        if self._live or self._arrivals_left:
            self._push(now + self.heartbeat_s, _BEAT, None)

    def _policy_passes(self, now: float) -> None:
        dirty = self._dirty
        while dirty:
            r = dirty.pop()
            p = self.routers[r]
            for a in p.schedule(now):
                rec = self.records[a.job_id]
                if isinstance(a, DispatchJob):
                    if self._worker_admits(r, a, now):
                        rec.dispatched = now
                        self.engines[a.worker_id].core.add(a.job_id, rec.prompt, rec.max_tokens, a.priority)
                elif isinstance(a, (RejectJob, AbortJob)):
                    if isinstance(a, AbortJob):
                        self.engines[a.worker_id].core.abort(a.job_id)
                        if self.ledgers is not None:
                            self.ledgers[a.worker_id].release(r, a.job_id)
                    rec.outcome = a.error.code or str(a.error.status)
                    self.owner.pop(a.job_id, None)
                    self.in_flight[r] -= 1
                    self._live -= 1

    def _worker_admits(self, r: int, a: DispatchJob, now: float) -> bool:
        """The worker's ledger's say (always yes without arbitration); a
        refusal is router.lifecycle.core's ``refused``: the worker's figures, then
        the job queued again."""
        if self.ledgers is None:
            return True
        p = self.routers[r]
        ledger = self.ledgers[a.worker_id]
        if ledger.admit(r, a.job_id, p.cost_of(a.job_id)):
            self.max_overcommit_tokens = max(self.max_overcommit_tokens, ledger.tokens - ledger.budget)
            return True
        self.refused_by_worker += 1
        t, s = ledger.others(r)
        p.update_worker(a.worker_id, now, other_tokens=t, other_seqs=s)
        job = p.entries[a.job_id].job
        p.refused(a.job_id, now)
        p.submit(job, now, requeue=True)
        self._dirty.add(r)
        return False

    def _start_steps(self, now: float) -> None:
        for wid, eng in self.engines.items():
            if not eng.busy and eng.core.has_work:
                res = eng.core.step()
                eng.busy, eng.pending = True, res
                self._push(now + max(res.duration_s, 1e-6), _STEP, wid)

    def _schedule_wakeup(self, now: float) -> None:
        wake = min((t for p in self.routers if (t := p.next_wakeup(now)) is not None and t > now), default=math.inf)
        if wake < self._wake_at:
            self._wake_at = wake
            self._push(wake, _WAKE, None)
