"""What each worker's prefix cache holds: block hash -> workers, per model.

Pure (no I/O, no clock reads: ``now`` comes in), owned by the Policy, fed
by the worker link with the workers' PrefixEvents / PrefixSnapshot (their
engines' own KV events, see engine_worker/prefix_feed.py) and read by
placement (``match``).

Exactness: an entry says a worker holds a block only on that worker's word,
applied in order.  Each worker's messages carry a seq; a gap (a lost or
malformed message, or a heartbeat announcing a seq never applied) makes the
worker *blind* at once -- its entries stop counting -- until a snapshot of
its whole cache arrives.  A worker that registers is blind until its first
snapshot; one that is lost or clears its cache has its entries dropped.
Errors left are on the safe side: an evicted or stale-speculative entry
only loses affinity, it never makes the policy over-commit (its KV reservations
price every job in full whatever the index says).

Entries hold a bitmask of worker *bits*.  Dropping a worker's entries is
O(1): its bit is retired (it leaves ``live``, so no entry with it counts)
and it gets a fresh bit when trusted again; retired bits are stripped from
the entries by a sweep -- at once for a small index, else a slice per
PrefixEvents applied -- after which they are reused.

Speculation: a job just dispatched will put its prompt's blocks in that
worker's cache before the engine says so (~17 ms for a 255-token prompt on
the tiny CPU model, vLLM-kv-events notes); for ``speculative_ttl_s`` (2 s,
llm-d's figure for the same gap) those blocks count as there, so a burst of
requests sharing a prefix follows the first instead of scattering.  A block
has one speculative entry: the bits of the workers that speculated it and the
latest expiry of any of them.  So a worker's speculative bit on a block lasts
until the block's latest speculation by any worker expires: a TTL after its
own at first, up to one TTL more per later speculation that comes while it is
fresh (a prefix speculated again every second stays on every worker that got
it).  Safe: a stale-speculative entry as above gives affinity, never
capacity, and the worker did get the prompt.  (Why flat: a dict per block,
{bit: expiry}, costs 2-3x as much to speculate and to expire in a burst,
where ~500k speculative blocks live at once.)

Bound: at most ``max_blocks`` entries per model; the least recently stored
or matched goes first (1/64 of the cap at a time).  Measured here
(bench/README.md, Prefix): ~80 B per entry (42 B of dict slot + the 64-bit
hash's int), 80 MB per million blocks; storing ~2 us a block; matching a
256-block (32k-token) prompt ~0.9 ms on the loop, a 16-block one ~50 us;
a 141k-token prompt's ~8.8k blocks of 16 (bench.scenarios.long_prompt_costs):
speculating ~0.5 ms, matching them all (a full hit) ~1.5 ms; with 150 such
prompts speculative, speculating ~2 ms and expiring one ~0.9 ms.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.fleet.block_hash import SUPPORTED, BlockHasher

# Stripping retired bits from entries costs ~2 us an entry here: an index of
# up to _EAGER_SWEEP_MAX entries is swept at once (~20 ms), a larger one
# _SWEEP_STEP entries per PrefixEvents applied (~2 ms each), so a loss never
# stalls the loop; the entries stopped counting the moment their bit retired.
_EAGER_SWEEP_MAX = 10_000
_SWEEP_STEP = 1024


@dataclass(slots=True, eq=False)
class _WorkerState:
    worker_id: str
    model: str
    bit: int
    seq: int = -1  # last applied message
    trusted: bool = False  # its entries count (a trusted snapshot came and no gap since)
    unknown: bool = False  # it said it does not know its cache (untrusted snapshot): don't ask again
    blocks: int = 0  # confirmed entries with its bit
    recoveries: int = 0  # gaps since it registered


@dataclass(slots=True, eq=False)
class _ModelIndex:
    hasher: BlockHasher | None
    # hash -> mask, least recently used first (a plain dict: insertion order, and
    # ~17x faster to list than an OrderedDict here, which a sweep does)
    blocks: dict[int, int] = field(default_factory=dict)
    # hash -> (OR of the bits that speculated it, the latest expiry of any of them): one
    # flat entry a block, the tuple shared by the blocks new to a speculation
    spec: dict[int, tuple[int, float]] = field(default_factory=dict)
    # (expiry, a prompt's hashes), by expiry: one entry per prompt speculated
    # (one per block cost a 150k-token prompt's ~10k blocks 2x the loop time)
    spec_queue: deque[tuple[float, tuple[int, ...]]] = field(default_factory=deque)
    live: int = 0  # bits of trusted workers
    by_bit: dict[int, _WorkerState] = field(default_factory=dict)  # bit -> _WorkerState
    retired: set[int] = field(default_factory=set)
    free_bits: list[int] = field(default_factory=list)
    # (keys to visit: the blocks' then the speculative ones', how many are blocks',
    # next index, the retired bits it frees)
    sweeping: tuple[list[int], int, int, list[int]] | None = None
    next_bit: int = 0
    evicted: int = 0


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000, speculative_ttl_s: float = 2.0) -> None:
        self.max_blocks = max(1, max_blocks)
        self.ttl = max(0.0, speculative_ttl_s)
        self.models: dict[str, _ModelIndex] = {}
        self.workers: dict[str, _WorkerState] = {}
        self.counters: dict[str, int] = {"recoveries": 0, "snapshots": 0, "events": 0, "stale": 0, "evicted": 0}

    # ------------------------------------------------------------ workers

    def add_worker(self, worker_id: str, model: str, algo: str, block_size: int, seed: str = "") -> bool:
        """A worker registered (again: its old entries go).  True if its
        hashes can be matched: a supported scheme, the same as the model's
        other workers (the first registered sets the model's)."""
        self.remove_worker(worker_id)
        if algo not in SUPPORTED or block_size < 1:
            return False
        mi = self.models.get(model)
        hasher = BlockHasher(algo, block_size, seed)
        if mi is None:
            mi = self.models[model] = _ModelIndex(hasher)
        elif mi.hasher is None:
            mi.hasher = hasher
        elif mi.hasher.key != hasher.key:
            return False  # another scheme than its model's: cache-blind
        w = self.workers[worker_id] = _WorkerState(worker_id, model, self._new_bit(mi))
        mi.by_bit[w.bit] = w
        return True

    def remove_worker(self, worker_id: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            mi = self.models[w.model]
            self._retire(mi, w)
            if not any(x.model == w.model for x in self.workers.values()):
                # its last worker: the model's blocks go at once (a model removed
                # at run time would keep them; its next worker starts afresh)
                del self.models[w.model]

    def hasher(self, model: str) -> BlockHasher | None:
        mi = self.models.get(model)
        return mi.hasher if mi is not None else None

    def trusted(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.trusted

    # ------------------------------------------------------------ what workers say

    def snapshot(self, worker_id: str, seq: int, hashes: Iterable[int], trusted: bool = True) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        mi = self.models[w.model]
        self._retire(mi, w)  # whatever it said before is replaced
        w.bit = self._new_bit(mi)
        mi.by_bit[w.bit] = w
        w.seq = seq
        w.trusted = trusted
        w.unknown = not trusted
        self.counters["snapshots"] += 1
        if trusted:
            mi.live |= w.bit
            self._store(mi, w, hashes)

    def events(
        self, worker_id: str, seq: int, stored: Sequence[int], removed: Sequence[int], cleared: bool = False
    ) -> bool:
        """Apply one PrefixEvents.  False: out of order -- the worker is blind
        now and must be asked for a snapshot."""
        w = self.workers.get(worker_id)
        if w is None:
            return True  # not tracked (cache-blind scheme)
        if not w.trusted:
            if w.unknown and cleared:  # it recovers by clearing: an empty cache is known
                self.snapshot(worker_id, seq, stored)
                return True
            self.counters["stale"] += 1  # sent before the snapshot it was asked for
            return True
        if seq != w.seq + 1:
            self._blind(w)
            return False
        w.seq = seq
        self.counters["events"] += 1
        mi = self.models[w.model]
        if mi.sweeping is not None or mi.retired:
            self._sweep(mi, _SWEEP_STEP)
        if cleared:
            self.snapshot(worker_id, seq, stored)
            return True
        bit = w.bit
        blocks = mi.blocks
        for h in removed:
            m = blocks.get(h)
            if m is not None and m & bit:
                w.blocks -= 1
                m &= ~bit
                if m & mi.live:
                    blocks[h] = m
                else:
                    del blocks[h]
        self._store(mi, w, stored)
        return True

    def heard_seq(self, worker_id: str, seq: int) -> bool:
        """A heartbeat says the worker sent up to ``seq``.  True: ask it for a
        snapshot (a message was lost, or it is still awaited)."""
        w = self.workers.get(worker_id)
        if w is None or w.unknown:
            return False
        if not w.trusted:
            return True
        if seq > w.seq:
            self._blind(w)
            return True
        return False

    # ------------------------------------------------------------ placement

    def match(self, model: str, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Worker id -> how many leading blocks of ``hashes`` it holds
        (confirmed, or speculative and fresh); workers with none are absent."""
        mi = self.models.get(model)
        if mi is None or not hashes or not mi.live:
            return {}
        if mi.spec_queue and mi.spec_queue[0][0] <= now:
            self._expire(mi, now)
        blocks, spec, live = mi.blocks, mi.spec, mi.live
        alive = live
        got: dict[int, int] = {}
        i = 0
        for i, h in enumerate(hashes):
            m = blocks.pop(h, 0)
            if m:
                blocks[h] = m  # most recently used
            s = spec.get(h)
            if s is not None and s[1] > now:
                m |= s[0]
            m &= alive
            dropped = alive & ~m
            if dropped:
                for b in _bits(dropped):
                    if i:
                        got[b] = i
                alive = m
            if not alive:
                break
        else:
            for b in _bits(alive):
                got[b] = len(hashes)
        return {mi.by_bit[b].worker_id: n for b, n in got.items() if b in mi.by_bit}

    def speculate(self, worker_id: str, hashes: Sequence[int], now: float) -> None:
        """``worker_id`` was just given a prompt with these blocks."""
        w = self.workers.get(worker_id)
        if w is None or not w.trusted or not hashes or self.ttl <= 0:
            return
        mi = self.models[w.model]
        if mi.spec_queue and mi.spec_queue[0][0] <= now:
            self._expire(mi, now)  # first: an expired entry's bits must not join this one's
        exp = now + self.ttl
        bit = w.bit
        new = (bit, exp)  # (one tuple for all the blocks new here)
        spec = mi.spec
        get = spec.get
        for h in hashes:
            s = get(h)
            spec[h] = new if s is None else (s[0] | bit, exp)
        mi.spec_queue.append((exp, tuple(hashes)))

    # ------------------------------------------------------------ views

    def size(self, model: str | None = None) -> int:
        if model is not None:
            mi = self.models.get(model)
            return len(mi.blocks) if mi is not None else 0
        return sum(len(mi.blocks) for mi in self.models.values())

    def view(self) -> dict[str, Any]:
        """JSON-shaped: per model, per worker, and the counters."""
        return {
            "models": {
                name: {
                    "blocks": len(mi.blocks),
                    "speculative": len(mi.spec),
                    "evicted": mi.evicted,
                    "scheme": list(mi.hasher.key) if mi.hasher is not None else None,
                }
                for name, mi in self.models.items()
            },
            "workers": {
                w.worker_id: {
                    "model": w.model,
                    "trusted": w.trusted,
                    "blocks": w.blocks if w.trusted else 0,
                    "seq": w.seq,
                    "recoveries": w.recoveries,
                }
                for w in self.workers.values()
            },
            **self.counters,
        }

    # ------------------------------------------------------------ internals

    def _store(self, mi: _ModelIndex, w: _WorkerState, hashes: Iterable[int]) -> None:
        blocks, bit, live = mi.blocks, w.bit, mi.live
        for h in hashes:
            m = blocks.get(h)
            if m is None:
                blocks[h] = bit
                w.blocks += 1
            else:
                if not m & bit:
                    w.blocks += 1
                del blocks[h]
                blocks[h] = (m & live) | bit  # most recent; retired bits stripped as it goes
        over = len(blocks) - self.max_blocks
        if over > 0:  # in batches of 1/64 of the cap: popping a dict's head one at a time is quadratic
            self._evict(mi, max(over, self.max_blocks // 64))

    def _evict(self, mi: _ModelIndex, n: int) -> None:
        blocks, live, by_bit = mi.blocks, mi.live, mi.by_bit
        it = iter(blocks)
        victims = [next(it) for _ in range(min(n, len(blocks)))]
        for h in victims:
            m = blocks.pop(h) & live
            if m:
                for b in _bits(m):
                    by_bit[b].blocks -= 1
        mi.evicted += len(victims)
        self.counters["evicted"] += len(victims)

    def _blind(self, w: _WorkerState) -> None:
        mi = self.models[w.model]
        self._retire(mi, w)
        w.bit = self._new_bit(mi)
        mi.by_bit[w.bit] = w
        w.trusted = False
        w.recoveries += 1
        self.counters["recoveries"] += 1

    def _retire(self, mi: _ModelIndex, w: _WorkerState) -> None:
        bit = w.bit
        mi.live &= ~bit
        mi.by_bit.pop(bit, None)
        mi.retired.add(bit)
        w.blocks = 0
        if len(mi.blocks) + len(mi.spec) <= _EAGER_SWEEP_MAX and mi.sweeping is None:
            self._sweep(mi, _EAGER_SWEEP_MAX)

    def _sweep(self, mi: _ModelIndex, budget: int) -> None:
        """Strip retired bits from up to ``budget`` entries, confirmed then
        speculative (a burst's can be ~500k); once every entry that existed
        when the sweep began was visited, the bits are reused.  (Entries
        made since hold only bits live then: a retired bit is given to no one
        until it is freed here.)"""
        if mi.sweeping is None:
            if not mi.retired:
                return
            mi.sweeping = ([*mi.blocks, *mi.spec], len(mi.blocks), 0, list(mi.retired))
            mi.retired = set()
        keys, n_blocks, i, bits = mi.sweeping
        blocks, spec, live = mi.blocks, mi.spec, mi.live
        end = min(len(keys), i + budget)
        for h in keys[i : min(end, n_blocks)]:
            m = blocks.get(h)
            if m is not None and m & ~live:
                if m & live:
                    blocks[h] = m & live  # (an existing key keeps its place)
                else:
                    del blocks[h]
        for h in keys[max(i, n_blocks) : end]:
            s = spec.get(h)
            if s is not None and s[0] & ~live:
                if s[0] & live:
                    spec[h] = (s[0] & live, s[1])
                else:
                    del spec[h]  # (its queue entry finds it gone)
        if end < len(keys):
            mi.sweeping = (keys, n_blocks, end, bits)
            return
        mi.free_bits.extend(bits)
        mi.sweeping = None

    def _new_bit(self, mi: _ModelIndex) -> int:
        if mi.free_bits:
            return mi.free_bits.pop()
        bit = 1 << mi.next_bit
        mi.next_bit += 1
        return bit

    def _expire(self, mi: _ModelIndex, now: float) -> None:
        """Drop the blocks of the prompts whose speculation expired, each only if no
        later speculation of it (by any worker) is still fresh."""
        q, spec = mi.spec_queue, mi.spec
        get = spec.get
        while q and q[0][0] <= now:
            for h in q.popleft()[1]:
                s = get(h)
                if s is not None and s[1] <= now:
                    del spec[h]


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low
