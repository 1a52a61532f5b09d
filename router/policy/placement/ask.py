"""What one placement asks of a worker, and a worker that can give it.

``Ask`` is set once per placement: the job's demand and the bounds it is
placed under, read by every filter and scorer.  A ``Candidate`` is a worker
that passed the worker filters, with what the job would cost and leave there."""

from __future__ import annotations

from router.policy.model import ModelState
from router.policy.records import Entry, WorkerState

# (worker, the job's KV cost there, KV tokens held there once placed, sequences held there now)
Candidate = tuple[WorkerState, int, int, int]


class Ask:
    """One job's placement: its demand, the bounds, and what the filters
    found on the way (``kv_short``: a worker lacked only KV, so another draw
    may find one that has it)."""

    __slots__ = (
        "m",
        "e",
        "size",
        "prompt",
        "limit",
        "exclude",
        "hits",
        "kv_short",
    )

    def __init__(self, m: ModelState, e: Entry, exclude: set[str], limit: float, hits: dict[str, int] | None) -> None:
        self.reset(m, e, exclude, limit, hits)

    def reset(self, m: ModelState, e: Entry, exclude: set[str], limit: float, hits: dict[str, int] | None) -> None:
        """For the next placement: a strategy keeps one ``Ask`` (an allocation
        less at every dispatch)."""
        prompt = e.job.prompt_tokens
        self.m = m
        self.e = e
        self.size = e.size
        self.prompt = prompt if prompt > 1 else 1  # max(1, ...), without the call
        self.limit = limit  # the class's cap: fraction of KV budget and seq slots it may fill
        self.exclude = exclude  # workers held for a due head
        self.hits = hits  # worker id -> leading prompt blocks its cache holds (None: no affinity)
        self.kv_short = False
