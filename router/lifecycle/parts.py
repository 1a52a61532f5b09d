"""What the core shares with its helpers (router.lifecycle.intake, router.lifecycle.recovery).

``RouterCore`` builds one ``CoreParts`` and hands it to each helper, so the
helpers read the core's state through one object instead of a constructor
argument apiece.  The parts are the core's: the helpers change the job table
and ask the policy and budgets, but never replace a part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from router.lifecycle.jobs import JobRecord
from router.lifecycle.models import ModelRegistry
from router.lifecycle.ports import WorkerPort
from router.observe.metrics import RouterMetrics
from router.policy import Policy
from router.tenancy.budgets import BudgetLedger
from shared import protocol as p
from shared.config import RouterConfig


class EndJob(Protocol):
    """The core's one exit (router.lifecycle.core.RouterCore._end)."""

    def __call__(
        self,
        j: JobRecord,
        outcome: str,
        *,
        error: p.ErrorInfo | None = None,
        deltas: list[p.Delta] | None = None,
        abort_worker: str | None = None,
    ) -> None: ...


@dataclass(frozen=True, slots=True, eq=False)
class CoreParts:
    jobs: dict[str, JobRecord]  # every live job (its one owner is the core)
    registry: ModelRegistry
    policy: Policy
    quota: BudgetLedger
    workers: WorkerPort
    metrics: RouterMetrics
    cfg: RouterConfig
    clock: Callable[[], float]
    end: EndJob  # the core's one exit
    schedule: Callable[[], None]  # ask for a policy pass (at most one pending)
