"""The request lifecycle: admission, policy passes, dispatch, job news, the one exit.

It owns no socket.  The adapters around it -- ``router.worker_link`` (engine
workers, the backend ROUTER socket), ``router.client_frontend`` (direct
ZeroMQ clients, the frontend ROUTER socket) and ``router.http_server``
(OpenAI HTTP) -- own their sockets and call in; it calls out only through
the ports declared here: a ``WorkerPort`` to reach workers and a
``RequestSink`` per request.  So it runs in-process under test with fakes
(tests/test_lifecycle.py), and ``router/__main__.py`` wires the real ones.

State, each piece with one owner:
  * ``jobs`` here: every live request, from submit to its end;
  * the ``Policy``: queues, the KV ledger, and which job runs on which worker;
  * the worker link: identities, liveness and engine stats of workers.

A job: submit -> (tokenized on a thread, if its prompt is long) -> queued in
the Policy -> dispatched as token ids -> Deltas -> final Delta.  Every end
after submit -- finish, engine error, cancel, refusal while queued, deadline,
worker loss after output streamed -- goes through ``_end``, which releases
(``Policy.finish`` is idempotent), aborts on the worker where the job still
runs, tells the sink once and counts the outcome.  A refusal before a job
was queued is ``rejected``; an end after it is an outcome of ``requests``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import msgspec

from router.admission import Identity, Keys, check_shape, resolve_max_tokens
from router.metrics import RouterMetrics
from router.policy import AbortJob, DispatchJob, Job, Policy, RejectJob, WorkerSpec
from router.prompts import ModelPrompts, PromptTokens
from router.quota import Hold, Quota
from shared import protocol as p
from shared.config import Config
from shared.errors import Code, error, label

log = logging.getLogger("weir.router")

_DEFAULT_PARAMS = p.SamplingParams()


class RequestSink(Protocol):
    def on_deltas(self, deltas: list[p.Delta]) -> None:
        """This request's news since the last call; the last call ends with a
        Delta whose ``finished`` is true, and no call follows it."""


class WorkerPort(Protocol):
    """How the lifecycle reaches engine workers (router.worker_link)."""

    def dispatch(self, worker_id: str, req: p.GenerateRequest) -> bool:
        """Queue ``req`` for the worker; False if no such worker is linked."""

    def abort(self, worker_id: str, job_id: str) -> None: ...

    def flush(self) -> None:
        """Send what is queued now, one message per worker."""


@dataclass(slots=True, eq=False)
class _Job:
    job_id: str
    sub: p.Submit
    sink: RequestSink
    who: Identity
    arrival: float
    job: Optional[Job] = None  # the policy's view: set once tokenized and queued
    request: Optional[p.GenerateRequest] = None  # what its worker gets
    mx: Optional["_JobMetrics"] = None
    first_token_at: float = 0.0
    completion_tokens: int = 0
    dispatched: bool = False  # reached an engine (its prompt was processed)
    hold: Optional[Hold] = None  # its budget reservation (router.quota), returned in _end
    rl: Optional[p.RateLimit] = None  # budget figures for its client's first Delta


class _JobMetrics:
    """The metric children every request of one (model, class) touches,
    looked up once per pair instead of four times per request."""

    __slots__ = ("ttft", "tokens", "e2e")

    def __init__(self, m: RouterMetrics, model: str, klass: str) -> None:
        self.ttft = m.child(m.ttft, model, klass)
        self.tokens = m.child(m.tokens, model)
        self.e2e = m.child(m.e2e, model, klass)


class RouterCore:
    def __init__(self, cfg: Config, loop: asyncio.AbstractEventLoop, workers: WorkerPort, *,
                 metrics: Optional[RouterMetrics] = None, clock: Callable[[], float] = time.monotonic,
                 prompts: Optional[dict[str, ModelPrompts]] = None,
                 executor: Optional[concurrent.futures.Executor] = None) -> None:
        self.cfg = cfg
        self.loop = loop
        self.workers = workers
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.policy = Policy(cfg.scheduler)
        self.keys = Keys(cfg)
        self.quota = Quota(cfg, self.metrics, clock)
        self.models_by_name = {m.name: m for m in cfg.models}
        self.prompts = prompts if prompts is not None else {
            m.name: ModelPrompts(cfg.resolve(m.path) if m.path else None) for m in cfg.models}
        # One thread: long prompts are tokenized in arrival order, with the GIL released.
        self.executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.jobs: dict[str, _Job] = {}
        self._job_metrics: dict[tuple[str, str], _JobMetrics] = {}
        self._next_handle = 1
        self._policy_pending = False
        self._wakeup: Optional[asyncio.TimerHandle] = None
        self._wakeup_at: Optional[float] = None  # when self._wakeup fires (policy clock)
        self.started_at = clock()

    # ------------------------------------------------------------ the frontends' API

    def submit(self, sub: p.Submit, sink: RequestSink) -> int | p.ErrorInfo:
        """Admit a request (its handle) or refuse it now.  Later news, a
        refusal after tokenizing included, reaches ``sink``."""
        now = self.clock()
        who = self.keys.identify(sub)
        if not isinstance(who, Identity):
            return self._rejected(who, self.keys.default_tier)
        err = check_shape(sub)
        if err is None and sub.model not in self.models_by_name:
            err = error(Code.MODEL_NOT_FOUND, f"The model `{sub.model}` does not exist.", param="model")
        if err is not None:
            return self._rejected(err, who.klass)
        handle = self._next_handle
        self._next_handle += 1
        j = _Job("%x" % handle, sub, sink, who, now)
        prompts = self.prompts[sub.model]
        if prompts.inline(sub):
            try:
                tokens = prompts.tokenize(sub)
            except ValueError as e:
                return self._rejected(error(Code.BAD_REQUEST, str(e)), who.klass)
            err = self._admit(j, tokens, now)
            return handle if err is None else self._rejected(err, who.klass)
        self.jobs[j.job_id] = j  # tokenizing: cancellable like any other job
        fut = self.loop.run_in_executor(self.executor, prompts.tokenize, sub)
        fut.add_done_callback(lambda f, job_id=j.job_id: self._tokenized(job_id, f))
        return handle

    def cancel(self, handle: int) -> None:
        """The client went away: abort on the worker and release everything."""
        j = self.jobs.get("%x" % handle)
        if j is not None:
            self._end(j, "cancelled", abort_worker=self.policy.worker_of(j.job_id))

    def awaiting_output(self, handle: int) -> bool:
        """Live and nothing generated yet (queued, tokenizing or prefilling)."""
        j = self.jobs.get("%x" % handle)
        return j is not None and not j.first_token_at

    def reload_keys(self, cfg: Config) -> None:
        """New API keys and budgets (SIGHUP / POST /admin/reload): later
        requests use them; admitted ones settle as they were reserved."""
        self.keys = Keys(cfg)
        self.quota.reload(cfg)
        self.cfg.api_keys, self.cfg.tenants = cfg.api_keys, cfg.tenants

    def close(self) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ admission

    def _tokenized(self, job_id: str, fut: asyncio.Future) -> None:
        j = self.jobs.get(job_id)
        if j is None or fut.cancelled():
            return  # cancelled while tokenizing
        try:
            tokens = fut.result()
        except ValueError as e:
            return self._end(j, "bad_request", error=error(Code.BAD_REQUEST, str(e)))
        except Exception:
            log.exception("tokenizing request %s failed", job_id)
            return self._end(j, "internal", error=error(Code.INTERNAL, "Tokenizing the prompt failed."))
        err = self._admit(j, tokens, self.clock())
        if err is not None:
            self._end(j, label(err), error=err)

    def _admit(self, j: _Job, tokens: PromptTokens, now: float) -> Optional[p.ErrorInfo]:
        """Price the prompt, queue the job in the policy; an error if refused."""
        sub = j.sub
        max_tokens = resolve_max_tokens(sub, tokens.count, self.models_by_name[sub.model].max_model_len)
        if not isinstance(max_tokens, int):
            return max_tokens
        if self.quota.active:
            got = self.quota.reserve(j.who, tokens.count + max_tokens,
                                     lambda got: self._reserved(j, got, tokens, max_tokens))
            if got is None:  # the budget store answers later: _reserved
                self.jobs[j.job_id] = j
                return None
            if not isinstance(got, Hold):
                return got
            j.hold, j.rl = got, got.ratelimit
        return self._enqueue(j, tokens, max_tokens, now)

    def _reserved(self, j: _Job, got, tokens: PromptTokens, max_tokens: int) -> None:
        """The budget store's answer for a job that waited for it."""
        if self.jobs.get(j.job_id) is not j:  # ended meanwhile (cancelled): give it back at once
            if isinstance(got, Hold):
                self.quota.release(got, 0, refund_request=True)
            return
        if not isinstance(got, Hold):
            return self._end(j, label(got), error=got)
        j.hold, j.rl = got, got.ratelimit
        err = self._enqueue(j, tokens, max_tokens, self.clock())
        if err is not None:
            self._end(j, label(err), error=err)

    def _enqueue(self, j: _Job, tokens: PromptTokens, max_tokens: int, now: float) -> Optional[p.ErrorInfo]:
        sub = j.sub
        who = j.who
        job = Job(j.job_id, sub.model, who.tenant, who.klass, tokens.count, max_tokens, sub.task_type,
                  j.arrival, who.weight)
        refusal = self.policy.submit(job, now)
        if refusal is not None:
            if j.hold is not None:  # never queued: everything goes back
                self.quota.release(j.hold, 0, refund_request=True)
                j.hold = None
            return refusal.render() if j.rl is None else msgspec.structs.replace(refusal.render(), ratelimit=j.rl)
        # The client's message is left as it came; the worker gets the resolution.
        params = msgspec.structs.replace(sub.params or _DEFAULT_PARAMS, max_tokens=max_tokens)
        j.job = job
        j.request = p.GenerateRequest(j.job_id, tokens.ids, tokens.count, params)
        mx = self._job_metrics.get((sub.model, who.klass))
        if mx is None:
            mx = self._job_metrics[(sub.model, who.klass)] = _JobMetrics(self.metrics, sub.model, who.klass)
        j.mx = mx
        self.jobs[j.job_id] = j
        self._schedule_policy()
        return None

    def _rejected(self, err: p.ErrorInfo, klass: str) -> p.ErrorInfo:
        self.metrics.child(self.metrics.rejected, klass, "-", label(err)).inc()
        return err

    # ------------------------------------------------------------ the one exit

    def _end(self, j: _Job, outcome: str, *, error: Optional[p.ErrorInfo] = None,
             deltas: Optional[list[p.Delta]] = None, abort_worker: Optional[str] = None) -> None:
        """Every job's end: forget, release, abort where it runs, tell, count."""
        del self.jobs[j.job_id]
        now = self.clock()
        if j.job is not None:
            self.policy.finish(j.job_id, now)  # a no-op where the policy released it already
        if abort_worker is not None:
            self.workers.abort(abort_worker, j.job_id)
        if self.quota.active:  # usage counted, the unused part of its reservation returned: once
            self.quota.ended(j.who, j.hold, j.job.prompt_tokens if j.dispatched else 0, j.completion_tokens,
                             j.job is not None)
            j.hold = None
            if j.rl is not None and error is not None and deltas is None:
                error = msgspec.structs.replace(error, ratelimit=error.ratelimit or j.rl)
        if deltas is not None:
            j.sink.on_deltas(deltas)
        elif error is not None:  # (a cancelled job's client is gone: nobody to tell)
            j.sink.on_deltas([p.Delta(j.job_id, error=error, completion_tokens=j.completion_tokens)])
        m = self.metrics
        if j.job is None:  # refused before it was ever queued (after tokenizing)
            m.child(m.rejected, j.who.klass, "-", outcome).inc()
        else:
            m.child(m.requests, j.sub.model, j.who.klass, outcome).inc()
            if error is None:
                j.mx.e2e.observe(now - j.arrival)
        if self.policy.has_queued():  # only queued work can use what this freed
            self._schedule_policy()

    # ------------------------------------------------------------ the policy

    def _schedule_policy(self) -> None:
        if not self._policy_pending:
            self._policy_pending = True
            self.loop.call_soon(self.run_policy)

    def run_policy(self) -> None:
        """One policy pass; its dispatches leave at its end (one message per worker)."""
        self._policy_pending = False
        now = self.clock()
        for action in self.policy.schedule(now):
            j = self.jobs.get(action.job_id)
            if j is None:
                continue
            if isinstance(action, DispatchJob):
                self._dispatch(j, action, now)
            elif isinstance(action, RejectJob):
                self._end(j, action.error.label, error=action.error.render())
            elif isinstance(action, AbortJob):
                self._end(j, action.error.label, error=action.error.render(), abort_worker=action.worker_id)
        self.workers.flush()
        # A timer that fires early is harmless (the pass re-arms it for the
        # next event), so it is only moved earlier: no cancel/re-arm per request.
        at = self.policy.next_wakeup(now)
        if at is not None and (self._wakeup_at is None or at < self._wakeup_at):
            if self._wakeup is not None:
                self._wakeup.cancel()
            self._wakeup_at = at
            self._wakeup = self.loop.call_later(max(0.0, at - now), self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._wakeup_at = None
        self._schedule_policy()

    def _dispatch(self, j: _Job, action: DispatchJob, now: float) -> None:
        req = j.request
        req.priority = action.priority
        if not self.workers.dispatch(action.worker_id, req):
            # The policy placed it on a worker the link no longer has: a bug
            # somewhere, but not the client's -- release and queue it again.
            log.error("policy dispatched %s to unlinked worker %s", j.job_id, action.worker_id)
            self.policy.finish(j.job_id, now)
            self._requeue(j, now)
            return
        j.dispatched = True
        self.metrics.child(self.metrics.queue_wait, j.who.klass, self.policy.pool_of(action.worker_id)).observe(
            now - j.arrival)

    def _requeue(self, j: _Job, now: float) -> None:
        """Another chance for a job that produced nothing yet (its worker went)."""
        refusal = self.policy.submit(j.job, now)
        if refusal is not None:
            self._end(j, refusal.label, error=refusal.render())
        else:
            self._schedule_policy()

    # ------------------------------------------------------------ worker events (router.worker_link)

    def serves(self, model: str) -> bool:
        return model in self.models_by_name

    def worker_joined(self, reg: p.Register) -> None:
        now = self.clock()
        lost = self.policy.add_worker(WorkerSpec(
            worker_id=reg.worker_id, model=reg.model, pool=reg.pool,
            capacity_tokens=reg.kv_capacity_tokens, block_size=reg.block_size,
            max_num_seqs=reg.max_num_seqs, max_model_len=reg.max_model_len,
            gpu_total_bytes=reg.gpu.total_bytes if reg.gpu.present else 0,
            step_time_s=reg.step_time_s or None, request_overhead_s=reg.request_overhead_s or None), now)
        self._after_loss(lost, "reregistered", now)  # a restarted worker runs nothing of before
        self._schedule_policy()

    def worker_stats(self, worker_id: str, stats: p.WorkerStats) -> None:
        self.policy.update_worker(worker_id, self.clock(), healthy=True,
                                  gpu_used_bytes=stats.gpu_used_bytes or None)
        self._schedule_policy()

    def worker_left(self, worker_id: str, why: str) -> None:
        now = self.clock()
        self._after_loss(self.policy.remove_worker(worker_id, now), why, now)
        self._schedule_policy()

    def _after_loss(self, job_ids: list[str], why: str, now: float) -> None:
        """Jobs of a lost worker, already released by the policy."""
        for job_id in job_ids:
            j = self.jobs.get(job_id)
            if j is None:
                continue
            if j.completion_tokens == 0:
                self._requeue(j, now)  # nothing streamed yet: nobody can tell it moved
            else:
                self._end(j, "worker_lost", error=error(
                    Code.WORKER_LOST, f"The worker serving this request was lost ({why}).",
                    retry_after=self.cfg.router.heartbeat_interval_s))

    def on_outputs(self, deltas: list[p.Delta]) -> None:
        """One worker message: every request's news from one engine step."""
        now = self.clock()
        if len(deltas) == 1:  # the usual message at low load: one request, one step
            self._job_news(deltas[0].request_id, deltas, now)
            return
        # Usually one delta per job per message; a worker that batched several
        # steps sends more: group them so that each sink gets one call.
        by_job: dict[str, list[p.Delta]] = {}
        for d in deltas:
            group = by_job.get(d.request_id)
            if group is None:
                by_job[d.request_id] = [d]
            else:
                group.append(d)
        for job_id, group in by_job.items():
            self._job_news(job_id, group, now)

    def _job_news(self, job_id: str, group: list[p.Delta], now: float) -> None:
        """One job's deltas from one worker message, oldest first."""
        j = self.jobs.get(job_id)
        if j is None or j.job is None:
            return  # ended already (its worker was told to abort), or never dispatched
        d = group[-1]
        if len(group) > 1:
            new_tokens = sum(x.num_tokens for x in group)
            prompt_tokens = max(x.prompt_tokens for x in group)
        else:
            new_tokens, prompt_tokens = d.num_tokens, d.prompt_tokens
        if new_tokens:
            if not j.first_token_at:
                j.first_token_at = now
                j.mx.ttft.observe(now - j.arrival)
            j.completion_tokens += new_tokens
            j.mx.tokens.inc(new_tokens)
        job = j.job
        if prompt_tokens and prompt_tokens != job.prompt_tokens:
            # The router counted the prompt itself; an engine that disagrees
            # (e.g. one that adds tokens) is believed, and the ledger re-priced.
            self.policy.correct_prompt_tokens(job_id, prompt_tokens)
        if j.rl is not None:  # the client's first news carries its budget figures
            group[0].ratelimit, j.rl = j.rl, None
        if not d.finished:
            j.sink.on_deltas(group)
        elif d.error is not None:
            self._end(j, label(d.error), error=d.error, deltas=group)
        else:
            self._end(j, d.finish_reason, deltas=group)
