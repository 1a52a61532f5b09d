"""Batches on disk: each batch's state, its results, its cancel request.

``<dir>/batches/<id>/state.json`` is the batch (OpenAI's object plus what
the runner needs: owner, key digest, line count), rewritten atomically
(router.batch.files.write_atomic).  Results go straight into the output and
error files (``<dir>/files/<file id>.data``), one JSON line per request
line, appended and fsync'ed in groups; each result's ``id`` carries its
input line number, so after a crash the runner rebuilds which lines are done
from the files alone: a line whose result was written is never sent again,
and a torn last line (killed mid-write) is cut off.  ``cancel`` beside the
state is a request to cancel, written by whichever router got the call; the
router running the batch acts on it.

Memory per running batch: one bit per input line (125 KB a million lines).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import IO, Any

import msgspec

from router.batch import model as m
from router.batch.files import new_id, write_atomic


class BatchError(msgspec.Struct):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class Usage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    def public(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


class BatchRecord(msgspec.Struct, kw_only=True):
    id: str
    owner: str  # tenant
    key_digest: str  # SHA-256 of the creator's API key ("" without keys): its lines run as that key
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = m.VALIDATING
    metadata: dict[str, str] | None = None
    total: int = 0  # requests (non-blank lines)
    input_lines: int = 0  # lines of the input file, blank ones included
    completed: int = 0
    failed: int = 0
    usage: Usage = msgspec.field(default_factory=Usage)
    errors: list[BatchError] = []
    output_file_id: str  # allocated at create, shown once the batch ends with output
    error_file_id: str
    stamps: dict[str, int] = {}

    def move(self, to: str, now: float | None = None) -> None:
        m.check_move(self.status, to)
        self.status = to
        self.stamps[m.STAMP[to]] = int(time.time() if now is None else now)

    def public(self) -> dict[str, Any]:
        ended = self.status in m.TERMINAL
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": [msgspec.to_builtins(e) for e in self.errors]}
            if self.errors
            else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id if ended and self.completed else None,
            "error_file_id": self.error_file_id if ended and self.failed else None,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": self.usage.public(),
            "metadata": self.metadata,
        }
        for stamp in m.STAMP.values():
            obj[stamp] = self.stamps.get(stamp)
        return obj


_decoder = msgspec.json.Decoder(BatchRecord)
_encoder = msgspec.json.Encoder()


class BatchStore:
    def __init__(self, directory: Path) -> None:
        self.dir = directory / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, batch_id: str) -> Path:
        return self.dir / batch_id

    def new(self, **fields: Any) -> BatchRecord:
        rec = BatchRecord(id=new_id("batch_"), output_file_id=new_id("file-"), error_file_id=new_id("file-"), **fields)
        self.path(rec.id).mkdir()
        self.save(rec)
        return rec

    def save(self, rec: BatchRecord) -> None:
        write_atomic(self.path(rec.id) / "state.json", _encoder.encode(rec))

    def load(self, batch_id: str) -> BatchRecord | None:
        if not re.fullmatch(r"batch_[0-9a-f]{24}", batch_id):
            return None
        try:
            return _decoder.decode((self.path(batch_id) / "state.json").read_bytes())
        except (OSError, msgspec.DecodeError):
            return None

    def ids(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.dir) if e.name.startswith("batch_"))
        except OSError:
            return []

    def request_cancel(self, batch_id: str) -> None:
        write_atomic(self.path(batch_id) / "cancel", b"1")

    def cancel_requested(self, batch_id: str) -> bool:
        return (self.path(batch_id) / "cancel").exists()


def result_id(batch_id: str, line: int) -> str:
    """A result's ``id``: the batch and its input line (0-based), which recovery reads back."""
    return f"batch_req_{batch_id[6:]}_{line}"


_LINE_OF = re.compile(rb'"id": ?"batch_req_[0-9a-f]+_([0-9]+)"')


class ResultsTooLarge(Exception):
    """Appending would take a result file past its bound (``[batch] max_result_bytes``)."""


class ResultLog:
    """One output or error file, appended in whole lines and fsync'ed, up to ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.lines = 0
        self._f: IO[bytes] | None = None  # opened on first append

    def recover(self, done: bytearray) -> None:
        """Cut a torn last line, mark every written line in ``done`` (a
        bitmap) and count them (``lines``).  Streams the
        file: memory is the bitmap's."""
        if not self.path.exists():
            return
        with open(self.path, "r+b") as f:
            good = 0
            pos = 0
            for raw in f:
                pos += len(raw)
                if not raw.endswith(b"\n"):
                    break  # torn: written by a router killed mid-append
                good = pos
                hit = _LINE_OF.search(raw)
                if hit is not None:
                    line = int(hit.group(1))
                    if line // 8 < len(done):
                        done[line // 8] |= 1 << (line % 8)
                self.lines += 1
            if good != pos:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())

    def append(self, lines: list[bytes]) -> None:
        """Whole lines, then fsync: on return they survive a crash.  An
        OSError (disk full) propagates; what was written before stays.
        ResultsTooLarge if they would take the file past ``max_bytes``: none is written."""
        if self._f is None:
            self._f = open(self.path, "ab")
        f = self._f
        start = f.tell()
        data = b"".join(lines)
        if self.max_bytes is not None and start + len(data) > self.max_bytes:
            raise ResultsTooLarge(
                f"The batch's results would pass {self.max_bytes} bytes in {self.path.name} "
                "(batch.max_result_bytes); what was written is kept."
            )
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            try:  # leave no partial line behind
                f.truncate(start)
            except OSError:
                pass
            raise
        self.lines += len(lines)

    def touch(self) -> None:
        self.path.touch()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def is_done(done: bytearray, line: int) -> bool:
    return bool(done[line // 8] & (1 << (line % 8)))


def mark_done(done: bytearray, line: int) -> None:
    done[line // 8] |= 1 << (line % 8)
