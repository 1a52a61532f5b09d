"""A model's state inside the policy, one record per concern."""

from __future__ import annotations

from router.policy.occupancy import Occupancy
from router.policy.queues import ModelQueues
from router.policy.records import FreeSlots, WorkerState
from router.policy.wait_model import AdmissionTotals, CapacityGroup


class ModelState:
    """One model: its workers, their free slots, its queues, the admission
    totals over them, and the capacity model's cache."""

    __slots__ = ("name", "workers", "eligible", "free", "occupancy", "shape", "capacity", "queues", "totals")

    def __init__(self, name: str, n_classes: int) -> None:
        self.name = name
        # The worker registry, by id (sorted: ties in placement go to the lowest).
        self.workers: dict[str, WorkerState] = {}
        # per size: the workers a job of that size may ever use (admission's
        # checks); None after a worker came or went
        self.eligible: dict[int, list[WorkerState]] | None = None
        self.free = FreeSlots()
        self.occupancy = Occupancy()  # the fewest seqs / least KV room among them
        # (seq slots if every worker has the same, else -1; largest KV block
        # size): what placement's shortcut needs; None after a change
        self.shape: tuple[int, int] | None = None
        # the capacity model's inputs, workers grouped by what they registered
        # with (wait_model.capacity_rate); None after a change
        self.capacity: list[CapacityGroup] | None = None
        self.queues = ModelQueues(n_classes)
        self.totals = AdmissionTotals(n_classes)

    def fleet_changed(self, now: float) -> None:
        """A worker came or went: drop what was derived from the fleet."""
        self.eligible = None
        self.shape = None
        self.capacity = None
        self.totals.remeasure(now)

    def fleet_shape(self) -> tuple[int, int]:
        """(seq slots shared by every worker, or -1 if they differ; the largest KV block size)."""
        if self.shape is None:
            slots = {w.slots for w in self.workers.values()}
            block = max((w.spec.block_size for w in self.workers.values()), default=1)
            self.shape = (slots.pop() if len(slots) == 1 else -1, max(1, block))
        return self.shape
