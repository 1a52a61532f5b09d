"""The engine worker process: one engine, one DEALER link to the router.

Link protocol (Paranoid Pirate, after the ZeroMQ guide): after the engine is up
the worker sends Register, then a Heartbeat with its stats every interval.
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

Output batching: engines emit Deltas one at a time; they go through an Outbox
that flushes once per event-loop turn, so one engine step becomes one Outputs
message, whatever the number of requests in it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from typing import Optional

import msgspec
import zmq

from shared.config import Config, WorkerConfig
from shared.protocol import (Abort, Delta, Dispatch, Drain, Goodbye, Heartbeat, Outputs, Pool, PrefixResync,
                             Register, WorkerStats, encoder, to_worker_decoder)
from shared.transport import Outbox, SocketPump

from .base import EngineBase
from .gpu import read_gpu
from .prefix_feed import PrefixFeed

log = logging.getLogger("engine_worker")

BACKOFF_INITIAL_S = 0.25
BACKOFF_MAX_S = 5.0
GOODBYE_LINGER_MS = 1000  # time the last Goodbye gets to leave before the socket closes

_POOLS = {"any": Pool.ANY, "short": Pool.SHORT, "long": Pool.LONG}


def make_engine(cfg: Config, wcfg: WorkerConfig) -> EngineBase:
    model = cfg.model(wcfg.model)
    max_model_len = wcfg.max_model_len or model.max_model_len
    if model.engine == "sim":
        from .sim_engine import SimEngine

        return SimEngine(wcfg.sim, wcfg.max_num_seqs, max_model_len)
    from .vllm_engine import VllmEngine  # imports vLLM: seconds

    return VllmEngine(cfg.resolve(model.path), model.name, max_model_len=max_model_len,
                      max_num_seqs=wcfg.max_num_seqs, dtype=wcfg.dtype, kv_cache_bytes=wcfg.kv_cache_bytes,
                      gpu_memory_utilization=wcfg.gpu_memory_utilization)


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
        self._emit = functools.partial(self.outbox.put, None)  # an engine's Deltas: one destination
        self.sock: Optional[zmq.Socket] = None
        self.register_msg: Optional[Register] = None
        self.exit_code = 0
        self._last_heard = 0.0
        self._backoff = BACKOFF_INITIAL_S
        self._stop = asyncio.Event()
        self._stop_reason = "shutdown"
        self._draining: Optional[asyncio.Task] = None
        self._malformed = 0
        # What the engine's prefix cache holds, for the router (engine_worker.prefix_feed).
        self.prefix_feed = PrefixFeed(self.loop, self._send)
        self.kv_events = None  # vLLM's event stream (engine_worker.vllm_events)

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
            self._send(Drain("SIGTERM"))
            self._draining = self.loop.create_task(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        deadline = self.loop.time() + self.cfg.router.drain_timeout_s
        while self.engine.live_ids() and self.loop.time() < deadline:
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
        try:
            info = await self.engine.start()
        except Exception:
            log.exception("worker %s: engine failed to start", self.wcfg.id)
            return 1
        if info.kv_events_endpoint:
            from .vllm_events import VllmKvEvents

            self.kv_events = VllmKvEvents(self.ctx, self.pump, self.loop, info.kv_events_endpoint,
                                          info.kv_events_replay or None, self.prefix_feed,
                                          self.engine.reset_prefix_cache)
        gpu = read_gpu(self.wcfg.gpu_index)
        self.register_msg = Register(
            worker_id=self.wcfg.id, model=self.wcfg.model, pool=_POOLS[self.wcfg.pool],
            max_model_len=info.max_model_len, kv_capacity_tokens=info.kv_capacity_tokens,
            block_size=info.block_size, max_num_seqs=info.max_num_seqs, engine=info.engine, gpu=gpu,
            step_time_s=info.step_time_s, request_overhead_s=info.request_overhead_s,
            prefix_caching=info.prefix_caching, prefix_hash=info.prefix_hash,
            prefix_hash_seed=info.prefix_hash_seed,
        )
        if not self._stop.is_set():
            self._connect()
            log.info("worker %s registered: engine=%s capacity=%d tokens block=%d max_num_seqs=%d "
                     "max_model_len=%d router=%s", self.wcfg.id, info.engine, info.kv_capacity_tokens,
                     info.block_size, info.max_num_seqs, info.max_model_len, self.cfg.router.backend)
            heartbeats = self.loop.create_task(self._heartbeat_loop())
            await self._stop.wait()
            heartbeats.cancel()
        await self._shutdown()
        return self.exit_code

    async def _shutdown(self) -> None:
        log.info("worker %s stopping (%s)", self.wcfg.id, self._stop_reason)
        if self.sock is not None:
            self.outbox.flush()
            self._send(Goodbye(self._stop_reason))
            self._close_socket(linger_ms=GOODBYE_LINGER_MS)
        if self.kv_events is not None:
            self.kv_events.close()
        try:
            await self.engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")
        self.ctx.term()

    # -- the link ------------------------------------------------------------

    def _connect(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.wcfg.id.encode())
        sock.setsockopt(zmq.LINGER, 0)  # a dead link's queued messages are worthless
        if self.cfg.security.curve:  # CURVE client of the router (shared.curve)
            from shared.curve import client_socket, worker_key_files

            client_socket(sock, *worker_key_files(self.cfg, self.wcfg))
        sock.connect(self.cfg.router.backend)
        self.sock = sock
        self.pump.add(sock, self._on_message)
        self._last_heard = self.loop.time()
        self._register()

    def _register(self) -> None:
        self._send(self.register_msg)
        if self.register_msg.prefix_hash:  # the router learns its cache anew with every registration
            self.prefix_feed.snapshot()
        if self._draining is not None:  # a router that (re)learns of us while we drain: still draining
            self._send(Drain("SIGTERM"))

    def _close_socket(self, linger_ms: int = 0) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            self.pump.remove(sock)
            sock.close(linger=linger_ms)

    def _send(self, msg) -> None:
        if self.sock is not None:
            self.pump.send(self.sock, [encoder.encode(msg)])

    def _flush_outputs(self, _dest, deltas: list[Delta]) -> None:
        self._send(Outputs(deltas))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self.engine.fatal_error is not None:
                log.error("worker %s: engine failed: %r", self.wcfg.id, self.engine.fatal_error)
                self.stop("engine failed", exit_code=1)
                return
            if self.loop.time() - self._last_heard > self.interval * self.liveness:
                await self._reconnect()
                continue
            self._send(Heartbeat(self.stats(), self.prefix_feed.seq))

    async def _reconnect(self) -> None:
        delay, self._backoff = self._backoff, min(self._backoff * 2, BACKOFF_MAX_S)
        log.warning("worker %s: router silent for %.1f s; reconnecting in %.2f s",
                    self.wcfg.id, self.loop.time() - self._last_heard, delay)
        self._close_socket()
        self._forget_inflight()
        await asyncio.sleep(delay)
        if not self._stop.is_set():
            self._connect()

    def _forget_inflight(self) -> None:
        """The router no longer knows our requests: stop them, telling nobody."""
        ids = self.engine.live_ids()
        if ids:
            log.warning("worker %s: aborting %d in-flight requests", self.wcfg.id, len(ids))
            self.engine.abort(ids, tell=False)

    def stats(self) -> WorkerStats:
        s = self.engine.stats()
        gpu = read_gpu(self.wcfg.gpu_index)
        if gpu.present:
            s.gpu_used_bytes, s.gpu_total_bytes = gpu.used_bytes, gpu.total_bytes
        return s

    # -- router -> worker ------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames")
            msg = to_worker_decoder.decode(frames[0])
        except (ValueError, msgspec.DecodeError) as e:  # msgspec.ValidationError is a DecodeError
            self._malformed += 1
            if self._malformed <= 10 or self._malformed % 1000 == 0:
                log.warning("worker %s: dropped malformed message #%d: %s", self.wcfg.id, self._malformed, e)
            return
        self._last_heard = self.loop.time()
        self._backoff = BACKOFF_INITIAL_S
        if isinstance(msg, Dispatch):
            for req in msg.requests:
                self.engine.submit(req, self._emit)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.request_ids)
        elif isinstance(msg, PrefixResync):
            log.info("worker %s: router asks for its prefix cache (%s)", self.wcfg.id, msg.reason)
            self.prefix_feed.snapshot()
        elif isinstance(msg, Goodbye):
            # The router forgot us (restart, or it timed us out): start afresh.
            log.warning("worker %s: router said goodbye (%s); registering again", self.wcfg.id, msg.reason)
            self._forget_inflight()
            self._register()
        # Heartbeat: liveness only, recorded above.
