"""When stored files and batches go: ``expires_after``, ``output_expires_after``
and the retention of ended batches.  Pure: the reaper (router.services.batch.storage)
acts on what these decide.

OpenAI's shape for both fields is ``{"anchor": "created_at", "seconds": N}``
with N from one hour to 30 days; a file's ``expires_at`` is its
``created_at`` + N (a batch's output and error files: when they are made,
at the batch's end).
"""

from __future__ import annotations

from router.services.batch import rules as m

ANCHORS = ("created_at",)
MIN_S = 3600
MAX_S = 2_592_000


def expires_after_seconds(anchor: object, seconds: object) -> int | str:
    """The seconds asked for, or why they cannot be (the message of a 400)."""
    if anchor not in ANCHORS:
        return f"anchor must be one of {', '.join(ANCHORS)}; got {anchor!r}"
    if isinstance(seconds, str) and seconds.strip().isdigit():  # a multipart form field
        seconds = int(seconds.strip())
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        return f"seconds must be an integer; got {seconds!r}"
    if not MIN_S <= seconds <= MAX_S:
        return f"seconds must be between {MIN_S} and {MAX_S}; got {seconds}"
    return seconds


def expired(expires_at: int | None, now: float) -> bool:
    """Gone from ``expires_at`` on (404, then deleted); None: kept until deleted."""
    return expires_at is not None and now >= expires_at


def ended_at(status: str, stamps: dict[str, int]) -> int | None:
    """When a batch reached its end status; None while it runs."""
    if status not in m.TERMINAL:
        return None
    return stamps.get(m.STAMP[status])


def batch_reapable(status: str, stamps: dict[str, int], created_at: int, now: float, retention_s: float) -> bool:
    """An ended batch's directory goes ``retention_s`` after its end (a record
    without its end stamp: after its creation)."""
    if status not in m.TERMINAL:
        return False
    end = ended_at(status, stamps)
    return now >= (created_at if end is None else end) + retention_s
