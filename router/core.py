"""The router's event-loop core: admission front door, worker link, request lifecycle.

Everything here runs on one asyncio loop (uvloop) and owns no policy: the
pure ``Policy`` decides who waits, who runs where and who is refused; this
module feeds it events and carries out its decisions over ZeroMQ.

Request lifecycle (job = one request inside the router):
  submit -> (refused now | queued in Policy) -> DispatchJob -> worker streams
  Deltas -> final Delta -> Policy.finish.   cancel / worker loss / deadlines
  end it early.  Every path ends in exactly one ``_end_job`` call, which is
  the only place that calls ``Policy.finish`` and forgets the job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq

from router.estimate import PromptEstimator
from router.metrics import RouterMetrics
from router.policy import AbortJob, DispatchJob, Job, Policy, RejectJob, WorkerSpec
from shared import protocol as p
from shared.config import Config
from shared.transport import Outbox, SocketPump

log = logging.getLogger("weir.router")

ANONYMOUS_TENANT = "anonymous"
DEFAULT_TIER = "normal"


class RequestSink(Protocol):
    def on_deltas(self, deltas: list[p.Delta]) -> None:
        """This request's news since the last call; the last call ends with a
        Delta whose ``finish_reason`` or ``error`` is set."""


def error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
          param: str | None = None, retry_after: float | None = None) -> p.ErrorInfo:
    return p.ErrorInfo(status=status, message=message, type=type_, code=code, param=param,
                       retry_after=retry_after)


@dataclass(slots=True, eq=False)
class _Job:
    job: Job
    sub: p.Submit
    sink: RequestSink
    mx: "_JobMetrics"
    worker: bytes | None = None  # identity of the worker running it
    dispatched_at: float = 0.0
    first_token_at: float = 0.0
    completion_tokens: int = 0


class _JobMetrics:
    """The metric children every request of one (model, class) touches,
    looked up once per pair instead of four times per request."""

    __slots__ = ("ttft", "tokens", "e2e")

    def __init__(self, m: RouterMetrics, model: str, klass: str) -> None:
        self.ttft = m.child(m.ttft, model, klass)
        self.tokens = m.child(m.tokens, model)
        self.e2e = m.child(m.e2e, model, klass)


@dataclass(slots=True, eq=False)
class _Worker:
    reg: p.Register
    identity: bytes
    last_seen: float
    stats: p.WorkerStats = field(default_factory=p.WorkerStats)
    jobs: set[str] = field(default_factory=set)


_POOL_NAMES = {p.Pool.ANY: "any", p.Pool.SHORT: "short", p.Pool.LONG: "long"}
# Sent to a direct client whose requests have produced nothing yet: a send to a
# peer that has gone fails (ROUTER_MANDATORY), and its requests are cancelled.
_CLIENT_PROBE = p.encoder.encode(p.Outputs(deltas=[]))


class RouterCore:
    def __init__(self, cfg: Config, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.cfg = cfg
        self.loop = loop or asyncio.get_running_loop()
        self.metrics = RouterMetrics()
        self.registry = self.metrics.registry
        self.policy = Policy(cfg.scheduler)
        self.models_by_name = {m.name: m for m in cfg.models}
        self.estimators = {
            m.name: PromptEstimator(cfg.resolve(m.path) if m.path else None) for m in cfg.models
        }
        self.keys = {k.key: k for k in cfg.api_keys}
        self.class_rank = {c.name: i for i, c in enumerate(cfg.scheduler.classes)}
        self.default_tier = DEFAULT_TIER if DEFAULT_TIER in self.class_rank else cfg.scheduler.classes[0].name

        self.jobs: dict[str, _Job] = {}
        self._job_metrics: dict[tuple[str, str], _JobMetrics] = {}
        self.workers: dict[str, _Worker] = {}  # by worker id (== DEALER identity)
        self.clients: dict[bytes, dict[str, int]] = {}  # ZeroMQ client identity -> its request ids -> handle
        self._next_handle = 1
        self._policy_pending = False
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at: float | None = None  # when self._wakeup fires (policy clock)
        self._hb_interval = cfg.router.heartbeat_interval_s

        self.ctx = zmq.Context.instance()
        self.pump = SocketPump(self.loop)
        self.pump.on_unreachable = self._on_unreachable
        self.pump.on_full = self._on_client_full
        self.backend = self._router_socket(cfg.router.backend)
        self.frontend = self._router_socket(cfg.router.frontend)
        self.to_workers = Outbox(self.loop, self._flush_to_worker)
        self.to_clients = Outbox(self.loop, self._flush_to_client)
        self.pump.add(self.backend, self._on_backend)
        self.pump.add(self.frontend, self._on_frontend, drop_when_full=True)
        self.metrics.add_state_collector(self._state_snapshot)
        self._hb_timer = self.loop.call_later(self._hb_interval, self._heartbeat_tick)
        self.started_at = time.monotonic()

    def _router_socket(self, addr: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # tell us when a peer is gone instead of dropping
        s.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting worker reuses its identity
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.bind(addr)
        return s

    # ------------------------------------------------------------ public API

    def submit(self, sub: p.Submit, sink: RequestSink) -> int | p.ErrorInfo:
        """Admit a request or refuse it now. Later news reaches ``sink``."""
        now = time.monotonic()
        tenant, klass, err = self._authorize(sub)
        if err is not None:
            return self._refused(err, klass or self.default_tier, "auth")
        model = self.models_by_name.get(sub.model)
        if model is None:
            return self._refused(
                error(404, f"The model `{sub.model}` does not exist.", "invalid_request_error",
                      "model_not_found", "model"), klass, "unknown_model")
        prompt_tokens = self.estimators[sub.model].count(sub)
        max_len = model.max_model_len
        max_tokens = sub.max_tokens
        if max_tokens is None:
            asked = sub.params.max_tokens if sub.params is not None else 0
            max_tokens = asked if asked > 0 else max_len - prompt_tokens
        if max_tokens < 1 or prompt_tokens + max_tokens > max_len:
            return self._refused(error(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_tokens + max(max_tokens, 1)} tokens ({prompt_tokens} in the prompt, "
                f"{max(max_tokens, 1)} in the completion). Please reduce the length of the prompt "
                f"or completion.", code="context_length_exceeded", param="max_tokens"),
                klass, "context_length")
        handle = self._next_handle
        self._next_handle += 1
        job_id = "%x" % handle
        params = sub.params or p.SamplingParams(max_tokens=max_tokens)
        params.max_tokens = max_tokens
        sub.params = params
        key = self.keys.get(sub.api_key) if sub.api_key else None
        # positional: (job_id, model, tenant, klass, prompt_tokens, max_tokens, task_type, arrival, weight)
        job = Job(job_id, sub.model, tenant, klass, prompt_tokens, max_tokens, sub.task_type, now,
                  key.weight if key else 1.0)
        refusal = self.policy.submit(job, now)
        if refusal is not None:
            return self._refused(refusal, klass, _reason(refusal))
        mx = self._job_metrics.get((sub.model, klass))
        if mx is None:
            mx = self._job_metrics[(sub.model, klass)] = _JobMetrics(self.metrics, sub.model, klass)
        self.jobs[job_id] = _Job(job, sub, sink, mx)
        self._schedule_policy()
        return handle

    def cancel(self, handle: int) -> None:
        """The client went away: abort on the worker and release everything."""
        job_id = format(handle, "x")
        j = self.jobs.get(job_id)
        if j is not None:
            self._end_job(j, outcome="cancelled", abort_on_worker=True, notify=None)

    def models(self) -> list[tuple[str, int]]:
        return [(m.name, m.max_model_len) for m in self.cfg.models]

    def health(self) -> dict:
        return {
            "status": "ok",
            "workers": sum(1 for w in self.workers.values()),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "jobs": len(self.jobs),
        }

    def admin_workers(self) -> list[dict]:
        return self._state_snapshot()["workers"]

    def admin_queues(self) -> list[dict]:
        return self.policy.snapshot(time.monotonic())["queues"]

    def metrics_payload(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        for w in list(self.workers.values()):
            self._send_worker(w.identity, p.Goodbye(reason="router shutting down"))
        self._hb_timer.cancel()
        if self._wakeup:
            self._wakeup.cancel()
        self.pump.remove(self.backend)
        self.pump.remove(self.frontend)
        self.backend.close(linger=200)
        self.frontend.close(linger=200)

    # ------------------------------------------------------------ admission helpers

    def _authorize(self, sub: p.Submit) -> tuple[str, str, p.ErrorInfo | None]:
        if self.keys:
            key = self.keys.get(sub.api_key or "")
            if key is None:
                return "", "", error(401, "Incorrect API key provided.", "authentication_error",
                                     "invalid_api_key")
            tenant, tier = key.tenant, key.tier
        else:
            tenant, tier = ANONYMOUS_TENANT, self.default_tier
        klass = tier
        if sub.priority is not None:
            rank = self.class_rank.get(sub.priority)
            if rank is None:
                return tenant, tier, error(
                    400, f"Unknown priority {sub.priority!r}; one of "
                         f"{', '.join(self.class_rank)}.", param="priority")
            # A client may lower its own priority, never raise it above its key's tier.
            if rank > self.class_rank[tier]:
                klass = sub.priority
        return tenant, klass, None

    def _refused(self, err: p.ErrorInfo, klass: str, reason: str) -> p.ErrorInfo:
        self.metrics.child(self.metrics.rejected, klass or "-", "-", reason).inc()
        return err

    # ------------------------------------------------------------ policy

    def _schedule_policy(self) -> None:
        if not self._policy_pending:
            self._policy_pending = True
            self.loop.call_soon(self._run_policy)

    def _schedule_policy_if_queued(self) -> None:
        """After a job ended: only queued work can use what it freed (expiries
        of running jobs are on the wake-up timer), so skip a pointless pass."""
        if self.policy.has_queued():
            self._schedule_policy()

    def _run_policy(self) -> None:
        self._policy_pending = False
        now = time.monotonic()
        for action in self.policy.schedule(now):
            j = self.jobs.get(action.job_id)
            if j is None:
                continue
            if isinstance(action, DispatchJob):
                self._dispatch(j, action, now)
            elif isinstance(action, RejectJob):
                self._end_job(j, outcome=_reason(action.error), abort_on_worker=False,
                              notify=action.error, released=True)
            elif isinstance(action, AbortJob):
                self._end_job(j, outcome="generation_deadline", abort_on_worker=True,
                              notify=action.error, released=True)
        # Dispatches leave now rather than one loop turn later (still one
        # message per worker: everything this pass decided is in the outbox).
        self.to_workers.flush()
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
        w = self.workers.get(action.worker_id)
        if w is None:  # policy and router disagree: treat as lost, requeue
            log.error("policy dispatched %s to unknown worker %s", j.job.job_id, action.worker_id)
            self.policy.finish(j.job.job_id, now)
            self._requeue(j, now)
            return
        j.worker = w.identity
        j.dispatched_at = now
        w.jobs.add(j.job.job_id)
        sub = j.sub
        self.to_workers.put(w.identity, p.GenerateRequest(
            request_id=j.job.job_id, kind=sub.kind, prompt=sub.prompt, messages=sub.messages,
            params=sub.params, priority=action.priority))
        self.metrics.child(self.metrics.queue_wait, j.job.klass, _POOL_NAMES[w.reg.pool]).observe(
            now - j.job.arrival)

    def _requeue(self, j: _Job, now: float) -> None:
        """Give a job that produced nothing yet another chance (worker lost)."""
        j.worker = None
        refusal = self.policy.submit(j.job, now)
        if refusal is not None:
            self._end_job(j, outcome=_reason(refusal), abort_on_worker=False, notify=refusal,
                          released=True)
        else:
            self._schedule_policy()

    def _end_job(self, j: _Job, *, outcome: str, abort_on_worker: bool,
                 notify: p.ErrorInfo | None, released: bool = False) -> None:
        """The single exit of every job: release, abort, tell the client, count."""
        job_id = j.job.job_id
        del self.jobs[job_id]
        if not released:
            self.policy.finish(job_id, time.monotonic())
        if j.worker is not None:
            w = self.workers.get(j.worker.decode())
            if w is not None:
                w.jobs.discard(job_id)
                if abort_on_worker:
                    self.to_workers.put(w.identity, job_id)  # a str in the outbox means Abort
        if notify is not None:
            j.sink.on_deltas([p.Delta(request_id=job_id, error=notify,
                                      completion_tokens=j.completion_tokens)])
        self.metrics.child(self.metrics.requests, j.job.model, j.job.klass, outcome).inc()
        self._schedule_policy_if_queued()

    # ------------------------------------------------------------ worker link

    def _flush_to_worker(self, identity: bytes, items: list) -> None:
        reqs, aborts = [], []
        for i in items:
            (aborts if i.__class__ is str else reqs).append(i)
        if reqs:
            self._send_worker(identity, p.Dispatch(requests=reqs))
        if aborts:
            self._send_worker(identity, p.Abort(request_ids=aborts))

    def _send_worker(self, identity: bytes, msg) -> None:
        self.pump.send(self.backend, [identity, p.encoder.encode(msg)])

    def _decode(self, frames: list[bytes], decoder: msgspec.msgpack.Decoder, side: str):
        """(identity, message) of a ROUTER socket's [identity, payload], or None:
        malformed input is counted, logged and dropped, never raised."""
        if len(frames) != 2:
            self.metrics.child(self.metrics.bad_frames, side).inc()
            log.warning("%s: dropped message with %d frames", side, len(frames))
            return None
        identity, payload = frames
        try:
            return identity, decoder.decode(payload)
        except msgspec.DecodeError as e:
            self.metrics.child(self.metrics.bad_frames, side).inc()
            log.warning("%s: dropped undecodable message from %r: %s", side, bytes(identity[:32]), e)
            return None

    def _on_backend(self, frames: list[bytes]) -> None:
        decoded = self._decode(frames, p.worker_decoder, "backend")
        if decoded is None:
            return
        identity, msg = decoded
        now = time.monotonic()
        worker_id = identity.decode(errors="replace")
        w = self.workers.get(worker_id)
        if isinstance(msg, p.Outputs):
            if w is None:
                return  # outputs of a worker we already declared lost
            w.last_seen = now
            self._on_outputs(msg.deltas, now)
        elif isinstance(msg, p.Heartbeat):
            if w is None:
                # A worker we forgot (e.g. router restart): make it register again.
                self._send_worker(identity, p.Goodbye(reason="unknown worker: register again"))
                return
            w.last_seen = now
            if msg.stats is not None:
                w.stats = msg.stats
                self.policy.update_worker(worker_id, now, healthy=True,
                                          gpu_used_bytes=msg.stats.gpu_used_bytes or None)
                self._schedule_policy()
        elif isinstance(msg, p.Register):
            self._on_register(identity, msg, now)
        elif isinstance(msg, p.Goodbye):
            if w is not None:
                log.info("worker %s said goodbye: %s", worker_id, msg.reason)
                self._lose_worker(w, "goodbye")

    def _on_register(self, identity: bytes, reg: p.Register, now: float) -> None:
        worker_id = identity.decode(errors="replace")
        if reg.worker_id != worker_id:
            log.warning("worker registered as %r over identity %r: dropped", reg.worker_id, worker_id)
            return
        if reg.model not in self.models_by_name:
            log.error("worker %s serves unknown model %r: ignored", worker_id, reg.model)
            self._send_worker(identity, p.Goodbye(reason=f"unknown model {reg.model!r}"))
            return
        old = self.workers.get(worker_id)
        if old is not None:  # restarted worker: what it ran is gone
            self._lose_worker(old, "reregistered")
        self.workers[worker_id] = _Worker(reg=reg, identity=identity, last_seen=now)
        self.policy.add_worker(WorkerSpec(
            worker_id=worker_id, model=reg.model, pool=reg.pool,
            capacity_tokens=reg.kv_capacity_tokens, block_size=reg.block_size,
            max_num_seqs=reg.max_num_seqs, max_model_len=reg.max_model_len,
            gpu_total_bytes=reg.gpu.total_bytes if reg.gpu.present else 0), now)
        self.metrics.child(self.metrics.worker_events, worker_id, "registered").inc()
        log.info("worker %s registered: model=%s pool=%s engine=%s kv=%d tokens (block %d) "
                 "max_num_seqs=%d gpu=%s", worker_id, reg.model, _POOL_NAMES[reg.pool], reg.engine,
                 reg.kv_capacity_tokens, reg.block_size, reg.max_num_seqs,
                 reg.gpu.name if reg.gpu.present else "none")
        self._send_worker(identity, p.Heartbeat())
        self._schedule_policy()

    def _on_outputs(self, deltas: list[p.Delta], now: float) -> None:
        if len(deltas) == 1:  # the usual message at low load: one request, one engine step
            self._job_news(deltas[0].request_id, deltas, now)
            return
        # Usually one delta per job per message (one per engine step); a worker that
        # batched several steps sends more: group them so each sink gets one call.
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
        if j is None:
            return  # cancelled or already ended; the worker has been told to abort
        job = j.job
        m = self.metrics
        d = group[-1]
        if len(group) > 1:
            new_tokens = sum(x.num_tokens for x in group)
            prompt_tokens = max(x.prompt_tokens for x in group)
        else:
            new_tokens, prompt_tokens = d.num_tokens, d.prompt_tokens
        if new_tokens:
            if not j.first_token_at:
                j.first_token_at = now
                j.mx.ttft.observe(now - job.arrival)
            j.completion_tokens += new_tokens
            j.mx.tokens.inc(new_tokens)
        if prompt_tokens and prompt_tokens != job.prompt_tokens:
            self.policy.correct_prompt_tokens(job_id, prompt_tokens)
            job.prompt_tokens = prompt_tokens
        if d.error is None and d.finish_reason is None:
            j.sink.on_deltas(group)
            return
        del self.jobs[job_id]
        self.policy.finish(job_id, now)
        w = self.workers.get(j.worker.decode()) if j.worker else None
        if w is not None:
            w.jobs.discard(job_id)
        j.sink.on_deltas(group)
        outcome = d.finish_reason or _reason(d.error)
        m.child(m.requests, job.model, job.klass, outcome).inc()
        j.mx.e2e.observe(now - job.arrival)
        self._schedule_policy_if_queued()

    def _lose_worker(self, w: _Worker, why: str) -> None:
        worker_id = w.reg.worker_id
        if self.workers.get(worker_id) is w:
            del self.workers[worker_id]
        now = time.monotonic()
        released = set(self.policy.remove_worker(worker_id, now))
        self.metrics.child(self.metrics.worker_events, worker_id, why).inc()
        log.warning("worker %s lost (%s): %d requests in flight", worker_id, why, len(w.jobs))
        for job_id in list(w.jobs):
            j = self.jobs.get(job_id)
            if j is None:
                continue
            if job_id not in released:
                self.policy.finish(job_id, now)
            if j.completion_tokens == 0:
                self._requeue(j, now)  # nothing streamed yet: nobody can tell it moved
            else:
                j.worker = None
                self._end_job(j, outcome="worker_lost", abort_on_worker=False, released=True,
                              notify=error(503, f"The worker serving this request was lost ({why}).",
                                           "server_error", "worker_lost",
                                           retry_after=self._hb_interval))
        self._schedule_policy()

    def _heartbeat_tick(self) -> None:
        now = time.monotonic()
        deadline = self._hb_interval * self.cfg.router.heartbeat_liveness
        for w in list(self.workers.values()):
            if now - w.last_seen > deadline:
                self._lose_worker(w, "heartbeat_timeout")
            else:
                self._send_worker(w.identity, p.Heartbeat())
        self._probe_waiting_clients()
        self._hb_timer = self.loop.call_later(self._hb_interval, self._heartbeat_tick)

    def _probe_waiting_clients(self) -> None:
        """A direct client hears nothing while its requests queue or prefill, so
        one that died meanwhile (no Cancel) would keep its place and, later, a
        worker busy: once per heartbeat, probe each such client.  Clients with
        output flowing need no probe: that output finds out."""
        jobs = self.jobs
        for identity, live in list(self.clients.items()):
            for handle in live.values():
                j = jobs.get(format(handle, "x"))
                if j is not None and not j.first_token_at:
                    self.pump.send(self.frontend, [identity, _CLIENT_PROBE])
                    break

    def _on_client_full(self, sock: zmq.Socket, identity: bytes) -> None:
        # SNDHWM messages unread: the client has stopped reading.  Holding its
        # output would hold every other direct client's behind it; end its work.
        if identity in self.clients:
            log.warning("client %r stopped reading (send queue full): cancelling its requests", identity[:16])
            self._lose_client(identity)

    def _on_unreachable(self, sock: zmq.Socket, identity: bytes) -> None:
        if sock is self.frontend:
            self._lose_client(identity)
        else:
            w = self.workers.get(identity.decode(errors="replace"))
            if w is not None:
                self._lose_worker(w, "unreachable")

    # ------------------------------------------------------------ direct ZeroMQ clients

    def _on_frontend(self, frames: list[bytes]) -> None:
        decoded = self._decode(frames, p.client_decoder, "frontend")
        if decoded is None:
            return
        identity, msg = decoded
        identity = bytes(identity)
        if isinstance(msg, p.Submit):
            self._client_submit(identity, msg)
        elif isinstance(msg, p.Cancel):
            live = self.clients.get(identity, {})
            for rid in msg.request_ids:
                handle = live.pop(rid, None)
                if handle is not None:
                    self.cancel(handle)

    def _client_submit(self, identity: bytes, sub: p.Submit) -> None:
        live = self.clients.setdefault(identity, {})
        client_rid = sub.request_id
        if client_rid in live:
            self.to_clients.put(identity, p.Delta(request_id=client_rid, error=error(
                400, f"request_id {client_rid!r} is already in flight", param="request_id")))
            return
        err = _validate_submit(sub)
        if err is None:
            result = self.submit(sub, _ZmqSink(self, identity, client_rid))
            if isinstance(result, int):
                live[client_rid] = result
                return
            err = result
        self.to_clients.put(identity, p.Delta(request_id=client_rid, error=err))

    def _flush_to_client(self, identity: bytes, deltas: list[p.Delta]) -> None:
        self.pump.send(self.frontend, [identity, p.encoder.encode(p.Outputs(deltas=deltas))])

    def _lose_client(self, identity: bytes) -> None:
        live = self.clients.pop(identity, {})
        if live:
            log.info("client %r gone: cancelling %d requests", identity[:16], len(live))
        for handle in live.values():
            self.cancel(handle)

    # ------------------------------------------------------------ views

    def _state_snapshot(self) -> dict:
        snap = self.policy.snapshot(time.monotonic())
        for w in snap["workers"]:
            live = self.workers.get(w["id"])
            if live is not None:
                s = live.stats
                w.update(engine=live.reg.engine, engine_running=s.running, engine_waiting=s.waiting,
                         kv_usage=s.kv_usage, preemptions=s.preemptions_total,
                         aborts=s.aborts_total, finished=s.finished_total,
                         gpu_used_bytes=s.gpu_used_bytes, gpu_total_bytes=s.gpu_total_bytes,
                         gpu=live.reg.gpu.name if live.reg.gpu.present else None)
        return snap


class _ZmqSink:
    """Delivers a job's deltas to a direct ZeroMQ client under the client's own id."""

    __slots__ = ("core", "identity", "client_rid")

    def __init__(self, core: RouterCore, identity: bytes, client_rid: str) -> None:
        self.core, self.identity, self.client_rid = core, identity, client_rid

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        put = self.core.to_clients.put
        for d in deltas:
            d.request_id = self.client_rid
            put(self.identity, d)
        last = deltas[-1]
        if last.finish_reason is not None or last.error is not None:
            live = self.core.clients.get(self.identity)
            if live is not None:
                live.pop(self.client_rid, None)
                if not live:
                    del self.core.clients[self.identity]


def _validate_submit(sub: p.Submit) -> p.ErrorInfo | None:
    """The checks HTTP gets from openai_api's request schema, for ZeroMQ clients."""
    if sub.kind == p.RequestKind.CHAT and not sub.messages:
        return error(400, "messages must be a non-empty list", param="messages")
    if sub.kind == p.RequestKind.COMPLETION and not sub.prompt:
        return error(400, "prompt must be a non-empty string", param="prompt")
    if sub.max_tokens is not None and sub.max_tokens < 1:
        return error(400, "max_tokens must be at least 1", param="max_tokens")
    sp = sub.params
    if sp is not None:
        if not 0.0 <= sp.temperature <= 2.0:
            return error(400, "temperature must be between 0 and 2", param="temperature")
        if not 0.0 < sp.top_p <= 1.0:
            return error(400, "top_p must be in (0, 1]", param="top_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(sp, name) <= 2.0:
                return error(400, f"{name} must be between -2 and 2", param=name)
    return None


def _reason(err: p.ErrorInfo) -> str:
    return err.code or str(err.status)


def retry_after_header(err: p.ErrorInfo) -> str | None:
    return None if err.retry_after is None else str(max(1, math.ceil(err.retry_after)))
