"""The worker's account of which LoRA adapters its engine holds, for its heartbeats.

vLLM keeps up to ``max_cpu_loras`` adapters loaded in host memory and the
``max_loras`` of them that the latest steps used in its slots, each least
recently used out first; every request under an adapter touches it.  The
worker mirrors that from the requests it starts (no call into the engine):
the ``max_loras`` most recently started adapters are reported in slots, the
rest of the ``max_cpu_loras`` most recent in the cache.  Pure, no vLLM import.
"""

from __future__ import annotations

from collections import OrderedDict

from shared.protocol import LoraHeld


class LoraCache:
    def __init__(self, slots: int, cache: int) -> None:
        self.slots = slots
        self.cache = max(cache, slots)
        self._order: OrderedDict[int, None] = OrderedDict()  # adapter ids, least recently used first

    def touch(self, lora_id: int) -> None:
        """A request under ``lora_id`` started."""
        self._order[lora_id] = None
        self._order.move_to_end(lora_id)
        while len(self._order) > self.cache:
            self._order.popitem(last=False)

    def held(self) -> LoraHeld | None:
        """What a heartbeat reports (None: nothing held, the field is left out)."""
        if not self._order:
            return None
        ids = list(self._order)
        return LoraHeld(slot=ids[-self.slots :], cache=ids[: -self.slots], slots=self.slots)
