"""Adapter-aware placement: which LoRA adapters each worker holds, and how
much a worker holding a job's adapter is preferred.

A worker reports in its heartbeats the adapters its engine holds in its
slots (vLLM's ``max_loras``: usable in the next step at no cost) and in its
host-memory cache (``max_cpu_loras``: a copy into a slot away), as
``WorkerStats.loras``.  For a job under an adapter, placement adds to a
worker's load score (a load scorer of router.policy.placement: 0..2, least loaded highest):

- ``HELD_SLOT`` if the adapter is in one of its slots;
- ``HELD_CACHE`` if it is in its cache;
- ``FREE_SLOT`` if it has a slot no adapter uses (a load, but no eviction);
- nothing otherwise: a load from disk that evicts the least recently used.

The bonuses are below the score's range, so a busy holder still loses to an
idle worker (the load is then paid once, and the adapter is held in two
places).  A worker that must load an adapter it does not hold takes it only
while fewer than ``max_loads`` such loads are in flight there: a load counts
from its dispatch until a heartbeat reports the adapter held (or
``LOAD_TIMEOUT_S`` passed).  A job whose adapter no worker of its model
holds or is loading has one load (``load_s``) added to its predicted wait
(router.policy.admission).  In a large fleet, where placement scores a sample
of workers, the workers holding or loading the job's adapter (``holders``,
at most ``HOLDERS_SAMPLED``) are scored too.  Pure: no I/O, the caller's clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.policy.placement.ask import Ask, Candidate
    from router.policy.placement.scorers import Scorer

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from shared.protocol import LoraHeld

HELD_SLOT = 1.0
HELD_CACHE = 0.6
FREE_SLOT = 0.3
LOAD_TIMEOUT_S = 30.0  # a load never confirmed stops counting (a lost heartbeat, an engine that failed it)
HOLDERS_SAMPLED = 4  # holders added to a large fleet's placement sample (as many as it draws)


@dataclass(slots=True)
class _Worker:
    slot: frozenset[int] = frozenset()  # adapter ids in the engine's slots
    cache: frozenset[int] = frozenset()  # ... in its host-memory cache (slots not included)
    slots: int = 0  # max_loras (0: not reported)
    loading: dict[int, float] = field(default_factory=dict)  # adapter id -> when its load was dispatched


class AdapterPlacement:
    def __init__(self, max_loads: int = 1, enabled: bool = True, load_s: float = 0.0) -> None:
        self.max_loads = max(1, max_loads)
        self.load_s = load_s  # what one load from disk adds to a job's wait (scheduler.adapter_load_s)
        self.enabled = enabled
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[int, set[str]] = {}  # adapter id -> workers holding it (slot, cache) or loading it
        self.loads = 0  # dispatches that needed a load (not held where they went)
        self.new_loads: list[int] = []  # their adapters since the caller last took them (metrics)

    def report(self, worker_id: str, held: LoraHeld | None, now: float) -> list[int]:
        """A heartbeat's adapters (None: it holds none, or runs no LoRA); the adapters it
        held before and holds no more (evicted)."""
        w = self._workers.get(worker_id)
        if held is None:
            if w is None:
                return []
            gone = sorted(w.slot | w.cache)
            had = w.slot | w.cache | w.loading.keys()
            w.slot = w.cache = frozenset()
            self._expire(w, now)
            self._reindex(worker_id, had, w)
            return gone
        if w is None:
            w = self._workers[worker_id] = _Worker()
        before = w.slot | w.cache
        had = before | w.loading.keys()
        w.slot, w.cache, w.slots = frozenset(held.slot), frozenset(held.cache), held.slots
        gone = sorted(before - w.slot - w.cache)
        for lora in [x for x in w.loading if x in w.slot or x in w.cache]:
            del w.loading[lora]  # loaded
        self._expire(w, now)
        self._reindex(worker_id, had, w)
        return gone

    def _reindex(self, worker_id: str, had: AbstractSet[int], w: _Worker | None) -> None:
        """``_holders`` after ``worker_id``'s adapters went from ``had`` to ``w``'s (None: gone)."""
        has: AbstractSet[int] = (w.slot | w.cache | w.loading.keys()) if w is not None else frozenset()
        holders = self._holders
        for lora in had - has:
            s = holders.get(lora)
            if s is not None:
                s.discard(worker_id)
                if not s:
                    del holders[lora]
        for lora in has - had:
            holders.setdefault(lora, set()).add(worker_id)

    def holders(self, lora: int) -> list[str]:
        """Up to HOLDERS_SAMPLED workers holding adapter ``lora`` or loading it (for a placement sample)."""
        s = self._holders.get(lora)
        if not s:
            return []
        return list(s) if len(s) <= HOLDERS_SAMPLED else list(islice(s, HOLDERS_SAMPLED))

    def take_loads(self) -> list[int]:
        """The adapters of the loads dispatched since the last call (for metrics)."""
        out, self.new_loads = self.new_loads, []
        return out

    @staticmethod
    def _expire(w: _Worker, now: float) -> None:
        for lora in [x for x, t in w.loading.items() if now - t > LOAD_TIMEOUT_S]:
            del w.loading[lora]

    def bonus(self, worker_id: str, lora: int) -> float | None:
        """What ``worker_id`` adds to its score for a job under adapter ``lora``;
        None: it may not take it now (too many loads in flight there)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0.0  # nothing reported yet: a load like any
        if lora in w.slot:
            return HELD_SLOT
        if lora in w.cache:
            return HELD_CACHE
        if lora not in w.loading and len(w.loading) >= self.max_loads:
            return None
        if lora in w.loading:
            return HELD_CACHE  # on its way: joining it costs no second load
        return FREE_SLOT if len(w.slot) < w.slots else 0.0

    def load_wait(self, worker_ids: Iterable[str], lora: int) -> float:
        """What a job under ``lora`` waits for its adapter beyond its place in the queue:
        nothing if one of ``worker_ids`` (its model's) holds it or is loading it, else one load."""
        for wid in worker_ids:
            w = self._workers.get(wid)
            if w is not None and (lora in w.slot or lora in w.cache or lora in w.loading):
                return 0.0
        return self.load_s

    def admissible(self, cands: list[Candidate], lora: int) -> list[Candidate]:
        """The placement candidates that may take a job of adapter ``lora`` now
        (a worker at its bound of loads in flight may not)."""
        bonus = self.bonus
        return [c for c in cands if bonus(c[0].spec.worker_id, lora) is not None]

    def scorer(self, lora: int) -> Scorer:
        """A load scorer of the placement pipeline: each candidate's ``bonus``
        (held in a slot, cached, a free slot, or an eviction)."""
        bonus = self.bonus

        def adapter_held(ask: Ask, cands: list[Candidate]) -> list[float]:
            return [bonus(w.spec.worker_id, lora) or 0.0 for w, _, _, _ in cands]

        return adapter_held

    def dispatched(self, worker_id: str, lora: int, now: float) -> None:
        """A job under ``lora`` went to ``worker_id``: a load if it does not hold it (or load it already)."""
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker()
        if lora in w.slot or lora in w.cache or lora in w.loading:
            return
        w.loading[lora] = now
        self._holders.setdefault(lora, set()).add(worker_id)
        self.loads += 1
        self.new_loads.append(lora)

    def remove_worker(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._reindex(worker_id, w.slot | w.cache | w.loading.keys(), None)

    def view(self, worker_id: str) -> dict[str, Any]:
        """A worker's adapters for /admin/workers ({}: it never reported any)."""
        if worker_id not in self._workers:
            return {}
        slot, cache, loading = self.held(worker_id)
        return {"adapters": {"slot": slot, "cache": cache, "loading": loading}}

    def held(self, worker_id: str) -> tuple[list[int], list[int], list[int]]:
        """(in slots, in cache, loading) of a worker, for views and tests."""
        w = self._workers.get(worker_id)
        if w is None:
            return [], [], []
        return sorted(w.slot), sorted(w.cache), sorted(w.loading)
