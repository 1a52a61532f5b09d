"""The worker's copy of what its engine's prefix cache holds, and the updates the router is owed.

The engine reports its KV events here (vLLM's through
``engine_worker.vllm_events``, the simulated engine's directly); the feed
keeps the set of cached block hashes -- bounded by the engine's own block
count -- and once per loop turn (so about once per engine step, however many
event batches it brought) sends the router one ``PrefixEvents`` with the net
change and the next seq.  ``snapshot`` sends the whole set (after Register,
and when the router asks: ``PrefixResync``).

``lost``: the engine's events were lost beyond what its replay buffer holds,
so the set is unknown; the router is told (an untrusted snapshot) and routes
this worker cache-blind until the engine's cache is cleared
(``AllBlocksCleared``), after which the set is known again: empty, then
whatever the events add.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from shared.protocol import PrefixEvents, PrefixSnapshot

log = logging.getLogger(__name__)


class PrefixFeed:
    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[PrefixEvents | PrefixSnapshot], None]) -> None:
        self.loop = loop
        self.send = send
        self.blocks: set[int] = set()
        self.seq = -1  # last PrefixEvents / PrefixSnapshot made
        self.trusted = True
        self._touched: set[int] = set()
        self._cleared = False
        self._ts = 0.0
        self._pending = False

    # -- what the engine reports -------------------------------------------

    def stored(self, hashes: Iterable[int], ts: float = 0.0) -> None:
        self.blocks.update(hashes)
        self._touched.update(hashes)
        self._touch(ts)

    def removed(self, hashes: Iterable[int], ts: float = 0.0) -> None:
        self.blocks.difference_update(hashes)
        self._touched.update(hashes)
        self._touch(ts)

    def cleared(self, ts: float = 0.0) -> None:
        self.blocks.clear()
        self._touched.clear()
        self._cleared = True
        if not self.trusted:
            log.info("prefix cache cleared: its contents are known again")
            self.trusted = True
        self._touch(ts)

    def lost(self, why: str) -> None:
        """The engine's events cannot be recovered: say so, until a clear."""
        log.warning("prefix cache events lost (%s): cache-blind until the engine's cache is cleared", why)
        self.trusted = False
        self.blocks.clear()
        self._touched.clear()
        self._cleared = False
        self.snapshot()

    # -- what the router gets ------------------------------------------------

    def snapshot(self) -> None:
        """Everything the cache holds (replaces what the router had)."""
        self._touched.clear()
        self._cleared = False
        self.seq += 1
        self.send(PrefixSnapshot(self.seq, list(self.blocks), self.trusted))

    def flush(self) -> None:
        self._pending = False
        if not (self._touched or self._cleared):
            return
        touched, self._touched = self._touched, set()
        cleared, self._cleared = self._cleared, False
        if not self.trusted:
            return  # nothing it says counts until the clear
        blocks = self.blocks
        if cleared:
            stored, removed = list(blocks), []
        else:
            stored = [h for h in touched if h in blocks]
            removed = [h for h in touched if h not in blocks]
        self.seq += 1
        self.send(PrefixEvents(self.seq, stored, removed, cleared, self._ts or time.time()))

    def _touch(self, ts: float) -> None:
        if ts:
            self._ts = ts
        if not self._pending:
            self._pending = True
            self.loop.call_soon(self.flush)
