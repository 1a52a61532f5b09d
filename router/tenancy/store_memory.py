"""The budget store in this process (``[quota] store = "memory"``, the default).

Bucket levels for one router: its own module because it is pure (the clock
goes in, no I/O), so the ledger answers at once and tests can drive it with
any clock; router.tenancy.store_redis is the same for several routers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from router.tenancy.buckets import Bucket, Reserved


class MemoryBudgetStore:
    """Buckets in this process: pure (a clock goes in), no I/O."""

    sync: Literal[True] = True

    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float]] = {}  # key -> (level, at)

    def level(self, b: Bucket, now: float) -> float:
        s = self.state.get(b.key)
        if s is None:
            return float(b.cap)
        level, at = s
        return min(float(b.cap), level + (now - at) * b.rate) if now > at else min(float(b.cap), level)

    def reserve(self, buckets: tuple[Bucket, ...], amounts: Sequence[int], now: float) -> Reserved:
        """(True, None, levels after) or (False, (index of the binding bucket, wait s), levels)."""
        levels = [self.level(b, now) for b in buckets]
        worst, worst_i = -1.0, -1
        for i, (b, level, cost) in enumerate(zip(buckets, levels, amounts)):
            if level < cost:
                wait = (cost - level) / b.rate
                if wait > worst:
                    worst, worst_i = wait, i
        if worst_i >= 0:
            return False, (worst_i, worst), levels
        after: list[float] = []
        for b, level, cost in zip(buckets, levels, amounts):
            self.state[b.key] = (level - cost, now)
            after.append(level - cost)
        return True, None, after

    def credit(self, buckets: tuple[Bucket, ...], amounts: Sequence[int], now: float) -> None:
        for b, amount in zip(buckets, amounts):
            if amount:
                self.state[b.key] = (min(float(b.cap), self.level(b, now) + amount), now)
