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
a worker lost once resumes are used up -- goes through ``_end``, which
releases (``Policy.finish`` is idempotent), aborts on the worker where the
job still runs, tells the sink once and counts the outcome.  A refusal
before a job was queued is ``rejected``; an end after it is an outcome of
``requests``.

Losing a worker loses no request: one that produced nothing yet is queued
again; one that streamed output is *resumed* -- queued again as a
continuation whose prompt is the original prompt's token ids plus those
generated so far, with ``max_tokens`` reduced by as many and the same
sampling parameters -- and its Deltas are rewritten (cumulative counts,
the original prompt count) so the client sees one uninterrupted stream.
News is taken only from the worker the policy says runs the job, so a lost
or aborted attempt's late output can never interleave with its resumption.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

import msgspec

from router.admission import Identity, Keys, check_shape, resolve_max_tokens
from router.block_hash import SIM, BlockHasher
from router.metrics import RouterMetrics
from router.policy import AbortJob, DispatchJob, Job, Policy, RejectJob, WorkerSpec
from router.prefix_metrics import PrefixMetrics
from router.prompts import ModelPrompts
from router.quota import Hold, Quota
from shared import protocol as p
from shared.config import Config, ModelConfig, WorkerConfig
from shared.errors import Code, error, label

log = logging.getLogger("weir.router")

_DEFAULT_PARAMS = p.SamplingParams()
# Refusals for want of workers or room, which a fallback model may answer instead.
_FALLBACK_ON = frozenset((Code.NO_WORKER, Code.QUEUE_FULL, Code.QUEUE_WAIT_EXCEEDED, Code.QUEUE_DEADLINE))


class PromptTokens(NamedTuple):
    """router.prompts.PromptTokens plus the prompt's block hashes."""

    ids: list[int]  # exact token ids; empty when the model has no tokenizer
    count: int  # len(ids), or the estimate
    hashes: Sequence[int] = ()  # its full blocks as its model's engines hash them (router.block_hash)


def tokenize_hashed(prompts: ModelPrompts, sub: p.Submit, hasher: Optional[BlockHasher]) -> PromptTokens:
    """Tokens, and the prompt's block hashes as its model's engines compute
    them (prefix affinity): in the same place, on the tokenizing thread for
    long prompts, so hashing never stalls the loop either."""
    ids, count = prompts.tokenize(sub)
    if hasher is None:
        return PromptTokens(ids, count)
    if hasher.algo == SIM:  # the simulated engine's blocks: the text it was counted by
        text = sub.prompt if sub.kind == p.RequestKind.COMPLETION else "".join(
            m.role + "\n" + m.content + "\n" for m in sub.messages)
        return PromptTokens(ids, count, hasher.text_hashes(text, count))
    return PromptTokens(ids, count, hasher.hashes(ids) if ids else ())


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
    completion_tokens: int = 0  # over every attempt
    last_news: float = 0.0  # dispatch or latest Delta (the stall watchdog)
    # dispatches no worker's ledger refused (a refusal undoes the latest):
    # above 0, its prompt reached an engine
    kept_dispatches: int = 0
    # What a resume needs: the original prompt and budget, the ids generated.
    prompt_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    max_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    done_before: int = 0  # tokens generated by earlier attempts
    resumes: int = 0
    served_by: str = ""  # the fallback model answering it ("": the one asked for)
    announced: bool = False  # the client was told served_by
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


def _trace(j: "_Job") -> str:
    """The request id of its log lines: the client's or Envoy's (Submit.trace_id), else the job id."""
    return j.sub.trace_id or j.job_id


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
        self.prefix_metrics = PrefixMetrics(self.metrics.registry, self.policy.prefix)
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
        # Models at run time (add_model / remove_model): the workers each added
        # model wants (for the supervisor, deploy/stack.py), and those being removed.
        self.runtime_workers: dict[str, list[WorkerConfig]] = {}
        self.unloading: set[str] = set()
        self._log_requests = cfg.logging.requests
        stall = cfg.router.stall_timeout_s
        self._stall_timer = loop.call_later(stall / 4, self._stall_tick) if stall > 0 else None

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
        if err is None and sub.model in self.unloading:
            err = self._unloading_error(sub.model)
        if err is not None:
            return self._rejected(err, who.klass)
        if sub.user:
            self.metrics.saw_user(who.tenant, sub.user)
        handle = self._next_handle
        self._next_handle += 1
        j = _Job("%x" % handle, sub, sink, who, now)
        prompts = self.prompts[sub.model]
        # (hashed even without affinity: the simulated engine names its cached blocks by them)
        hasher = self.policy.prefix.hasher(sub.model)
        if prompts.inline(sub):
            try:
                tokens = tokenize_hashed(prompts, sub, hasher)
            except ValueError as e:  # router.prompts.BadInput names the field
                return self._rejected(error(Code.BAD_REQUEST, str(e), param=getattr(e, "param", None)),
                                      who.klass)
            err = self._admit(j, tokens, now)
            return handle if err is None else self._rejected(err, who.klass)
        self.jobs[j.job_id] = j  # tokenizing: cancellable like any other job
        fut = self.loop.run_in_executor(self.executor, tokenize_hashed, prompts, sub, hasher)
        fut.add_done_callback(lambda f, job_id=j.job_id: self._tokenized(job_id, f))
        return handle

    def cancel(self, handle: int) -> None:
        """The client went away: abort on the worker and release everything."""
        j = self.jobs.get("%x" % handle)
        if j is not None:
            self._end(j, "cancelled", abort_worker=self.policy.worker_of(j.job_id))

    def token_text(self, model: str):
        """Token id -> text for rendering logprobs (None: unknown model or no tokenizer)."""
        prompts = self.prompts.get(model)
        return prompts.token_text() if prompts is not None else None

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
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ admission

    def _tokenized(self, job_id: str, fut: asyncio.Future) -> None:
        j = self.jobs.get(job_id)
        if j is None or fut.cancelled():
            return  # cancelled while tokenizing
        try:
            tokens = fut.result()
        except ValueError as e:
            return self._end(j, "bad_request", error=error(Code.BAD_REQUEST, str(e),
                                                           param=getattr(e, "param", None)))
        except Exception:
            log.exception("tokenizing request %s (job %s) failed", _trace(j), job_id, extra={"request_id": _trace(j)})
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
            # usage sums the completion tokens of all n choices: reserve for all of them
            n = sub.params.n if sub.params is not None else 1
            got = self.quota.reserve(j.who, tokens.count + max_tokens * n,
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
        job = self._policy_job(j, sub.model, tokens, max_tokens, j.arrival)
        refusal = self.policy.submit(job, now)
        if refusal is not None:
            if sub.allow_fallback and refusal.kind in _FALLBACK_ON:
                if self._fall_back(j, now):
                    return None  # (its budget reservation stands: the job goes on)
            if j.hold is not None:  # never queued: everything goes back
                self.quota.release(j.hold, 0, refund_request=True)
                j.hold = None
            return refusal.render() if j.rl is None else msgspec.structs.replace(refusal.render(), ratelimit=j.rl)
        self._queued(j, job, tokens, max_tokens)
        return None

    @staticmethod
    def _policy_job(j: _Job, model: str, tokens: PromptTokens, max_tokens: int, arrival: float) -> Job:
        sub, who = j.sub, j.who
        return Job(j.job_id, model, who.tenant, who.klass, tokens.count, max_tokens, sub.task_type, arrival,
                   who.weight, sub.params.n if sub.params is not None else 1, tokens.hashes)

    def _queued(self, j: _Job, job: Job, tokens: PromptTokens, max_tokens: int) -> None:
        """``job`` is in the policy's queue: what its worker gets, and the job table's entry."""
        # The client's message is left as it came; the worker gets the resolution.
        params = msgspec.structs.replace(j.sub.params or _DEFAULT_PARAMS, max_tokens=max_tokens)
        j.job = job
        j.request = p.GenerateRequest(j.job_id, tokens.ids, tokens.count, params, trace_id=_trace(j))
        if tokens.hashes and not tokens.ids:  # the simulated engine names its cached blocks by them
            j.request.block_hashes = list(tokens.hashes)
        j.prompt_ids, j.prompt_tokens, j.max_tokens = tokens.ids, tokens.count, max_tokens
        j.mx = self._metrics_for(job.model, j.who.klass)
        self.jobs[j.job_id] = j
        self._schedule_policy()

    def _metrics_for(self, model: str, klass: str) -> _JobMetrics:
        mx = self._job_metrics.get((model, klass))
        if mx is None:
            mx = self._job_metrics[(model, klass)] = _JobMetrics(self.metrics, model, klass)
        return mx

    def _fall_back(self, j: _Job, now: float) -> bool:
        """Queue ``j`` for the first of its model's fallbacks that takes it."""
        for name in self.models_by_name[j.sub.model].fallbacks:  # (never the model itself: config)
            if name == j.served_by or name in self.unloading or name not in self.models_by_name:
                continue  # the one that just refused it; one being (or already) removed at run time
            model = self.models_by_name[name]
            try:
                # (a rare path: inline whatever its length)
                tokens = tokenize_hashed(self.prompts[name], j.sub, self.policy.prefix.hasher(name))
            except ValueError:
                continue
            max_tokens = resolve_max_tokens(j.sub, tokens.count, model.max_model_len)
            if not isinstance(max_tokens, int):
                continue
            job = self._policy_job(j, name, tokens, max_tokens, now)
            if self.policy.submit(job, now) is not None:
                continue
            j.served_by = name
            self._queued(j, job, tokens, max_tokens)
            self.metrics.child(self.metrics.fallbacks, j.sub.model, name).inc()
            return True
        return False

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
        # usage counted, the unused part of its reservation returned: once (a
        # hold taken before a reload that removed every key settles too)
        if self.quota.active or j.hold is not None:
            # (the prompt of the first attempt: a continuation's longer prompt is not charged again)
            self.quota.ended(j.who, j.hold, j.prompt_tokens if j.kept_dispatches else 0, j.completion_tokens,
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
            m.child(m.requests, j.job.model, j.who.klass, outcome).inc()
            if error is None:
                j.mx.e2e.observe(now - j.arrival)
        if self._log_requests:
            self._log_end(j, outcome, error, now)
        if self.policy.has_queued():  # only queued work can use what this freed
            self._schedule_policy()

    def _log_end(self, j: _Job, outcome: str, err: Optional[p.ErrorInfo], now: float) -> None:
        """[logging] requests: one line per request, whatever its end."""
        rid = _trace(j)
        status = 200 if err is None else err.status
        if outcome == "cancelled":
            status = 499  # the client went away (as the HTTP ingress counts it)
        log.info("request %s %s status=%d model=%s class=%s tenant=%s prompt_tokens=%d completion_tokens=%d "
                 "resumes=%d seconds=%.3f", rid, outcome, status, j.served_by or j.sub.model, j.who.klass,
                 j.who.tenant, j.prompt_tokens, j.completion_tokens, j.resumes, now - j.arrival,
                 extra={"request_id": rid, "outcome": outcome, "status": status})

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
                if not (j.sub.allow_fallback and action.error.kind in _FALLBACK_ON and self._fall_back(j, now)):
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
        req.kv_tokens = self.policy.cost_of(j.job_id)  # what the worker's own ledger admits it on
        if not self.workers.dispatch(action.worker_id, req):
            # The policy placed it on a worker the link no longer has: a bug
            # somewhere, but not the client's -- release and queue it again.
            log.error("policy dispatched request %s (job %s) to unlinked worker %s", _trace(j), j.job_id,
                      action.worker_id, extra={"request_id": _trace(j)})
            self.policy.finish(j.job_id, now)
            self._requeue(j, now)
            return
        j.last_news = now
        j.kept_dispatches += 1
        self.metrics.child(self.metrics.queue_wait, j.who.klass, self.policy.pool_of(action.worker_id)).observe(
            now - j.arrival)

    def _requeue(self, j: _Job, now: float) -> None:
        """Queue a job again whose worker went: it waits for a worker of its
        model (even while none is left) up to its queue deadline."""
        if j.job.model in self.unloading:  # no worker of it will come back
            return self._end(j, Code.MODEL_UNLOADING.label, error=self._unloading_error(j.job.model))
        refusal = self.policy.submit(j.job, now, requeue=True)
        if refusal is not None:
            self._end(j, refusal.label, error=refusal.render())
        else:
            self._schedule_policy()

    def _resume(self, j: _Job, why: str, now: float) -> None:
        """Continue a job that streamed output, from where it got, elsewhere."""
        n = j.completion_tokens
        remaining = j.max_tokens - n
        if remaining < 1:  # all of it was generated; only the last word was lost
            self._end(j, "length", deltas=[p.Delta(j.job_id, finish_reason="length",
                                                   prompt_tokens=j.prompt_tokens, completion_tokens=n)])
            return
        sp = j.request.params
        if sp.n > 1 or sp.structured is not None or (j.prompt_ids and len(j.generated) != n):
            # Not continued: n choices interleave in one stream, a grammar's
            # state is not in the tokens, ids missing would not be exact.
            self._end(j, "worker_lost", error=self._lost_error(why))
            return
        job = j.job
        job.prompt_tokens = j.prompt_tokens + n
        job.max_tokens = remaining
        job.arrival = now  # its queue deadline counts from now
        ids = j.prompt_ids + j.generated if j.prompt_ids else []
        params = msgspec.structs.replace(sp, max_tokens=remaining, min_tokens=max(0, sp.min_tokens - n))
        j.request = p.GenerateRequest(j.job_id, ids, job.prompt_tokens, params, trace_id=_trace(j),
                                      block_hashes=j.request.block_hashes)
        j.done_before = n
        j.resumes += 1
        self.metrics.child(self.metrics.resumed, job.model, why).inc()
        log.info("request %s (job %s) resumes after %d tokens (%s), attempt %d", _trace(j), j.job_id, n, why,
                 j.resumes + 1, extra={"request_id": _trace(j)})
        self._requeue(j, now)

    def _lost_error(self, why: str) -> p.ErrorInfo:
        return error(Code.WORKER_LOST, f"The worker serving this request was lost ({why}) and it could "
                     f"not be resumed.", retry_after=self.cfg.router.heartbeat_interval_s)

    def undeliverable(self, job_id: str, err: p.ErrorInfo) -> None:
        """The link could not send a job to its worker: end it, not leave it waiting."""
        j = self.jobs.get(job_id)
        if j is not None:
            self._end(j, label(err), error=err)

    def check_stalls(self) -> list[str]:
        """The hang watchdog: a running job that heard nothing from its worker
        for ``stall_timeout_s`` is taken off it and resumed elsewhere.  (A
        worker silent as a whole is lost by its missed heartbeats first.)"""
        bound = self.cfg.router.stall_timeout_s
        now = self.clock()
        worker_of = self.policy.worker_of
        stalled = [job_id for job_id, j in self.jobs.items()
                   if j.last_news and now - j.last_news > bound and worker_of(job_id) is not None]
        for job_id in stalled:
            j = self.jobs[job_id]
            log.warning("request %s (job %s): nothing from worker %s for %.1f s: moving it", _trace(j), job_id,
                        worker_of(job_id), now - j.last_news, extra={"request_id": _trace(j)})
            self.move(job_id, "stalled")
        return stalled

    def _stall_tick(self) -> None:
        self.check_stalls()
        self._stall_timer = self.loop.call_later(self.cfg.router.stall_timeout_s / 4, self._stall_tick)

    def move(self, job_id: str, why: str) -> None:
        """Take a running job off its worker (stalled, drain timed out) and
        resume it elsewhere."""
        j = self.jobs.get(job_id)
        wid = self.policy.worker_of(job_id)
        if j is None or wid is None:
            return
        self.workers.abort(wid, job_id)
        now = self.clock()
        self.policy.finish(job_id, now)
        self._after_loss([job_id], why, now)
        self.workers.flush()

    # ------------------------------------------------------------ worker events (router.worker_link)

    def serves(self, model: str) -> bool:
        return model in self.models_by_name and model not in self.unloading

    def worker_joined(self, reg: p.Register) -> None:
        now = self.clock()
        lost = self.policy.add_worker(WorkerSpec(
            worker_id=reg.worker_id, model=reg.model, pool=reg.pool,
            capacity_tokens=reg.kv_capacity_tokens, block_size=reg.block_size,
            max_num_seqs=reg.max_num_seqs, max_model_len=reg.max_model_len,
            gpu_total_bytes=reg.gpu.total_bytes if reg.gpu.present else 0,
            step_time_s=reg.step_time_s or None, request_overhead_s=reg.request_overhead_s or None,
            shares_prompt=reg.prefix_caching, prefix_hash=reg.prefix_hash if reg.prefix_caching else "",
            prefix_hash_seed=reg.prefix_hash_seed), now)
        self._after_loss(lost, "reregistered", now)  # a restarted worker runs nothing of before
        self._schedule_policy()

    def worker_stats(self, worker_id: str, stats: p.WorkerStats, accepting: bool = True) -> None:
        """A heartbeat's news; ``accepting`` False: draining, dispatch nothing new there."""
        self.policy.update_worker(worker_id, self.clock(), healthy=accepting,
                                  gpu_used_bytes=stats.gpu_used_bytes or None, gpu=stats.gpu,
                                  other_tokens=stats.other_tokens, other_seqs=stats.other_seqs)
        self._schedule_policy()

    def refused(self, worker_id: str, job_ids: list[str], other_tokens: int, other_seqs: int) -> None:
        """The worker's own ledger refused these dispatches (other routers hold
        its room: README, Scaling out).  Nothing started there: each is
        released and queued again by its arrival, exactly as a lost worker's
        unstarted job; the worker's figures make this router's view of it
        at least as full as the worker, so it is not placed there again until
        something is released."""
        now = self.clock()
        self.policy.update_worker(worker_id, now, healthy=self.policy.is_healthy(worker_id),
                                  other_tokens=other_tokens, other_seqs=other_seqs)
        for job_id in job_ids:
            j = self.jobs.get(job_id)
            if j is None or self.policy.worker_of(job_id) != worker_id:
                continue  # ended or moved meanwhile
            self.policy.refused(job_id, now)
            j.kept_dispatches -= 1  # nothing of it ran there
            self._requeue(j, now)

    def running_on(self, worker_id: str) -> list[str]:
        return self.policy.running_on(worker_id)

    def prefix_news(self, worker_id: str, msg) -> bool:
        """A worker's PrefixEvents / PrefixSnapshot.  True: ask it for a
        snapshot (a gap: until it comes the worker is routed cache-blind)."""
        index = self.policy.prefix
        if msg.__class__ is p.PrefixSnapshot:
            index.snapshot(worker_id, msg.seq, msg.hashes, msg.trusted)
            return False
        if msg.ts:
            self.prefix_metrics.lag.labels(worker_id).observe(max(0.0, time.time() - msg.ts))
        if index.events(worker_id, msg.seq, msg.stored, msg.removed, msg.cleared):
            return False
        self._prefix_recovery(worker_id, "gap")
        return True

    def prefix_seq(self, worker_id: str, seq: int) -> bool:
        """A heartbeat's prefix seq; True: ask for a snapshot."""
        index = self.policy.prefix
        was = index.trusted(worker_id)
        ask = index.heard_seq(worker_id, seq)
        if ask and was:
            self._prefix_recovery(worker_id, "heartbeat seq ahead")
        return ask

    def _prefix_recovery(self, worker_id: str, why: str) -> None:
        log.warning("worker %s: prefix events out of order (%s): cache-blind until its snapshot", worker_id, why)
        self.prefix_metrics.recoveries.labels(worker_id).inc()

    def worker_left(self, worker_id: str, why: str) -> None:
        now = self.clock()
        self._after_loss(self.policy.remove_worker(worker_id, now), why, now)
        self._schedule_policy()
        if self.unloading:
            self._forget_unloaded()

    # ------------------------------------------------------------ models at run time

    def add_model(self, model: ModelConfig, workers: list[WorkerConfig]) -> Optional[str]:
        """Serve a new model (its workers register as the supervisor starts
        them); an error message if it cannot be added."""
        if model.name in self.models_by_name:
            return f"model {model.name!r} already exists" + (" (still unloading)" if model.name in self.unloading
                                                             else "")
        bad = [fb for fb in model.fallbacks if fb not in self.models_by_name or fb in self.unloading]
        if bad:
            return f"model {model.name!r}: fallbacks {bad} are not models served now"
        self.prompts[model.name] = ModelPrompts(self.cfg.resolve(model.path) if model.path else None)
        self.models_by_name[model.name] = model
        self.cfg.models.append(model)
        self.runtime_workers[model.name] = workers
        log.info("model %s added (%s, %d workers to start)", model.name, model.engine, len(workers))
        return None

    def remove_model(self, name: str) -> Optional[str]:
        """Unloading: new requests get 503 model_unloading, queued ones end
        with it now, running ones finish where they run (their workers drain:
        the caller's part); once no worker of it is left, it is forgotten (404)."""
        if name not in self.models_by_name:
            return f"no model {name!r}"
        if name not in self.unloading:
            self.unloading.add(name)
            for j in [j for j in self.jobs.values() if (j.served_by or j.sub.model) == name]:
                if self.policy.worker_of(j.job_id) is None:  # queued or tokenizing: nothing runs yet
                    self._end(j, Code.MODEL_UNLOADING.label, error=self._unloading_error(name))
            log.info("model %s unloading", name)
        self._forget_unloaded()
        return None

    def _unloading_error(self, name: str) -> p.ErrorInfo:
        return error(Code.MODEL_UNLOADING, f"The model `{name}` is being removed; it takes no new requests.",
                     param="model", retry_after=self.cfg.router.heartbeat_interval_s)

    def _forget_unloaded(self) -> None:
        for name in list(self.unloading):
            m = self.policy.models.get(name)
            if (m is None or not m.workers) and not any((j.served_by or j.sub.model) == name
                                                        for j in self.jobs.values()):
                self.unloading.discard(name)
                del self.models_by_name[name]
                self.prompts.pop(name, None)
                self.runtime_workers.pop(name, None)
                self.cfg.models = [x for x in self.cfg.models if x.name != name]
                log.info("model %s removed", name)

    def model_state(self, name: str) -> str:
        """loading (no worker ready yet) / ready / unloading."""
        if name in self.unloading:
            return "unloading"
        m = self.policy.models.get(name)
        return "ready" if m is not None and any(w.healthy for w in m.workers.values()) else "loading"

    def _after_loss(self, job_ids: list[str], why: str, now: float) -> None:
        """Jobs of a lost worker, already released by the policy."""
        for job_id in job_ids:
            j = self.jobs.get(job_id)
            if j is None:
                continue
            if j.completion_tokens == 0:
                self._requeue(j, now)  # nothing streamed yet: nobody can tell it moved
            elif j.resumes < self.cfg.router.max_resumes:
                self._resume(j, why, now)
            else:
                self._end(j, "worker_lost", error=self._lost_error(f"{why}, after {j.resumes} resumes"))

    def on_outputs(self, worker_id: str, deltas: list[p.Delta]) -> None:
        """One worker message: every request's news from one engine step."""
        now = self.clock()
        if len(deltas) == 1:  # the usual message at low load: one request, one step
            self._job_news(worker_id, deltas[0].request_id, deltas, now)
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
            self._job_news(worker_id, job_id, group, now)

    def _job_news(self, worker_id: str, job_id: str, group: list[p.Delta], now: float) -> None:
        """One job's deltas from one worker message, oldest first."""
        j = self.jobs.get(job_id)
        if j is None or self.policy.worker_of(job_id) != worker_id:
            return  # ended (its worker told to abort), moved, or never dispatched there
        j.last_news = now
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
            if not j.done_before:
                j.prompt_tokens = prompt_tokens
        if j.served_by and not j.announced:
            j.announced = True
            group[0].model = j.served_by  # the client learns which model answers, with its first news
        generated = j.generated
        base = j.done_before
        for x in group:
            if x.token_ids:
                generated.extend(x.token_ids)
            if base:  # a continuation: counts as if it had never stopped
                x.completion_tokens += base
                if x.prompt_tokens:
                    x.prompt_tokens = j.prompt_tokens
        if j.rl is not None:  # the client's first news carries its budget figures
            group[0].ratelimit, j.rl = j.rl, None
        if not d.finished:
            j.sink.on_deltas(group)
            return
        if d.prompt_tokens:
            if d.cached_tokens > d.prompt_tokens:  # a continuation's cache covers generated tokens too
                d.cached_tokens = d.prompt_tokens
            pm = self.prefix_metrics
            pm.prompt_tokens.labels(job.model, worker_id).inc(d.prompt_tokens)
            pm.cached_tokens.labels(job.model, worker_id).inc(d.cached_tokens)
        if d.error is not None:
            self._end(j, label(d.error), error=d.error, deltas=group)
        else:
            self._end(j, d.finish_reason, deltas=group)

    # ---- queries for the views
    # What router.views and router.operator read (their Protocols declare it):
    # values and copies, so that nothing outside reaches into the core's state.

    def served_models(self) -> list[ModelConfig]:
        """The models served now (the config file's, then those added at run time)."""
        return list(self.cfg.models)

    def served_config(self) -> Config:
        """The loaded config with the models served now: what an added model is checked against."""
        return self.cfg

    def has_model(self, name: str) -> bool:
        """Served or still unloading (a removed model is forgotten once its workers are gone)."""
        return name in self.models_by_name

    def runtime_workers_of(self, name: str) -> Optional[list[WorkerConfig]]:
        """The workers a model added at run time wants; None for a model of the config file."""
        workers = self.runtime_workers.get(name)
        return None if workers is None else list(workers)

    def runtime_worker_ids(self) -> set[str]:
        return {w.id for ws in self.runtime_workers.values() for w in ws}

    def uptime_s(self) -> float:
        return self.clock() - self.started_at

    def live_jobs(self) -> int:
        return len(self.jobs)

    def scheduler_snapshot(self) -> dict:
        """The policy's workers, queues and counters now (a fresh dict)."""
        return self.policy.snapshot(self.clock())

    def queued_by_model(self) -> dict[tuple[str, str], int]:
        return self.policy.queued_by_model()

    def tenants(self) -> dict:
        """Per-tenant usage, refusals and budgets (keys by their id, never the key)."""
        return self.quota.snapshot()
