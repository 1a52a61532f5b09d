"""vLLM's KV events, consumed in the worker: SUB to the engine's publisher, replay on a gap.

vLLM 0.32 (``vllm/distributed/kv_events.py``) publishes once per engine step
``[topic, seq (8 bytes big-endian), msgpack(KVEventBatch)]`` on a PUB socket
and keeps the last ``buffer_steps`` batches for replay on a ROUTER socket:
send ``[b"", start_seq]``, get ``[b"", topic, seq, payload]`` per batch, then
``[b"", b"", seq -1, b""]``.  Both sockets are on per-worker ``ipc://``
paths bound by the engine (engine_worker.vllm_engine).

Consumed here rather than by the router (the alternative: advertise the
endpoint and let routers subscribe): the worker is next to the engine (ipc,
no TCP port per engine to open), folds the engine's per-step batches into
one compact PrefixEvents per loop turn on the link it already has, and can
answer any router's resync from its own copy -- a router never needs to
reach the engine.

A gap in vLLM's seq (or a batch that does not decode) is filled from the
replay socket; live batches wait meanwhile and are applied after it, in
order.  If the replay cannot fill it (its buffer moved on, it does not
answer within ``REPLAY_TIMEOUT_S``, or a batch is still malformed) the feed
is ``lost``: the worker is cache-blind and asks the engine to clear its
prefix cache, whose AllBlocksCleared makes the contents known again.
Sockets belong to the worker's SocketPump like its router link.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from shared.transport import SocketPump

from .prefix_feed import PrefixFeed

log = logging.getLogger(__name__)

_GPU = (None, "GPU")  # BlockStored/BlockRemoved.medium of the GPU cache (None: not said)

REPLAY_TIMEOUT_S = 1.0
_END_SEQ = -1


class VllmKvEvents:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        pump: SocketPump,
        loop: asyncio.AbstractEventLoop,
        endpoint: str,
        replay_endpoint: str | None,
        feed: PrefixFeed,
        on_lost: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.pump = pump
        self.feed = feed
        self.on_lost = on_lost
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.last = -1  # the publisher's seq of the last batch applied
        self.malformed = 0
        self.gaps = 0
        self._held: list[list[bytes]] = []  # live batches that came while a replay runs
        self._replaying = False
        self._timer: asyncio.TimerHandle | None = None
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        pump.add(self.sub, self._on_live)
        self.replay = None
        if replay_endpoint:
            self.replay = ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(replay_endpoint)
            pump.add(self.replay, self._on_replayed)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for s in (self.sub, self.replay):
            if s is not None:
                self.pump.remove(s)
                s.close(0)

    # -- live batches --------------------------------------------------------

    def _on_live(self, frames: list[bytes]) -> None:
        if self._replaying:
            self._held.append(frames)
            return
        if not self._take(frames):
            self._held.append(frames)
            self._ask_replay()

    def _take(self, frames: list[bytes]) -> bool:
        """Apply the next batch; False: it is not the next (gap) or is malformed."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return False
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq <= self.last:
            return True  # seen already (a replay overlapping live batches)
        if seq != self.last + 1:
            self.gaps += 1
            return False
        try:
            batch = self.decoder.decode(frames[2])
        except msgspec.DecodeError:
            self.malformed += 1
            return False
        self.last = seq
        feed = self.feed
        ts = batch.ts
        for ev in batch.events:
            cls = ev.__class__
            # Only the GPU tier: with KV offloading a CPU store is no GPU hit,
            # and a CPU-tier removal leaves the GPU's copy in place.
            if cls is BlockStored:
                if ev.medium in _GPU:
                    feed.stored(ev.block_hashes, ts)
            elif cls is BlockRemoved:
                if ev.medium in _GPU:
                    feed.removed(ev.block_hashes, ts)
            elif cls is AllBlocksCleared:
                feed.cleared(ts)
        return True

    # -- replay --------------------------------------------------------------

    def _ask_replay(self) -> None:
        if self._replaying:
            return
        if self.replay is None:
            return self._give_up("no replay socket")
        self._replaying = True
        log.info("KV events: gap after seq %d; replaying", self.last)
        self.pump.send(self.replay, [b"", (self.last + 1).to_bytes(8, "big")])
        self._timer = self.loop.call_later(REPLAY_TIMEOUT_S, self._give_up, "replay timed out")

    def _on_replayed(self, frames: list[bytes]) -> None:
        if not self._replaying:
            return  # a late answer to a replay given up on
        if len(frames) == 4 and int.from_bytes(frames[2], "big", signed=True) == _END_SEQ:
            self._replay_done()
        elif len(frames) == 4:
            self._take(frames[1:])  # a batch already applied, or beyond a gap, is sorted out below

    def _replay_done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._replaying = False
        held, self._held = self._held, []
        for i, frames in enumerate(held):
            if not self._take(frames):
                rest = held[i:]
                seqs = [int.from_bytes(f[1], "big", signed=True) for f in rest if len(f) == 3 and len(f[1]) == 8]
                return self._give_up("replay did not cover the gap", max(seqs, default=self.last))

    def _give_up(self, why: str, resume_at: int | None = None) -> None:
        self._timer = None
        self._replaying = False
        held, self._held = self._held, []
        seqs = [int.from_bytes(f[1], "big", signed=True) for f in held if len(f) == 3 and len(f[1]) == 8]
        self.last = max([self.last, *seqs] + ([resume_at] if resume_at is not None else []))
        self.feed.lost(why)
        self.on_lost()
