"""Helpers for the in-process batch tests: a batch as a router finds it running."""

from __future__ import annotations

import time

from router.services.batch import rules as m
from router.services.batch.store import BatchRecord, BatchStore


def in_progress_batch(store: BatchStore, owner: str, lines: int) -> BatchRecord:
    """A new completions batch of ``lines`` lines in ``store``, moved to in_progress
    (its input file is not read: the tests feed its lines by hand)."""
    now = int(time.time())
    rec = store.new(
        owner=owner,
        key_digest="",
        input_file_id="file-" + "0" * 24,
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=now,
        expires_at=now + 86400,
    )
    rec.move(m.IN_PROGRESS)
    rec.total = rec.input_lines = lines
    return rec
