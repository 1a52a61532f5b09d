"""A model's state inside the policy, one record per concern."""

from __future__ import annotations

from router.policy.queues import ModelQueues
from router.policy.records import FreeSlots, WorkerState
from router.policy.totals import AdmissionTotals, CapacityGroup


class ModelState:
    """One model: its workers, their free slots, its queues, the admission
    totals over them, and the capacity model's cache."""

    __slots__ = ("name", "workers", "pools", "eligible", "free", "capacity", "queues", "totals")

    def __init__(self, name: str, n_classes: int) -> None:
        self.name = name
        # The worker registry, by id (sorted: ties in placement go to the lowest).
        self.workers: dict[str, WorkerState] = {}
        self.pools: set[int] = set()  # the pools its workers are of (placement skips pool rules with "any" alone)
        # per size: the workers a job of that size may ever use (admission's
        # checks); None after a worker came or went
        self.eligible: dict[int, list[WorkerState]] | None = None
        self.free = FreeSlots()
        # the capacity model's inputs, workers grouped by what they registered
        # with (wait_model.capacity_rate); None after a change
        self.capacity: list[CapacityGroup] | None = None
        self.queues = ModelQueues(n_classes)
        self.totals = AdmissionTotals(n_classes)

    def fleet_changed(self, now: float) -> None:
        """A worker came or went: drop what was derived from the fleet."""
        self.eligible = None
        self.capacity = None
        self.pools = {w.pool for w in self.workers.values()}
        self.totals.remeasure(now)
