"""The router's end of the engine workers' link: the backend ROUTER socket.

Majordomo / Paranoid Pirate (the ZeroMQ guide): a worker's first message is
Register (READY); both sides heartbeat every ``heartbeat_interval_s`` and a
peer silent for ``heartbeat_liveness`` intervals is dead; Goodbye is an
orderly disconnect either way.  Anything heard from a worker proves it
alive.  A worker we do not know that heartbeats (say, after a router
restart) is told Goodbye, which makes it register again.

This adapter owns the socket, the table of linked workers (identity,
liveness, last engine stats) and its timer; it is the lifecycle's
``WorkerPort`` and tells it of every worker event through ``WorkerEvents``.
A worker leaves through one path, ``_remove``, whatever the reason.

Draining (the worker's Drain on SIGTERM, or an operator's ``drain``): the
worker gets no new work; what it runs may finish until ``drain_timeout_s``,
then moves to other workers (resumed where it streamed output).

One run per job: every Dispatch carries the ``epoch`` of the Register it
was sent under, and a worker drops one stamped with an older registration's
(shared.protocol.Register.epoch).  A worker that timed this router out and
registered again while this router still sent to it would otherwise run a
job this router is about to count lost (on reading that Register) and run
elsewhere.  The epoch is taken when a request is queued, not when the
outbox flushes, so a Register read in between cannot re-stamp it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import zmq

from router.fleet.router_socket import RouterSocket
from router.observe.metrics import RouterMetrics
from router.observe.worker_report import WorkerReport
from shared import protocol as p
from shared.config import RouterConfig, SecurityConfig
from shared.errors import Code, error
from shared.transport import Outbox, SocketPump

log = logging.getLogger("weir.router.workers")

# A tick's heartbeats go out this many a loop turn: a send is 3-9 us here, so
# 1,024 workers' heartbeats in one callback held the loop 3-9 ms (each tick);
# in slices of 128 no turn holds it over ~1 ms, and the last leaves within
# eight turns of the first.
HEARTBEATS_PER_TURN = 128
_HEARTBEAT = p.encoder.encode(p.Heartbeat())  # the same bytes every time: encoded once


class WorkerEvents(Protocol):
    """What the link tells the lifecycle (router.lifecycle.core.RouterCore)."""

    def serves(self, model: str) -> bool: ...

    def worker_joined(self, reg: p.Register) -> None: ...

    def worker_stats(self, worker_id: str, stats: p.WorkerStats, accepting: bool = True) -> None: ...

    def running_on(self, worker_id: str) -> list[str]: ...

    def move(self, job_id: str, why: str) -> None: ...

    def undeliverable(self, job_id: str, err: p.ErrorInfo) -> None: ...

    def worker_left(self, worker_id: str, why: str) -> None: ...

    def on_outputs(self, worker_id: str, deltas: list[p.Delta]) -> None: ...

    def refused(self, worker_id: str, job_ids: list[str], other_tokens: int, other_seqs: int) -> None: ...

    def lost(self, worker_id: str, job_ids: list[str], why: str) -> None: ...

    def prefix_news(self, worker_id: str, msg: p.PrefixEvents | p.PrefixSnapshot) -> bool: ...

    def prefix_seq(self, worker_id: str, seq: int) -> bool: ...


@dataclass(slots=True, eq=False)
class LinkedWorker:
    reg: p.Register
    identity: bytes
    last_seen: float
    missed: int = 0  # heartbeat ticks in a row with nothing heard from it
    stats: p.WorkerStats = field(default_factory=p.WorkerStats)
    drain_deadline: float | None = None  # draining until then (None: accepting work)


class WorkerLink(RouterSocket):
    side = "backend"

    def __init__(
        self,
        cfg: RouterConfig,
        loop: asyncio.AbstractEventLoop,
        pump: SocketPump,
        metrics: RouterMetrics,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        security: SecurityConfig | None = None,
        base_dir: str = "",
    ) -> None:
        super().__init__(cfg, loop, pump, metrics, ctx, security=security, base_dir=base_dir)
        self.clock = clock
        self.workers: dict[str, LinkedWorker] = {}  # by worker id (== DEALER identity)
        self.events: WorkerEvents  # set by serve(), before the socket can deliver anything
        # per (identity, Register.epoch): what goes out stays stamped with the registration it was queued under
        self._outbox: Outbox[tuple[bytes, int], p.GenerateRequest | str] = Outbox(loop, self._flush_to)
        self._last_tick = clock()  # when the heartbeat timer last ran

    def serve(self, events: WorkerEvents) -> None:
        """Bind the backend and start heartbeating; events go to ``events``."""
        self.events = events
        self._bind(self._on_message, self._heartbeat_tick, on_unreachable=self._on_unreachable)

    def close(self) -> None:
        if self.sock is not None:
            for w in list(self.workers.values()):
                self._send(w.identity, p.Goodbye(reason="router shutting down"))
        super().close()

    # ------------------------------------------------------------ WorkerPort

    def dispatch(self, worker_id: str, req: p.GenerateRequest) -> bool:
        w = self.workers.get(worker_id)
        if w is None:
            return False
        self._outbox.put((w.identity, w.reg.epoch), req)
        return True

    def abort(self, worker_id: str, job_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            self._outbox.put((w.identity, w.reg.epoch), job_id)  # a str in the outbox means Abort

    def flush(self) -> None:
        self._outbox.flush()

    # ------------------------------------------------------------ the socket

    def _flush_to(self, dest: tuple[bytes, int], items: list[p.GenerateRequest | str]) -> None:
        # In the order queued: a job moved off a stalled worker onto the same
        # one is Abort(id) then a dispatch of that id (reversed, the worker
        # ignored the dispatch as a duplicate and aborted the job -- seen in
        # CI as an empty 200); a job dispatched then cancelled within one
        # turn must not run after its Abort.  One message per run of a kind.
        start = 0
        for i in range(1, len(items) + 1):
            if i == len(items) or (items[i].__class__ is str) != (items[start].__class__ is str):
                self._send_run(dest, items[start:i])
                start = i

    def _send_run(self, dest: tuple[bytes, int], run: list[p.GenerateRequest | str]) -> None:
        # a run holds one kind (_flush_to): job ids to abort, or requests
        identity, epoch = dest
        if run[0].__class__ is str:
            self._send(identity, p.Abort(request_ids=cast("list[str]", run)))
            return
        reqs = cast("list[p.GenerateRequest]", run)
        try:
            payload = p.encoder.encode(p.Dispatch(requests=reqs, epoch=epoch))
        except (OverflowError, TypeError, ValueError):
            payload = self._without_unencodable(reqs, epoch)
        if self.sock is not None:
            self.pump.send(self.sock, [identity, payload])

    def _without_unencodable(self, reqs: list[p.GenerateRequest], epoch: int) -> bytes:
        """A batch that would not encode: the others go; each culprit ends with
        an error (not lost in a failed flush, with its batch-mates)."""
        ok = []
        for r in reqs:
            try:
                p.encoder.encode(r)
                ok.append(r)
            except (OverflowError, TypeError, ValueError) as e:
                log.error("request %s cannot be encoded for its worker: %s", r.request_id, e)
                self.events.undeliverable(
                    r.request_id,
                    error(Code.INTERNAL, f"The request could not be sent to a worker ({e}); this is a router bug."),
                )
        return p.encoder.encode(p.Dispatch(requests=ok, epoch=epoch))

    def _send(self, identity: bytes, msg: p.RouterToWorker) -> None:
        if self.sock is not None:
            self.pump.send(self.sock, [identity, p.encoder.encode(msg)])

    def _on_message(self, frames: list[bytes]) -> None:
        decoded = self._decode(frames, p.worker_decoder)
        if decoded is None:
            return
        identity, msg = decoded
        now = self.clock()
        worker_id = identity.decode(errors="replace")
        w = self.workers.get(worker_id)
        if msg.__class__ is p.Outputs:
            if w is not None:  # else: outputs of a worker we already declared lost
                w.last_seen = now
                self.events.on_outputs(worker_id, msg.deltas)
        elif isinstance(msg, p.Heartbeat):
            if w is None:
                self._send(identity, p.Goodbye(reason="unknown worker: register again"))
                return
            w.last_seen = now
            if msg.stats is not None:
                w.stats = msg.stats
                self.events.worker_stats(worker_id, msg.stats, accepting=w.drain_deadline is None)
            if msg.prefix_seq >= 0 and self.events.prefix_seq(worker_id, msg.prefix_seq):
                self._send(identity, p.PrefixResync("heartbeat: prefix updates missing"))
        elif msg.__class__ is p.PrefixEvents or msg.__class__ is p.PrefixSnapshot:
            if w is not None:
                w.last_seen = now
                if self.events.prefix_news(worker_id, msg):
                    self._send(identity, p.PrefixResync("prefix events out of order"))
        elif isinstance(msg, p.Drain):
            if w is not None:
                log.info("worker %s is draining (%s)", worker_id, msg.reason)
                self.drain(worker_id)
        elif isinstance(msg, p.Register):
            self._on_register(identity, worker_id, msg, now)
        elif isinstance(msg, p.Goodbye):
            if w is not None:
                log.info("worker %s said goodbye: %s", worker_id, msg.reason)
                self._remove(w, "goodbye")
        elif msg.__class__ is p.Refuse:
            # Other routers hold what this worker has room for (its ledger
            # said so): a placement miss, the jobs queue again.
            if w is not None:
                w.last_seen = now
                self.metrics.child(self.metrics.worker_events, worker_id, "refused_dispatch").inc(len(msg.request_ids))
                self.events.refused(worker_id, msg.request_ids, msg.other_tokens, msg.other_seqs)
        elif msg.__class__ is p.Lost:
            # Its engine died under these (the worker restarts it): resumed
            # elsewhere as a lost worker's.
            if w is not None:
                w.last_seen = now
                log.warning("worker %s lost %d requests (%s)", worker_id, len(msg.request_ids), msg.reason)
                self.metrics.child(self.metrics.worker_events, worker_id, "lost_requests").inc(len(msg.request_ids))
                self.events.lost(worker_id, msg.request_ids, "engine_died")  # (a fixed label: not the peer's text)

    def _on_register(self, identity: bytes, worker_id: str, reg: p.Register, now: float) -> None:
        if reg.worker_id != worker_id:
            log.warning("worker registered as %r over identity %r: dropped", reg.worker_id, worker_id)
            return
        if not self.events.serves(reg.model):
            log.error("worker %s serves unknown model %r: refused", worker_id, reg.model)
            self._send(identity, p.Goodbye(reason=f"unknown model {reg.model!r}"))
            return
        # A known worker registering again restarted: the lifecycle learns
        # it in worker_joined (what it ran there is gone), not as a loss.
        self.workers[worker_id] = LinkedWorker(reg, identity, now)
        self.events.worker_joined(reg)
        self.metrics.child(self.metrics.worker_events, worker_id, "registered").inc()
        log.info(
            "worker %s registered: model=%s pool=%s engine=%s kv=%d tokens (block %d) max_num_seqs=%d gpu=%s",
            worker_id,
            reg.model,
            p.POOL_NAMES[reg.pool],
            reg.engine,
            reg.kv_capacity_tokens,
            reg.block_size,
            reg.max_num_seqs,
            reg.gpu.name if reg.gpu.present else "none",
        )
        self._send(identity, p.Heartbeat())

    def _on_unreachable(self, identity: bytes) -> None:
        w = self.workers.get(identity.decode(errors="replace"))
        if w is not None:
            self._remove(w, "unreachable")

    # ------------------------------------------------------------ operators

    def drain(self, worker_id: str) -> bool:
        """No new work for this worker; what it runs moves at the drain timeout."""
        w = self.workers.get(worker_id)
        if w is None:
            return False
        if w.drain_deadline is None:
            w.drain_deadline = self.clock() + self.cfg.drain_timeout_s
            self.metrics.child(self.metrics.worker_events, worker_id, "draining").inc()
            self.events.worker_stats(worker_id, w.stats, accepting=False)
        return True

    def undrain(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        if w is None:
            return False
        if w.drain_deadline is not None:
            w.drain_deadline = None
            self.events.worker_stats(worker_id, w.stats, accepting=True)
        return True

    # ---- queries (router.observe.views, router.observe.operator_actions)

    def worker_count(self) -> int:
        return len(self.workers)

    def worker_ids(self) -> set[str]:
        return set(self.workers)

    def workers_of(self, model: str) -> list[str]:
        """Ids of the linked workers serving ``model``."""
        return [wid for wid, w in self.workers.items() if w.reg.model == model]

    def report(self, worker_id: str) -> WorkerReport | None:
        w = self.workers.get(worker_id)
        return None if w is None else self._report(worker_id, w, self.clock())

    def reports(self) -> list[WorkerReport]:
        """Every linked worker, in the order they registered."""
        now = self.clock()  # the clock drain deadlines are set on
        return [self._report(wid, w, now) for wid, w in self.workers.items()]

    @staticmethod
    def _report(worker_id: str, w: LinkedWorker, now: float) -> WorkerReport:
        left = None if w.drain_deadline is None else max(0.0, w.drain_deadline - now)
        return WorkerReport(worker_id, w.reg.model, w.reg.engine, w.reg.gpu, w.stats, left)

    def _heartbeat_tick(self) -> None:
        # Liveness counts ticks that heard nothing since the one before
        # (Paranoid Pirate), not seconds: a stall of this loop counts once, and
        # what the worker sent meanwhile is read before the next tick.
        now = self.clock()
        tick, self._last_tick = self._last_tick, now
        liveness = self.cfg.heartbeat_liveness
        if self.sock is not None:
            self.pump.read_now(self.sock)  # read before judging (see SocketPump.read_now)
        due: list[LinkedWorker] = []
        for w in list(self.workers.values()):
            w.missed = 0 if w.last_seen >= tick else w.missed + 1
            if w.missed >= liveness:
                self._remove(w, "heartbeat_timeout")
                continue
            due.append(w)
            if w.drain_deadline is not None and now >= w.drain_deadline:
                for job_id in self.events.running_on(w.reg.worker_id):
                    self.events.move(job_id, "drain_timeout")
        self._heartbeat(due, 0)

    def _heartbeat(self, due: list[LinkedWorker], start: int) -> None:
        """Heartbeats to ``due[start:]``, HEARTBEATS_PER_TURN of them now and
        the rest on later turns (a worker that left meanwhile gets none)."""
        end = start + HEARTBEATS_PER_TURN
        sock, workers = self.sock, self.workers
        if sock is None:
            return  # closed meanwhile
        for w in due[start:end]:
            if workers.get(w.reg.worker_id) is w:
                self.pump.send(sock, [w.identity, _HEARTBEAT])
        if end < len(due):
            self.loop.call_soon(self._heartbeat, due, end)

    def _remove(self, w: LinkedWorker, why: str) -> None:
        """The one way a worker leaves: from the table, then the lifecycle."""
        worker_id = w.reg.worker_id
        if self.workers.get(worker_id) is not w:
            return
        del self.workers[worker_id]
        self.metrics.child(self.metrics.worker_events, worker_id, why).inc()
        log.warning("worker %s lost (%s)", worker_id, why)
        self.events.worker_left(worker_id, why)
