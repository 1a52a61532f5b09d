"""The request lifecycle: admission, policy passes, dispatch, job news, the one exit.

It owns no socket.  The adapters around it -- ``router.fleet.worker_link`` (engine
workers, the backend ROUTER socket), ``router.ingress.zmq_clients`` (direct
ZeroMQ clients, the frontend ROUTER socket) and ``router.ingress.http_server``
(OpenAI HTTP) -- own their sockets and call in; it calls out only through
its ports (router.lifecycle.ports): a ``WorkerPort`` to reach workers and a
``RequestSink`` per request.  So it runs in-process under test with fakes
(tests/fakes.py), and ``router/__main__.py`` wires the real ones.

State, each piece with one owner:
  * ``jobs`` here: every live request, from submit to its end, each with its
    explicit state (router.lifecycle.jobs: the transitions and the one place they happen);
  * the model registry (router.lifecycle.models): the models served now;
  * the ``Policy``: queues and the KV reservations (router.policy.reservations: what each worker holds);
    ``JobRecord.worker`` is the lifecycle's copy of where a job runs, set and
    cleared only by ``router.lifecycle.jobs.advance`` on the policy's DispatchJob and
    the job's requeue or end (tests/inproc/test_lifecycle.py checks they agree);
  * the worker link: identities, liveness and engine stats of workers.

A job: submit (into the job table, TOKENIZING) -> tokenized, inline or on a
thread if its prompt is long -> (AWAITING_BUDGET while the budget store
answers) -> QUEUED in the Policy -> RUNNING: dispatched as token ids ->
Deltas -> final Delta.  Every end after submit -- finish, engine error,
cancel, refusal while queued, deadline, a worker lost once resumes are used
up -- goes through ``_end``, which releases (``Policy.finish`` is
idempotent), aborts on the worker where the job still runs, tells the sink
once and counts the outcome.  A refusal before a job was queued is
``rejected``; an end after it is an outcome of ``requests``.  A refusal
during ``submit`` itself is its return value, not news to the sink.

Losing a worker loses no request (router.lifecycle.recovery: requeued, or resumed as
a continuation).  News is taken only from the worker the job is RUNNING on,
so a lost or aborted attempt's late output can never interleave with its
resumption.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from router.api.aliases import AliasTable
from router.fleet.prefix_metrics import PrefixMetrics
from router.fleet.prefix_relay import PrefixRelay
from router.lifecycle.intake import FALLBACK_ON, Intake, unloading_error
from router.lifecycle.jobs import ENDED, QUEUED, RUNNING, JobRecord, advance, job_id_of, log_end
from router.lifecycle.models import ModelRegistry, ServedModel
from router.lifecycle.parts import CoreParts
from router.lifecycle.ports import RequestSink, WorkerPort
from router.lifecycle.prompts import ModelPrompts
from router.lifecycle.recovery import Recovery
from router.lifecycle.tokenizer_queue import CALL, TokenizerQueue
from router.observe.metrics import RouterMetrics
from router.observe.phase_metrics import observe as observe_phases
from router.observe.phases import ended as phases_ended
from router.observe.phases import timing as phases_so_far
from router.observe.tracing import RouterTracer
from router.policy import AbortJob, DispatchJob, Policy, RejectJob, WorkerSpec
from router.tenancy.buckets import NO_HOLD, BudgetAnswer
from router.tenancy.budgets import BudgetLedger, Group
from router.tenancy.identity import Identity, Keys
from shared import protocol as p
from shared.config import AdapterConfig, Config, ModelConfig, WorkerConfig
from shared.errors import Code, label

T = TypeVar("T")

log = logging.getLogger("weir.router")


class RouterCore:
    def __init__(
        self,
        cfg: Config,
        loop: asyncio.AbstractEventLoop,
        workers: WorkerPort,
        *,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        prompts: dict[str, ModelPrompts] | None = None,
    ) -> None:
        self._config = cfg  # as loaded: never changed (the models served now are the registry's)
        self._keys_config = cfg  # the API keys and budgets in use (the last reload's)
        self._cfg_view: tuple[int, Config] | None = None
        self.loop = loop
        self.workers = workers
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.policy = Policy(cfg.scheduler)
        self.prefix_metrics = PrefixMetrics(self.metrics, self.policy.prefix)
        self._prefix = PrefixRelay(self.policy.prefix, self.prefix_metrics)
        self.quota = BudgetLedger(cfg, self.metrics, clock)
        self.registry = ModelRegistry(cfg, prompts)
        # Long prompts and /tokenize calls, off the loop with the GIL released:
        # one thread per core, short prompts never behind long ones, fair between
        # tenants, calls bounded and never ahead of a prompt (router.lifecycle.tokenizer_queue).
        r = cfg.router
        self.tokenizer = TokenizerQueue(loop, r.tokenize_queue_per_tenant, r.tokenize_queue_max, r.tokenize_threads)
        self.jobs: dict[str, JobRecord] = {}
        self._policy_pending = False
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at: float | None = None  # when self._wakeup fires (policy clock)
        self.started_at = clock()
        self._log_requests = cfg.logging.requests
        parts = CoreParts(
            self.jobs,
            self.registry,
            self.policy,
            self.quota,
            workers,
            self.metrics,
            cfg.router,
            clock,
            self._end,
            self._schedule_policy,
        )
        self._intake = Intake(parts, Keys(cfg), AliasTable(cfg.aliases), self.tokenizer)
        self._recovery = Recovery(parts)
        self.batch_tenants: Callable[[], dict[str, Any]] | None = None  # set by router.services.batch.service
        self.on_keys_reloaded: list[Callable[[], None]] = []  # told after reload_keys (router.services.batch.service)
        # [tracing]: the spans of sampled requests (router.observe.tracing); None: off
        self.tracer = RouterTracer(cfg.tracing) if cfg.tracing.enabled else None
        self._intake.tracer = self.tracer
        if self.tracer is not None:
            self.metrics.add_text_source(self.tracer)
        stall = cfg.router.stall_timeout_s
        self._stall_timer = loop.call_later(stall / 4, self._stall_tick) if stall > 0 else None

    @property
    def cfg(self) -> Config:
        """The loaded config as this router runs it now: the models served now
        and the keys of the last reload (a new value after either changes)."""
        version = self.registry.version
        if self._cfg_view is None or self._cfg_view[0] != version:
            keys = self._keys_config
            self._cfg_view = (
                version,
                msgspec.structs.replace(
                    self._config, models=self.registry.configs(), api_keys=keys.api_keys, tenants=keys.tenants
                ),
            )
        return self._cfg_view[1]

    # ------------------------------------------------------------ the frontends' API

    def submit(
        self, sub: p.Submit, sink: RequestSink, who: Identity | p.ErrorInfo | None = None, group: Group | None = None
    ) -> int | p.ErrorInfo:
        """Admit a request (its handle) or refuse it now.  Later news, a
        refusal after tokenizing included, reaches ``sink``.  ``who``: an
        identity established already (a batch line runs as its batch's key,
        whose text is never stored: router.services.batch), instead of ``sub.api_key``'s.
        ``group``: one of a fan-out's jobs (router.tenancy.budgets.Group: its request
        units are reserved whole at its first job; the fan-out closes it)."""
        return self._intake.submit(sub, sink, who, group)

    @property
    def keys(self) -> Keys:
        """The API keys in use (the last reload's)."""
        return self._intake.keys

    @property
    def aliases(self) -> AliasTable:
        """[[aliases]] in use (the last reload's)."""
        return self._intake.aliases

    @property
    def draining(self) -> bool:
        """router.lifecycle.drain: set, every new request is refused (503 router_draining)."""
        return self._intake.draining

    @draining.setter
    def draining(self, on: bool) -> None:
        self._intake.draining = on

    def cancel(self, handle: int) -> None:
        """The client went away: abort on the worker and release everything."""
        j = self.jobs.get(job_id_of(handle))
        if j is not None:
            self._end(j, "cancelled", abort_worker=j.worker)

    def token_text(self, model: str) -> Callable[[int], str] | None:
        """Token id -> text for rendering logprobs (None: unknown model or no tokenizer)."""
        served = self.registry.get_or_base(model)  # (an adapter: its base's)
        return served.prompts.token_text() if served is not None else None

    def tool_parser(self, model: str) -> tuple[str | None, bool]:
        """The model's tool-call parser and whether ``auto`` parses calls (its config)."""
        served = self.registry.get_or_base(model)  # (an adapter: its base's)
        if served is None:
            return None, False
        return served.config.tool_call_parser, served.config.enable_auto_tool_choice

    def served_model(self, model: str, key: str = "") -> ServedModel | None:
        """A model's config and tokenizer (/tokenize, echo of token ids); None: unknown.
        An alias: the model a request drawn by ``key`` (its session) is sent to first."""
        chain = self.aliases.resolve(model, key, self.registry.serves)
        if chain:
            model = chain[0]
        return self.registry.get_or_base(model)  # (an adapter: its base's)

    def identify(self, api_key: str | None) -> Identity | p.ErrorInfo:
        """The key check of ``submit`` alone (/tokenize): who it is, or why not."""
        return self.keys.identify(p.Submit(request_id="", model="", api_key=api_key))

    def charge_call(self, who: Identity, on_answer: Callable[[BudgetAnswer], None]) -> BudgetAnswer | None:
        """One request unit of ``who``'s budgets for a call that is not a
        generation (/tokenize): a Hold or a refusal now, or None and ``on_answer`` later."""
        if not self.quota.active:
            return NO_HOLD
        return self.quota.reserve_call(who, on_answer)

    def off_loop(
        self, tenant: str, fn: Callable[..., T], *args: Any, alive: Callable[[], bool] | None = None
    ) -> asyncio.Future[T] | None:
        """``fn(*args)`` on a tokenizer thread (long /tokenize texts), in
        ``tenant``'s turn, never ahead of a prompt; None: too many calls queued."""
        return self.tokenizer.run(CALL, tenant, fn, *args, alive=alive)

    def awaiting_output(self, handle: int) -> bool:
        """Live and nothing generated yet (queued, tokenizing or prefilling)."""
        j = self.jobs.get(job_id_of(handle))
        return j is not None and not j.first_token_at

    # ---- router.lifecycle.drain: what it reads and does

    def drain_view(self, now: float) -> tuple[list[tuple[str, int]], list[tuple[float, int]]]:
        """(job id, max_tokens) of each job with no output yet; (seconds since
        its first token, tokens) of each streaming one."""
        waiting, streaming = [], []
        for j in self.jobs.values():
            if j.completion_tokens == 0:
                waiting.append((j.job_id, j.max_tokens))
            elif j.state is RUNNING:
                streaming.append((now - j.first_token_at, j.completion_tokens))
        return waiting, streaming

    def job_ids(self) -> list[str]:
        return list(self.jobs)

    def end_job(self, job_id: str, err: p.ErrorInfo) -> None:
        """End a live job with ``err`` (a drain's refusal or deadline), aborting it where it runs."""
        j = self.jobs.get(job_id)
        if j is not None:
            self._end(j, label(err), error=err, abort_worker=j.worker)
            self.workers.flush()

    def reload_keys(self, cfg: Config) -> None:
        """New API keys and budgets (SIGHUP / POST /admin/reload): later
        requests use them; admitted ones settle as they were reserved."""
        self._intake.keys = Keys(cfg)
        self._intake.aliases = AliasTable(cfg.aliases)
        self.quota.reload(cfg)
        self._keys_config = cfg
        self._cfg_view = None
        for fn in self.on_keys_reloaded:
            fn()

    def close(self) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        self.tokenizer.shutdown()
        if self.tracer is not None:
            self.tracer.close()

    # ------------------------------------------------------------ the one exit

    def _end(
        self,
        j: JobRecord,
        outcome: str,
        *,
        error: p.ErrorInfo | None = None,
        deltas: list[p.Delta] | None = None,
        abort_worker: str | None = None,
    ) -> None:
        """Every job's end after submit: forget, release, abort where it runs, tell, count."""
        queued = j.state is QUEUED or j.state is RUNNING  # (else refused before it was ever queued)
        advance(j, ENDED)
        del self.jobs[j.job_id]
        now = self.clock()
        if queued:
            # (its TPOT so far judges a TPOT target: router.policy.targets)
            tpot = (now - j.first_token_at) / (j.completion_tokens - 1) if j.completion_tokens > 1 else 0.0
            self.policy.finish(j.job_id, now, tpot)  # a no-op where the policy released it already
        if abort_worker is not None:
            self.workers.abort(abort_worker, j.job_id)
        # usage counted, the unused part of its reservation returned: once (a
        # hold taken before a reload that removed every key settles too)
        if self.quota.active or j.hold is not None:
            # (the prompt of the first attempt: a continuation's longer prompt is not charged again)
            self.quota.ended(j.who, j.hold, j.prompt_tokens if j.kept_dispatches else 0, j.completion_tokens, queued)
            j.hold = None
            if j.rl is not None and error is not None and deltas is None:
                error = msgspec.structs.replace(error, ratelimit=error.ratelimit or j.rl)
        if j.group is not None:
            j.group.left(queued)
        t = phases_ended(j.phases, j.arrival, j.tokenized_at, j.dispatched_at, j.first_token_at, now)
        if deltas is not None:
            deltas[-1].timing = t
            j.sink.on_deltas(deltas)
        elif error is not None:  # (a cancelled job's client is gone: nobody to tell)
            j.sink.on_deltas([p.Delta(j.job_id, error=error, completion_tokens=j.completion_tokens, timing=t)])
        m = self.metrics
        if not queued:
            m.child(m.rejected, j.who.klass, "-", outcome).inc()
        else:
            m.child(m.requests, j.model, j.who.klass, outcome).inc()
            if j.lora is not None:
                m.child(m.adapter_requests, j.lora.name, outcome).inc()
                m.child(m.adapter_tokens, j.lora.name, "prompt").inc(j.prompt_tokens)
                m.child(m.adapter_tokens, j.lora.name, "completion").inc(j.completion_tokens)
            if error is None:
                mx = j.mx
                assert mx is not None  # set once queued
                mx.e2e.observe(now - j.arrival)
                observe_phases(mx.phases, t)
                op = j.sub.kind
                mx.genai.duration[op].observe(now - j.arrival)
                if j.completion_tokens > 1:
                    mx.genai.tpot[op].observe((now - j.first_token_at) / (j.completion_tokens - 1))
        if self._log_requests:
            log_end(j, outcome, error, now, t)
        if j.otel is not None and self.tracer is not None:  # after this turn's replies leave (call_soon: FIFO)
            cached = deltas[-1].cached_tokens if deltas else 0
            self.loop.call_soon(self.tracer.ended, j.otel, j, outcome, error, now, cached)
        if self.policy.has_queued():  # only queued work can use what this freed
            self._schedule_policy()

    # ------------------------------------------------------------ the policy: QUEUED -> RUNNING, and back

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
                if not (j.sub.allow_fallback and action.error.kind in FALLBACK_ON and self._intake.fall_back(j, now)):
                    self._end(j, action.error.label, error=action.error.render())
            elif isinstance(action, AbortJob):
                self._end(j, action.error.label, error=action.error.render(), abort_worker=action.worker_id)
        loads = self.policy.placement.adapters.new_loads
        if loads:  # (per adapter: a load there for each)
            for lora in self.policy.placement.adapters.take_loads():
                self.metrics.child(self.metrics.adapter_loads, self.registry.adapters.name_of(lora)).inc()
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

    def _dispatch(self, j: JobRecord, action: DispatchJob, now: float) -> None:
        req = j.request
        assert req is not None  # set once queued
        req.priority = action.priority
        req.kv_tokens = self.policy.cost_of(j.job_id)  # what the worker's own ledger admits it on
        if j.otel is not None:  # its worker's spans hang under this attempt's dispatch span
            req.trace_context = RouterTracer.dispatched(
                j.otel, now, action.worker_id, self._placement(action.worker_id), j.last_news
            )
        if not self.workers.dispatch(action.worker_id, req):
            # The policy placed it on a worker the link no longer has: a bug
            # somewhere, but not the client's -- release and queue it again.
            log.error(
                "policy dispatched request %s (job %s) to unlinked worker %s",
                j.trace,
                j.job_id,
                action.worker_id,
                extra={"request_id": j.trace},
            )
            self.policy.taken_off(j.job_id, now)
            self._recovery.requeue(j, now)
            return
        advance(j, RUNNING, action.worker_id)
        j.last_news = j.dispatched_at = now
        j.kept_dispatches += 1
        self.metrics.child(self.metrics.queue_wait, j.who.klass, self.policy.pool_of(action.worker_id)).observe(
            now - j.arrival
        )

    def _placement(self, worker_id: str) -> dict[str, Any]:
        """A traced dispatch's placement span: the worker chosen and its load when chosen."""
        w = self.policy.workers.get(worker_id)
        if w is None:
            return {"weir.worker": worker_id}
        sched = self._config.scheduler
        return {
            "weir.worker": worker_id,
            "weir.pool": self.policy.pool_of(worker_id),
            "weir.placement.policy": sched.placement if sched.policy == "weir" else sched.policy,
            "weir.placement.prefix_affinity": sched.prefix_affinity,
            "weir.placement.kv_reserved_tokens": w.reserved,
            "weir.placement.kv_budget_tokens": w.budget,
            "weir.placement.running": len(w.running),
            "weir.placement.slots": w.slots,
        }

    def undeliverable(self, job_id: str, err: p.ErrorInfo) -> None:
        """The link could not send a job to its worker: end it, not leave it waiting."""
        j = self.jobs.get(job_id)
        if j is not None:
            self._end(j, label(err), error=err)

    def _stall_tick(self) -> None:
        self.check_stalls()
        self._stall_timer = self.loop.call_later(self._config.router.stall_timeout_s / 4, self._stall_tick)

    def check_stalls(self) -> list[str]:
        """The hang watchdog (router.lifecycle.recovery): the stalled jobs it moved."""
        return self._recovery.check_stalls()

    def move(self, job_id: str, why: str) -> None:
        """Take a running job off its worker (stalled, drain timed out) and resume it elsewhere."""
        self._recovery.move(job_id, why)

    # ------------------------------------------------------------ worker events (router.fleet.worker_link)

    def serves(self, model: str) -> bool:
        return self.registry.serves(model)

    def worker_joined(self, reg: p.Register) -> None:
        now = self.clock()
        lost = self.policy.add_worker(
            WorkerSpec(
                worker_id=reg.worker_id,
                model=reg.model,
                pool=reg.pool,
                capacity_tokens=reg.kv_capacity_tokens,
                block_size=reg.block_size,
                max_num_seqs=reg.max_num_seqs,
                max_model_len=reg.max_model_len,
                gpu_total_bytes=reg.gpu.total_bytes if reg.gpu.present else 0,
                step_time_s=reg.step_time_s or None,
                request_overhead_s=reg.request_overhead_s or None,
                shares_prompt=reg.prefix_caching,
                prefix_hash=reg.prefix_hash if reg.prefix_caching else "",
                prefix_hash_seed=reg.prefix_hash_seed,
            ),
            now,
        )
        self._recovery.after_loss(lost, "reregistered", now)  # a restarted worker runs nothing of before
        self._schedule_policy()

    def worker_stats(self, worker_id: str, stats: p.WorkerStats, accepting: bool = True) -> None:
        """A heartbeat's news; ``accepting`` False: draining, dispatch nothing new there."""
        self.policy.update_worker(
            worker_id,
            self.clock(),
            healthy=accepting,
            gpu_used_bytes=stats.gpu_used_bytes or None,
            gpu=stats.gpu,
            other_tokens=stats.other_tokens,
            other_seqs=stats.other_seqs,
        )
        evicted = self.policy.placement.adapters.report(worker_id, stats.loras, self.clock())
        for lora in evicted:
            self.metrics.child(self.metrics.adapter_evictions, self.registry.adapters.name_of(lora)).inc()
        self._schedule_policy()

    def refused(self, worker_id: str, job_ids: list[str], other_tokens: int, other_seqs: int) -> None:
        """The worker's own ledger refused these dispatches (other routers hold
        its room: README, Scaling out).  Nothing started there: each is
        released and queued again by its arrival, exactly as a lost worker's
        unstarted job; the worker's figures make this router's view of it
        at least as full as the worker, so it is not placed there again until
        something is released."""
        now = self.clock()
        self.policy.update_worker(
            worker_id, now, healthy=self.policy.is_healthy(worker_id), other_tokens=other_tokens, other_seqs=other_seqs
        )
        for job_id in job_ids:
            j = self.jobs.get(job_id)
            if j is None or j.worker != worker_id:
                continue  # ended or moved meanwhile
            self.policy.refused(job_id, now)
            j.kept_dispatches -= 1  # nothing of it ran there
            self._recovery.requeue(j, now)

    def lost(self, worker_id: str, job_ids: list[str], why: str) -> None:
        """The worker says these stopped there with no end of their own (its
        engine died): each is released and moved on as a lost worker's job
        (router.lifecycle.recovery: queued again, or resumed from what it streamed)."""
        now = self.clock()
        moved = []
        for job_id in job_ids:
            j = self.jobs.get(job_id)
            if j is None or j.worker != worker_id:
                continue  # ended or moved meanwhile: not this worker's to give up
            self.policy.taken_off(job_id, now)
            moved.append(job_id)
        self._recovery.after_loss(moved, why, now)
        self._schedule_policy()

    def running_on(self, worker_id: str) -> list[str]:
        return self.policy.running_on(worker_id)

    def prefix_news(self, worker_id: str, msg: p.PrefixEvents | p.PrefixSnapshot) -> bool:
        """A worker's PrefixEvents / PrefixSnapshot.  True: ask it for a
        snapshot (a gap: until it comes the worker is routed cache-blind)."""
        return self._prefix.news(worker_id, msg)

    def prefix_seq(self, worker_id: str, seq: int) -> bool:
        """A heartbeat's prefix seq; True: ask for a snapshot."""
        return self._prefix.heard_seq(worker_id, seq)

    def worker_left(self, worker_id: str, why: str) -> None:
        now = self.clock()
        self._recovery.after_loss(self.policy.remove_worker(worker_id, now), why, now)
        self._schedule_policy()
        self._forget_unloaded()

    # ------------------------------------------------------------ job news: RUNNING -> ENDED

    def on_outputs(self, worker_id: str, deltas: list[p.Delta]) -> None:
        """One worker message: every request's news from one engine step."""
        now = self.clock()
        self.policy.stepped(worker_id, now)  # (its step clock: router.policy.targets)
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
        if j is None or j.worker != worker_id:
            return  # ended (its worker told to abort), moved, or never dispatched there
        j.last_news = now
        d = group[-1]
        if len(group) > 1:
            new_tokens = sum(x.num_tokens for x in group)
            prompt_tokens = max(x.prompt_tokens for x in group)
        else:
            new_tokens, prompt_tokens = d.num_tokens, d.prompt_tokens
        if new_tokens:
            mx = j.mx
            assert mx is not None  # it runs on worker_id: it was queued
            if not j.first_token_at:
                j.first_token_at = now
                mx.ttft.observe(now - j.arrival)
                mx.genai.ttft[j.sub.kind].observe(now - j.arrival)
                # the phases so far, for the client's first news (HTTP: a stream's server-timing)
                j.phases = group[0].timing = phases_so_far(j.arrival, j.tokenized_at, j.dispatched_at, now)
                self.policy.first_token(job_id, j.model, now - j.arrival)
            j.completion_tokens += new_tokens
            mx.tokens.inc(new_tokens)
        if j.engine_prompt(prompt_tokens):
            # The router counted the prompt itself; an engine that disagrees
            # (e.g. one that adds tokens) is believed, and its KV reservation re-priced.
            self.policy.correct_prompt_tokens(job_id, prompt_tokens)
        j.as_one_stream(group)
        if not d.finished:
            j.sink.on_deltas(group)
            return
        if d.prompt_tokens:
            if d.cached_tokens > d.prompt_tokens:  # a continuation's cache covers generated tokens too
                d.cached_tokens = d.prompt_tokens
            pm = self.prefix_metrics
            pm.prompt_tokens.labels(j.model, worker_id).inc(d.prompt_tokens)
            pm.cached_tokens.labels(j.model, worker_id).inc(d.cached_tokens)
        if d.error is not None:
            self._end(j, label(d.error), error=d.error, deltas=group)
        else:
            assert d.finish_reason is not None  # d.finished, without an error
            self._end(j, d.finish_reason, deltas=group)

    # ------------------------------------------------------------ models at run time (router.lifecycle.models)

    def add_model(self, model: ModelConfig, workers: list[WorkerConfig]) -> str | None:
        """Serve a new model (its workers register as the supervisor starts
        them); an error message if it cannot be added."""
        return self.registry.add(model, workers)

    def remove_model(self, name: str) -> str | None:
        """Unloading: new requests get 503 model_unloading, queued ones end
        with it now, running ones finish where they run (their workers drain:
        the caller's part); once no worker of it is left, it is forgotten (404)."""
        if self.registry.get(name) is None:
            return f"no model {name!r}"
        if self.registry.start_unloading(name):
            for j in [j for j in self.jobs.values() if j.model == name and j.state is not RUNNING]:
                self._end(
                    j, Code.MODEL_UNLOADING.label, error=unloading_error(name, self._config.router.heartbeat_interval_s)
                )
        self._forget_unloaded()
        return None

    def add_adapter(self, adapter: AdapterConfig) -> str | None:
        """Serve a LoRA adapter of a model served now (router.lifecycle.adapters); an error message if not."""
        return self.registry.add_adapter(adapter)

    def remove_adapter(self, name: str) -> str | None:
        """Stop serving an adapter: new requests for it get 404, those admitted finish."""
        return None if self.registry.remove_adapter(name) else f"no adapter {name!r}"

    def lora_models(self) -> list[str]:
        return self.registry.lora_models()

    def _forget_unloaded(self) -> None:
        """Forget each unloading model once no worker and no job of it is left."""
        for name in self.registry.unloading():
            m = self.policy.models.get(name)
            if (m is None or not m.workers) and not any(j.model == name for j in self.jobs.values()):
                self.registry.forget(name)

    def model_state(self, name: str) -> str:
        """loading (no worker ready yet) / ready / unloading."""
        served = self.registry.get(name)
        if served is not None and served.unloading:
            return "unloading"
        m = self.policy.models.get(name)
        return "ready" if m is not None and any(w.healthy for w in m.workers.values()) else "loading"

    # ---- queries for operator actions and the drain (the views read through router.lifecycle.reads)

    def served_config(self) -> Config:
        """The loaded config with the models served now: what an added model is checked against."""
        return self.cfg

    def has_model(self, name: str) -> bool:
        """Served or still unloading (a removed model is forgotten once its workers are gone)."""
        return self.registry.get(name) is not None

    def runtime_worker_ids(self) -> set[str]:
        return {w.id for ws in self.registry.runtime_workers().values() for w in ws}

    def live_jobs(self) -> int:
        return len(self.jobs)
