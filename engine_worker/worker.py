"""The engine worker process: one engine, one DEALER link to the router.

Link protocol (Paranoid Pirate, after the ZeroMQ guide): after the engine is up
and has run its warm-up generation (engine_worker/warmup.py; ``warmup``) the
worker sends Register, then a Heartbeat with its stats every interval.
Anything heard from the router proves it alive; if nothing is heard for
``heartbeat_liveness`` intervals the worker assumes the router lost it: it
silently aborts everything live in its engine (the router has written those
requests off), opens a new socket after an exponential back-off and
registers again.  The engine's table (engine_worker.base) is the process's
only record of live requests.

Stopping: SIGTERM drains -- the worker tells the router (Drain), which sends
it nothing new; it finishes what it runs within the router's
``drain_timeout_s``, then says Goodbye and exits 0 (what was still running
resumes on another worker).  SIGINT stops at once.

One run per job: every Register carries a new random ``epoch`` and the router
stamps each Dispatch with the epoch it was queued under; a Dispatch of a
registration the link has replaced (sent before the router read the new
Register, whose jobs it then counts lost and runs elsewhere) is dropped.

The engine dying under the process (vLLM's EngineCore exited: ``on_died``):
the worker says Drain to every router, reports each one's requests Lost (they
resume elsewhere as a lost worker's), starts the engine again and registers
anew on every link; after ENGINE_RESTARTS_MAX deaths it exits non-zero for
its supervisor instead.

Output batching: engines emit Deltas one at a time; they go through an Outbox
that flushes once per event-loop turn, so one engine step becomes one Outputs
message per router, whatever the number of requests in it.

Several routers (README: Scaling out): the worker keeps one link -- its own
DEALER socket, liveness and back-off -- per router address
(``Config.worker_backends``) and registers with each.  Router ids are
unique per router only, so the engine knows a request as ``"<link>:<id>"``.
Every dispatch passes the worker's own ledger (engine_worker.ledger) first:
one that would exceed its KV budget or sequence slots with what all routers
hold here is refused at once (``Refuse``) and that router queues it again.
Losing one router (silent, Goodbye) stops only that router's requests.

A router address given by DNS name (Kubernetes' headless Service) stands for
every router behind it: engine_worker.discovery resolves it every
``discovery_interval_s`` and when a link is lost, links each address that
appears and unlinks one that disappears (``_remove_link``, the one removal
path) once that router holds nothing here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import signal
from typing import TYPE_CHECKING

import msgspec
import zmq

from shared.config import Config, WorkerConfig
from shared.gc_tuning import freeze_startup_heap
from shared.protocol import (
    Abort,
    Delta,
    Dispatch,
    Drain,
    GenerateRequest,
    Goodbye,
    GpuInfo,
    Heartbeat,
    Lost,
    Outputs,
    Pool,
    PrefixEvents,
    PrefixResync,
    PrefixSnapshot,
    Refuse,
    Register,
    WorkerStats,
    WorkerToRouter,
    encoder,
    to_worker_decoder,
)
from shared.transport import Outbox, SocketPump

from .base import Emit, EngineBase, EngineInfo
from .discovery import RouterDiscovery, parse
from .gpu import read_gpu
from .ledger import Ledger, kv_tokens_of
from .prefix_feed import PrefixFeed
from .tracing import WorkerTracer
from .warmup import WarmupFailed, warm_up

if TYPE_CHECKING:
    from .vllm_events import VllmKvEvents

log = logging.getLogger("engine_worker")

RECONNECT_BACKOFF_INITIAL_S = 0.25
RECONNECT_BACKOFF_MAX_S = 5.0
GOODBYE_LINGER_MS = 1000  # time the last Goodbye gets to leave before the socket closes
# EngineCore deaths this process restarts its engine after; one more and it
# exits non-zero (its supervisor's back-off then paces an engine that keeps dying).
ENGINE_RESTARTS_MAX = 3

_POOLS = {"any": Pool.ANY, "short": Pool.SHORT, "long": Pool.LONG}


def make_engine(cfg: Config, wcfg: WorkerConfig) -> EngineBase:
    model = cfg.model(wcfg.model)
    max_model_len = wcfg.max_model_len or model.max_model_len
    if model.engine == "sim":
        from .sim_engine import SimEngine

        return SimEngine(wcfg.sim, wcfg.max_num_seqs, max_model_len, embeds=model.task == "embed")
    from .vllm_engine import VllmEngine  # imports vLLM: seconds

    assert model.path is not None, "config validation: a vllm model has a path"
    engine_class = VllmEngine
    if model.task == "embed":  # a pooling model: AsyncLLM.encode
        from .vllm_pooling import VllmPoolingEngine

        engine_class = VllmPoolingEngine
    return engine_class(
        cfg.resolve(model.path),
        model.name,
        max_model_len=max_model_len,
        max_num_seqs=wcfg.max_num_seqs,
        dtype=wcfg.dtype,
        kv_cache_bytes=wcfg.kv_cache_bytes,
        gpu_memory_utilization=wcfg.gpu_memory_utilization,
        tracing=cfg.tracing if cfg.tracing.enabled else None,
        **({"lora": cfg.lora(model)} if model.task == "generate" else {}),
    )


class _Link:
    """One router: its socket, when it was last heard, its back-off."""

    __slots__ = (
        "index",
        "address",
        "prefix",
        "sock",
        "last_heard",
        "missed",
        "backoff",
        "reconnecting",
        "emit",
        "removed",
        "epoch",
    )

    def __init__(self, index: int, address: str) -> None:
        self.index = index
        self.address = address
        self.prefix = f"{index}:"  # engine request id = prefix + the router's id
        self.sock: zmq.Socket[bytes] | None = None
        self.last_heard = 0.0
        self.missed = 0  # heartbeat ticks in a row with nothing heard from it
        self.backoff = RECONNECT_BACKOFF_INITIAL_S
        self.reconnecting = False
        self.emit: Emit | None = None  # its requests' Deltas: Worker._emit_for bound to this link
        self.removed = False  # unlinked (its address left DNS): never reconnected
        self.epoch = 0  # its current registration's number (Register.epoch): a Dispatch must carry it


class Worker:
    def __init__(self, cfg: Config, wcfg: WorkerConfig, engine: EngineBase) -> None:
        self.cfg = cfg
        self.wcfg = wcfg
        self.engine = engine
        self.interval = cfg.router.heartbeat_interval_s
        self.liveness = cfg.router.heartbeat_liveness
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context()
        self.pump = SocketPump(self.loop)
        self.outbox = Outbox(self.loop, self._flush_outputs)
        # index -> link; an index is never reused, so a new link's engine ids never meet an old one's
        self.links: dict[int, _Link] = {}
        self._next_link = 0
        backends = cfg.worker_backends(wcfg)
        discover = wcfg.discovery_interval_s > 0
        self._static = [a for a in backends if not discover or parse(a) is None]
        names = [n for a in backends if discover and (n := parse(a)) is not None]
        self.discovery: RouterDiscovery | None = None
        if names:
            self.discovery = RouterDiscovery(
                self.loop, names, wcfg.discovery_interval_s, self._add_link, self._unlink_address
            )
        self.ledger: Ledger | None = None  # once the engine says what it has
        self.register_msg: Register | None = None
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._stop_reason = "shutdown"
        self._draining: asyncio.Task[None] | None = None
        self._malformed = 0
        self._stale_dispatches = 0  # requests in Dispatches of a replaced registration (dropped)
        self._restarting: asyncio.Task[None] | None = None  # the engine died and starts again
        self._engine_restarts = 0
        # [logging] requests: engine id -> (request id, dispatch time), for one line per finished request
        self._log_requests = cfg.logging.requests
        self._traces: dict[str, tuple[str, float]] = {}
        # What the engine's prefix cache holds, for every router (engine_worker.prefix_feed).
        self.prefix_feed = PrefixFeed(self.loop, self._broadcast)
        self.kv_events: VllmKvEvents | None = None  # vLLM's event stream (engine_worker.vllm_events)
        # [tracing]: spans of sampled requests (engine_worker.tracing); None: off
        self.tracer: WorkerTracer | None = None
        if cfg.tracing.enabled:
            self.tracer = WorkerTracer(cfg.tracing, wcfg.id, wcfg.model, cfg.model(wcfg.model).engine, loop=self.loop)

    # -- lifecycle -----------------------------------------------------------

    def stop(self, reason: str = "shutdown", exit_code: int = 0) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self.exit_code = exit_code
            self._stop.set()

    def drain(self) -> None:
        """Take no new work, finish what runs (up to the drain timeout), then stop."""
        if self._draining is None and not self._stop.is_set():
            log.info("worker %s draining: %d requests running", self.wcfg.id, len(self.engine.live_ids()))
            for link in self.links.values():
                self._send(link, Drain("SIGTERM"))
            self._draining = self.loop.create_task(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        deadline = self.loop.time() + self.cfg.router.drain_timeout_s
        # a poll: the engines announce no "idle", and one look is a set read
        while self.engine.live_ids() and self.loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        left = self.engine.live_ids()
        if left:  # the router resumes them elsewhere once it has our Goodbye
            log.warning("worker %s: drain timeout with %d requests running", self.wcfg.id, len(left))
            self.engine.abort(left, tell=False)
        self.stop("drained")

    async def run(self) -> int:
        self.loop.add_signal_handler(signal.SIGTERM, self.drain)
        self.loop.add_signal_handler(signal.SIGINT, self.stop, "SIGINT")
        self.engine.kv_feed = self.prefix_feed
        self.engine.on_died = self._engine_died
        info = await self._start_engine()
        if info is None:
            self.ctx.term()
            return 1
        freeze_startup_heap()  # the engine is loaded and warm: what it holds now lives on
        self._registration(info)
        if not self._stop.is_set():
            for address in self._static:
                self._add_link(address)
            discovering = None if self.discovery is None else self.loop.create_task(self.discovery.run())
            log.info(
                "worker %s registered: engine=%s capacity=%d tokens block=%d max_num_seqs=%d "
                "max_model_len=%d routers=%s",
                self.wcfg.id,
                info.engine,
                info.kv_capacity_tokens,
                info.block_size,
                info.max_num_seqs,
                info.max_model_len,
                ",".join([*self._static, *(f"{h}:{p} (every address)" for h, p in self._names())]),
            )
            heartbeats = self.loop.create_task(self._heartbeat_loop())
            await self._stop.wait()
            heartbeats.cancel()
            if discovering is not None:
                discovering.cancel()
        await self._shutdown()
        return self.exit_code

    async def _start_engine(self) -> EngineInfo | None:
        """Start the engine, follow its KV events, warm it up; None if it
        failed (logged, and the engine shut down)."""
        try:
            info = await self.engine.start()
        except Exception:
            log.exception("worker %s: engine failed to start", self.wcfg.id)
            return None
        if info.kv_events_endpoint:  # before the warm-up, so its blocks are reported too
            from .vllm_events import VllmKvEvents

            self.kv_events = VllmKvEvents(
                self.ctx,
                self.pump,
                self.loop,
                info.kv_events_endpoint,
                info.kv_events_replay or None,
                self.prefix_feed,
                self.engine.reset_prefix_cache,
            )
        if self.wcfg.warmup and not self._stop.is_set():
            try:
                took = await warm_up(self.engine, info, self.wcfg.warmup_timeout_s)
            except WarmupFailed as e:
                log.error("worker %s: warm-up generation failed (%s): not registering", self.wcfg.id, e)
                self._close_kv_events()
                await self.engine.shutdown()
                return None
            log.info("worker %s warmed up: generated through the engine in %.3f s", self.wcfg.id, took)
        return info

    def _close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    # -- the engine dies under a live worker ---------------------------------------

    def _engine_died(self) -> None:
        """The engine's ``on_died``: its EngineCore exited under its requests."""
        if self._restarting is None and not self._stop.is_set():
            self._restarting = self.loop.create_task(self._restart_engine())

    async def _restart_engine(self) -> None:
        """What ran here goes back to its routers as lost (they resume it
        elsewhere, as a lost worker's), the engine starts again and the
        worker registers anew -- each link with a new epoch, so a Dispatch
        sent meanwhile is not run here as well as where its router moves it."""
        log.error(
            "worker %s: engine died (%r): its requests go back to their routers", self.wcfg.id, self.engine.fatal_error
        )
        self.outbox.flush()  # the Deltas it produced before it died go first
        for link in self.links.values():  # nothing new while it restarts (ordered before the Lost)
            self._send(link, Drain("engine restarting"))
        self._lose_all()
        self._engine_restarts += 1
        if self._draining is not None or self._engine_restarts > ENGINE_RESTARTS_MAX:
            self.stop("engine failed", exit_code=1)  # (a drain: nothing left to finish)
            return
        await asyncio.sleep(0)  # (the messages leave before a restart that holds the loop)
        self._close_kv_events()
        self.prefix_feed.cleared()  # a new engine's cache starts empty (its warm-up's blocks follow)
        try:
            await self.engine.shutdown()
        except Exception:
            log.exception("worker %s: shutting the dead engine down failed", self.wcfg.id)
        self.engine.fatal_error = None
        info = await self._start_engine()
        if info is None or self._stop.is_set():
            self.stop("engine failed", exit_code=1)
            return
        log.info("worker %s: engine started again (%d since the worker started)", self.wcfg.id, self._engine_restarts)
        self._registration(info)
        self._restarting = None
        for link in self.links.values():
            if link.sock is not None and not link.reconnecting:
                self._register(link)

    def _lose_all(self) -> None:
        """Every request the engine ran ends here unheard: each router is told
        which of its own are lost (Lost), and forgets nothing else."""
        assert self.ledger is not None, "the engine dies only once started"
        self.engine.forget_all()
        for link in self.links.values():
            ids = self.ledger.drop(link.index)
            for rid in ids:
                self._traces.pop(link.prefix + rid, None)
            if ids:
                log.warning(
                    "worker %s: %d requests of router %s lost with the engine", self.wcfg.id, len(ids), link.address
                )
                self._send(link, Lost(ids, "engine died"))

    def _registration(self, info: EngineInfo) -> None:
        """The Register this worker sends (what the running engine really has) and its ledger."""
        gpu = read_gpu(self.wcfg.gpu_index)
        self.register_msg = Register(
            worker_id=self.wcfg.id,
            model=self.wcfg.model,
            pool=_POOLS[self.wcfg.pool],
            max_model_len=info.max_model_len,
            kv_capacity_tokens=info.kv_capacity_tokens,
            block_size=info.block_size,
            max_num_seqs=info.max_num_seqs,
            engine=info.engine,
            gpu=gpu,
            step_time_s=info.step_time_s,
            request_overhead_s=info.request_overhead_s,
            prefix_caching=info.prefix_caching,
            prefix_hash=info.prefix_hash,
            prefix_hash_seed=info.prefix_hash_seed,
        )
        sched = self.cfg.scheduler
        self.ledger = Ledger(sched.kv_budget(info.kv_capacity_tokens), sched.seq_slots(info.max_num_seqs))

    async def _shutdown(self) -> None:
        log.info("worker %s stopping (%s)", self.wcfg.id, self._stop_reason)
        self.outbox.flush()
        for link in self.links.values():
            if link.sock is not None:
                self._send(link, Goodbye(self._stop_reason))
                self._close_socket(link, linger_ms=GOODBYE_LINGER_MS)
        if self._restarting is not None:
            self._restarting.cancel()
        self._close_kv_events()
        try:
            await self.engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")
        self.ctx.term()
        if self.tracer is not None:
            self.tracer.close()

    # -- the links -----------------------------------------------------------

    def _names(self) -> list[tuple[str, int]]:
        return [] if self.discovery is None else self.discovery.names

    def _add_link(self, address: str) -> None:
        link = _Link(self._next_link, address)
        self._next_link += 1
        link.emit = functools.partial(self._emit_for, link)
        self.links[link.index] = link
        self._connect(link)

    def _remove_link(self, link: _Link, reason: str) -> None:
        """The one way a link ends before the process does: its router is told
        (Goodbye: it resumes elsewhere whatever it still had here), its socket
        closed, its requests stopped here."""
        if self.links.pop(link.index, None) is None:
            return
        link.removed = True
        if link.sock is not None:
            self._send(link, Goodbye(reason))
            self._close_socket(link, linger_ms=GOODBYE_LINGER_MS)
        self._forget_inflight(link)

    def _unlink_address(self, address: str) -> bool:
        """Discovery: ``address`` left DNS.  A router that still holds requests
        here and answers (a draining one, still finishing its streams) keeps
        its link until they end; False = ask again next round."""
        link = next((lk for lk in self.links.values() if lk.address == address), None)
        if link is None:
            return True
        assert self.ledger is not None, "links exist once the engine has started"
        if self.ledger.held_by(link.index)[1] and not link.reconnecting:
            return False
        self._remove_link(link, "router address gone")
        return True

    def _connect(self, link: _Link) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.wcfg.id.encode())
        sock.setsockopt(zmq.LINGER, 0)  # a dead link's queued messages are worthless
        if self.cfg.security.curve:  # CURVE client of the router (shared.curve)
            from shared.curve import client_socket, worker_key_files

            client_socket(sock, *worker_key_files(self.cfg, self.wcfg))
        sock.connect(link.address)
        link.sock = sock
        self.pump.add(sock, functools.partial(self._on_message, link))
        link.last_heard = self.loop.time()
        link.missed = 0
        self._register(link)

    def _register(self, link: _Link) -> None:
        assert self.register_msg is not None, "links connect once the engine has started"
        if self._restarting is not None:
            return  # the engine starts again: every link registers once it has
        # A new number with every registration, unique across links and processes
        # (random): a Dispatch the router sent before it read this Register carries
        # the old one and is dropped, as the router counts its job lost on reading it.
        link.epoch = secrets.randbits(63) or 1
        self._send(link, msgspec.structs.replace(self.register_msg, epoch=link.epoch))
        if self._draining is not None:  # a router that (re)learns of us while we drain: still draining
            self._send(link, Drain("SIGTERM"))
        if self.register_msg.prefix_hash:  # the router learns the cache anew with every registration
            self.prefix_feed.snapshot()  # (to every router: they all follow one seq)

    def _broadcast(self, msg: PrefixEvents | PrefixSnapshot) -> None:
        """The prefix feed's messages go to every linked router, in one seq."""
        for link in self.links.values():
            if not link.reconnecting:
                self._send(link, msg)

    def _close_socket(self, link: _Link, linger_ms: int = 0) -> None:
        sock, link.sock = link.sock, None
        if sock is not None:
            self.pump.remove(sock)
            sock.close(linger=linger_ms)

    def _send(self, link: _Link, msg: WorkerToRouter) -> None:
        if link.sock is not None:
            self.pump.send(link.sock, [encoder.encode(msg)])

    def _emit_for(self, link: _Link, d: Delta) -> None:
        """An engine's Delta of one of ``link``'s requests: the router's own id
        back, the ledger released with the request's last Delta."""
        tracer = self.tracer
        if tracer is not None and tracer.live:
            tracer.delta(d.request_id, d)
        rid = d.request_id[len(link.prefix) :]
        d.request_id = rid
        if d.finish_reason is not None or d.error is not None:
            assert self.ledger is not None, "requests arrive once the engine has started"
            self.ledger.release(link.index, rid)
        self.outbox.put(link.index, d)

    def _flush_outputs(self, index: int, deltas: list[Delta]) -> None:
        link = self.links.get(index)
        if link is None:  # unlinked since: its router resumed those requests elsewhere
            return
        self._send(link, Outputs(deltas))
        if self._log_requests:
            for d in deltas:
                if d.finished:
                    self._log_end(link, d)

    def _log_end(self, link: _Link, d: Delta) -> None:
        rid, t0 = self._traces.pop(link.prefix + d.request_id, (d.request_id, self.loop.time()))
        outcome = d.finish_reason or (d.error.code or "error" if d.error is not None else "?")
        log.info(
            "request %s %s job=%s prompt_tokens=%d completion_tokens=%d seconds=%.3f",
            rid,
            outcome,
            d.request_id,
            d.prompt_tokens,
            d.completion_tokens,
            self.loop.time() - t0,
            extra={"request_id": rid, "outcome": outcome},
        )

    async def _heartbeat_loop(self) -> None:
        prev = self.loop.time()
        while True:
            await asyncio.sleep(self.interval)
            # Liveness counts ticks that heard nothing since the one before
            # (Paranoid Pirate), not seconds: when this process itself stalls
            # (a worker on a loaded 2-core machine found its router "silent for
            # 1.8 s"), the late tick counts once, and what the router sent
            # meanwhile is read before the next.
            tick, prev = prev, self.loop.time()
            if self.engine.fatal_error is not None and self._restarting is None:
                log.error("worker %s: engine failed: %r", self.wcfg.id, self.engine.fatal_error)
                self.stop("engine failed", exit_code=1)
                return
            stats = None
            gpu = await self._read_gpu()
            assert self.ledger is not None, "heartbeats start once the engine has started"
            for link in self.links.values():
                if link.reconnecting:
                    continue
                if link.last_heard < tick and link.sock is not None:
                    # Read before judging: what waits is news (see SocketPump.read_now).
                    read = self.pump.read_now(link.sock)
                    if read and link.missed + 1 >= self.liveness:
                        log.warning(
                            "worker %s: %d messages from router %s were read only at its liveness check",
                            self.wcfg.id,
                            read,
                            link.address,
                        )
                link.missed = 0 if link.last_heard >= tick else link.missed + 1
                if link.missed >= self.liveness:
                    link.reconnecting = True
                    self.loop.create_task(self._reconnect(link))
                    if self.discovery is not None:  # its router may have moved: look now
                        self.discovery.poke()
                    continue
                if stats is None:
                    stats = self.stats(gpu)
                stats.other_tokens, stats.other_seqs = self.ledger.others(link.index)
                self._send(link, Heartbeat(stats, self.prefix_feed.seq))

    async def _reconnect(self, link: _Link) -> None:
        delay, link.backoff = link.backoff, min(link.backoff * 2, RECONNECT_BACKOFF_MAX_S)
        log.warning(
            "worker %s: router %s silent for %.1f s; reconnecting in %.2f s",
            self.wcfg.id,
            link.address,
            self.loop.time() - link.last_heard,
            delay,
        )
        self._close_socket(link)
        self._forget_inflight(link)
        try:
            await asyncio.sleep(delay)
            if not self._stop.is_set() and not link.removed:
                self._connect(link)
        finally:
            link.reconnecting = False

    def _forget_inflight(self, link: _Link) -> None:
        """That router no longer knows its requests here: stop them, telling nobody."""
        assert self.ledger is not None, "links connect once the engine has started"
        ids = self.ledger.drop(link.index)
        if ids:
            log.warning("worker %s: aborting %d in-flight requests of router %s", self.wcfg.id, len(ids), link.address)
            self.engine.abort([link.prefix + rid for rid in ids], tell=False)
            for rid in ids:
                self._traces.pop(link.prefix + rid, None)

    async def _read_gpu(self) -> GpuInfo:
        """NVML off the event loop (five calls a heartbeat: ~ms on some boards,
        while this loop streams every engine step's tokens)."""
        if self.wcfg.gpu_index is None:
            return GpuInfo(present=False)
        return await self.loop.run_in_executor(None, read_gpu, self.wcfg.gpu_index)

    def stats(self, gpu: GpuInfo | None = None) -> WorkerStats:
        s = self.engine.stats()
        if gpu is None:
            gpu = read_gpu(self.wcfg.gpu_index)
        if gpu.present:
            s.gpu_used_bytes, s.gpu_total_bytes = gpu.used_bytes, gpu.total_bytes
        s.gpu = gpu  # every heartbeat: present=False says "no GPU" explicitly
        s.tokens_total = self.engine.tokens_total
        return s

    # -- router -> worker ------------------------------------------------------

    def _on_message(self, link: _Link, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames")
            msg = to_worker_decoder.decode(frames[0])
        except (ValueError, msgspec.DecodeError) as e:  # msgspec.ValidationError is a DecodeError
            self._malformed += 1
            if self._malformed <= 10 or self._malformed % 1000 == 0:
                log.warning("worker %s: dropped malformed message #%d: %s", self.wcfg.id, self._malformed, e)
            return
        link.last_heard = self.loop.time()
        link.backoff = RECONNECT_BACKOFF_INITIAL_S
        if isinstance(msg, Dispatch):
            if msg.epoch and msg.epoch != link.epoch:
                # Sent under a registration this worker has since replaced (it timed
                # the router out, or restarted its engine, and registered again): the
                # router counts these lost when it reads the new Register and runs
                # them again -- run here as well, they would run twice.
                self._stale_dispatches += len(msg.requests)
                log.warning(
                    "worker %s: dropped a dispatch of %d requests from router %s sent before it read our Register",
                    self.wcfg.id,
                    len(msg.requests),
                    link.address,
                )
                return
            self._on_dispatch(link, msg.requests)
        elif isinstance(msg, Abort):
            self.engine.abort([link.prefix + rid for rid in msg.request_ids])
        elif isinstance(msg, PrefixResync):
            log.info("worker %s: router %d asks for its prefix cache (%s)", self.wcfg.id, link.index, msg.reason)
            self.prefix_feed.snapshot()
        elif isinstance(msg, Goodbye):
            # The router forgot us (restart, or it timed us out): start afresh.
            log.warning(
                "worker %s: router %s said goodbye (%s); registering again", self.wcfg.id, link.address, msg.reason
            )
            self._forget_inflight(link)
            self._register(link)
            if self.discovery is not None:  # a router restarting may come back elsewhere
                self.discovery.poke()
        # Heartbeat: liveness only, recorded above.

    def _on_dispatch(self, link: _Link, requests: list[GenerateRequest]) -> None:
        if self._restarting is not None:
            # Sent before the router read our Drain: lost here, it runs elsewhere.
            self._send(link, Lost([r.request_id for r in requests], "engine restarting"))
            return
        ledger, prefix, index, emit = self.ledger, link.prefix, link.index, link.emit
        assert ledger is not None and self.register_msg is not None and emit is not None, "engine started"
        block = self.register_msg.block_size
        refused = []
        traces = self._traces if self._log_requests else None
        now = self.loop.time()
        for req in requests:
            rid = req.request_id
            tokens = req.kv_tokens or kv_tokens_of(req.prompt_tokens, req.params.max_tokens, req.params.n, block)
            if not ledger.admit(index, rid, tokens):
                refused.append(rid)
                continue
            req.request_id = prefix + rid
            if self.tracer is not None:
                self.tracer.dispatched(req.request_id, req)
            if traces is not None:  # (a refused one never ends here: no trace kept for it)
                traces[req.request_id] = (req.trace_id or rid, now)
            self.engine.submit(req, emit)
        if refused:
            other_tokens, other_seqs = ledger.others(index)
            log.debug(
                "worker %s: refused %d dispatches of router %s (holding %d tokens, %d seqs of %d, %d)",
                self.wcfg.id,
                len(refused),
                link.address,
                ledger.tokens,
                ledger.seqs,
                ledger.budget,
                ledger.slots,
            )
            self._send(link, Refuse(refused, other_tokens, other_seqs))
