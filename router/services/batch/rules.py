"""The batch tier's pure parts: statuses and their moves, windows, the feeder's decision.

No I/O here: the store (router.services.batch.store) persists what these decide, a
batch's run (router.services.batch.run's BatchRun, over its LineFeeder and
ResultWriter) acts on it.  OpenAI's statuses, in the order a batch moves through them:

  validating -> in_progress -> finalizing -> completed
  validating -> failed                       (not JSONL, custom_id missing or repeated)
  in_progress -> cancelling -> cancelled     (feeding stops; running lines finish)
  in_progress | cancelling -> expired        (the completion window passed)
  in_progress | finalizing -> failed         (results could not be written; a full disk only pauses)
"""

from __future__ import annotations

import re
from typing import NamedTuple

from shared.errors import Code

VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"

TERMINAL = frozenset((COMPLETED, FAILED, EXPIRED, CANCELLED))
_MOVES: dict[str, frozenset[str]] = {
    VALIDATING: frozenset((IN_PROGRESS, FAILED, CANCELLING, CANCELLED, EXPIRED)),
    IN_PROGRESS: frozenset((FINALIZING, CANCELLING, EXPIRED, FAILED)),
    FINALIZING: frozenset((COMPLETED, FAILED)),
    CANCELLING: frozenset((CANCELLED, EXPIRED, FAILED)),
}
# The timestamp field of the batch object each status sets (OpenAI's names).
STAMP = {
    IN_PROGRESS: "in_progress_at",
    FINALIZING: "finalizing_at",
    COMPLETED: "completed_at",
    FAILED: "failed_at",
    EXPIRED: "expired_at",
    CANCELLING: "cancelling_at",
    CANCELLED: "cancelled_at",
}

# The endpoints a batch may name; an endpoint the router does not serve is refused at create.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class BadMove(ValueError):
    pass


def can_move(status: str, to: str) -> bool:
    return to in _MOVES.get(status, frozenset())


def check_move(status: str, to: str) -> None:
    if not can_move(status, to):
        raise BadMove(f"batch status {status!r} cannot become {to!r}")


_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int | None:
    """``"24h"`` -> 86400; None if it is not <n><s|m|h|d>."""
    m = _WINDOW.match(window)
    return None if m is None else int(m.group(1)) * _UNIT_S[m.group(2)]


# Refusals a live client would retry: a batch line waits and tries again
# (its deadline is the completion window), it never fails for them.  Every
# "this router cannot take it now" (503: draining, no worker yet, a worker
# or engine lost, the budget store down) is one; only a refusal about the
# line itself fails it.
_RETRY_CODES = frozenset(
    (
        Code.QUEUE_FULL,
        Code.TENANT_QUEUE_FULL,
        Code.QUEUE_WAIT_EXCEEDED,
        Code.TENANT_SHARE_EXCEEDED,
        Code.REQUESTS_BUDGET,
        Code.TOKENS_BUDGET,
        Code.NO_WORKER,
        Code.MODEL_UNLOADING,
        Code.QUEUE_DEADLINE,
        Code.WORKER_LOST,
        Code.ENGINE_UNAVAILABLE,
        Code.QUOTA_UNAVAILABLE,
        Code.SERVICE_UNAVAILABLE,
        Code.ROUTER_DRAINING,
        Code.TOKENIZER_BUSY,  # (a /tokenize call's, not a batch line's: every 503 means "not now")
    )
) | frozenset(c for c in Code if c.status == 503)  # and any 503 added later (tokenizer_busy, ...)
_RETRY_WIRE = {(c.status, c.wire, c.type) for c in _RETRY_CODES}


def retryable(status: int, code: str | None, type_: str) -> bool:
    """A line refused this way goes back to wait, not to the error file."""
    return (status, code, type_) in _RETRY_WIRE


class FeedState(NamedTuple):
    """What the feeder knows when it decides how many lines to send now."""

    in_flight: int  # lines submitted and not ended
    queued: int  # of those, still waiting in the router's queue (not dispatched)
    window: int  # [batch] max_in_flight
    queue_target: int  # [batch] queued_target: lines kept waiting, ready for a freed slot


def lines_to_send(s: FeedState) -> int:
    """How many lines to submit now: keep ``queue_target`` waiting in the
    router's queue (so a slot the interactive classes leave free is taken at
    the next scheduling pass) without holding more than ``window`` in flight.
    The queue stays short whatever the batch's size: a million-line file costs
    the router at most ``window`` jobs."""
    room = s.window - s.in_flight
    want = s.queue_target - s.queued
    return max(0, min(room, want))


def eta_seconds(done: int, total: int, elapsed_s: float) -> float | None:
    """Remaining lines over the rate so far; None before any line finished."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, (total - done) * elapsed_s / done)


class DayBudget:
    """A tenant's ``batch_tokens_per_day``: a bucket of N tokens refilled at
    N/86,400 per second, charged with each finished line's tokens.  Lines are
    sent while it holds any (a line in flight may take it below zero: at most
    the window's worth), so an exhausted tenant's batches wait, not fail."""

    __slots__ = ("capacity", "level", "at")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(float(self.capacity), self.level + (now - self.at) * self.capacity / 86400.0)
        self.at = now

    def allows(self, now: float) -> bool:
        self._refill(now)
        return self.level > 0

    def charge(self, tokens: int, now: float) -> None:
        self._refill(now)
        self.level -= tokens
