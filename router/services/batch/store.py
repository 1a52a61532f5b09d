"""Batches on disk: each batch's state, its results, its cancel request.

``<dir>/batches/<id>/state.json`` is the batch (OpenAI's object plus what
its run needs: owner, key digest, line count), rewritten atomically
(router.services.batch.disk.write_atomic).  Results go straight into the output and
error files (``<dir>/files/<file id>.data``), one JSON line per request
line, appended and fsync'ed in groups; each result's ``id`` carries its
input line number, so after a crash the next run (router.services.batch.run) rebuilds which lines are done
from the files alone: a line whose result was written is never sent again,
and a torn last line (killed mid-write) is cut off.  ``cancel`` beside the
state is a request to cancel, written by whichever router got the call; the
router running the batch acts on it.

``fence`` beside the state holds the largest lease grant's fencing token
(router.services.batch.lease) that has written to the batch.  Every append to the
result files and every state write happens under its lock after checking
it (``Fence.hold``): a holder whose token is below it lost the batch to
another router and is refused (``StaleLease``) before it writes anything.

Memory per running batch: one bit per input line (125 KB a million lines).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import msgspec

from router.services.batch import rules as m
from router.services.batch.disk import new_id, write_atomic


class BatchError(msgspec.Struct):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchUsage(msgspec.Struct):
    """The tokens a batch's answered lines took (the batch object's ``usage``)."""

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
    usage: BatchUsage = msgspec.field(default_factory=BatchUsage)
    errors: list[BatchError] = []
    output_file_id: str  # allocated at create, shown once the batch ends with output
    error_file_id: str
    stamps: dict[str, int] = {}
    output_expires_after_s: int | None = None  # the output and error files expire this long after they are made

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


class StaleLease(RuntimeError):
    """Another router took the batch over (its grant is newer): write nothing more."""


class Fence:
    """One batch's fence: the largest fencing token that has written to it."""

    def __init__(self, path: Path, token: int) -> None:
        self.path = path
        self.token = token

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Under the fence's lock: refused if a newer grant has written; raised
        to this token if it is the newest.  Blocking: called on the I/O thread."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 32, 0).strip()
            seen = int(raw) if raw else 0
            if self.token < seen:
                raise StaleLease(f"fencing token {self.token} is stale: the batch is held under {seen}")
            if self.token > seen:
                data = b"%d\n" % self.token
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
                os.fsync(fd)
            yield
        finally:
            os.close(fd)  # (drops the lock)

    def claim(self) -> None:
        """The new holder raises the fence before it reads the batch: from here a stale holder writes nothing."""
        with self.hold():
            pass


class BatchIndex(Protocol):
    """What the store tells of each state it saves (router.services.batch.storage.StorageIndex)."""

    def put_batch(self, rec: BatchRecord) -> None: ...


class BatchStore:
    def __init__(self, directory: Path, index: BatchIndex | None = None) -> None:
        self.dir = directory / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = index  # told of every state saved (router.services.batch.storage)

    def path(self, batch_id: str) -> Path:
        return self.dir / batch_id

    def new(self, **fields: Any) -> BatchRecord:
        rec = BatchRecord(id=new_id("batch_"), output_file_id=new_id("file-"), error_file_id=new_id("file-"), **fields)
        self.path(rec.id).mkdir()
        try:
            self.save(rec)
        except BaseException:
            shutil.rmtree(self.path(rec.id), ignore_errors=True)  # (a full disk): no batch, no directory
            raise
        return rec

    def save(self, rec: BatchRecord, fence: Fence | None = None) -> None:
        """The state, atomically; with ``fence``, only by the batch's newest holder."""
        if fence is None:
            write_atomic(self.path(rec.id) / "state.json", _encoder.encode(rec))
        else:
            with fence.hold():
                write_atomic(self.path(rec.id) / "state.json", _encoder.encode(rec))
        if self.index is not None:
            self.index.put_batch(rec)

    def fence(self, batch_id: str, token: int) -> Fence:
        return Fence(self.path(batch_id) / "fence", token)

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


def disk_full(e: BaseException) -> bool:
    """The filesystem (or the user's quota on it) has no room: wait for some, it is nobody's fault."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def result_id(batch_id: str, line: int) -> str:
    """A result's ``id``: the batch and its input line (0-based), which recovery reads back."""
    return f"batch_req_{batch_id[6:]}_{line}"


_LINE_OF = re.compile(rb'"id": ?"batch_req_[0-9a-f]+_([0-9]+)"')


class _Tokens(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class _Body(msgspec.Struct):
    usage: _Tokens | None = None


class _Response(msgspec.Struct):
    body: _Body | None = None


class _Entry(msgspec.Struct):
    response: _Response | None = None


_entry_decoder = msgspec.json.Decoder(_Entry)


def line_usage(raw: bytes) -> tuple[int, int, int]:
    """A result line's (input, output, cached) tokens, as the result writer
    (router.services.batch.results) added them when it wrote the line."""
    try:
        resp = _entry_decoder.decode(raw).response
    except msgspec.DecodeError:
        return 0, 0, 0
    u = None if resp is None or resp.body is None else resp.body.usage
    if u is None:
        return 0, 0, 0
    return u.prompt_tokens, u.completion_tokens, (u.prompt_tokens_details or {}).get("cached_tokens", 0)


class ResultsTooLarge(Exception):
    """Appending would take a result file past its bound (``[batch] max_result_bytes``)."""


class ResultLog:
    """One output or error file, appended in whole lines and fsync'ed, up to ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.lines = 0
        self.usage = BatchUsage()  # of the lines read back by recover
        self._fd: int | None = None  # opened (O_APPEND) on first append

    def recover(self, done: bytearray) -> None:
        """Cut a torn last line, mark every written line in ``done`` (a
        bitmap), count them (``lines``) and add up their tokens (``usage``).
        Streams the file: memory is the bitmap's."""
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
                i, o, c = line_usage(raw)
                self.usage.input_tokens += i
                self.usage.output_tokens += o
                self.usage.cached_tokens += c
            if good != pos:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())

    def append(self, lines: list[bytes]) -> None:
        """Whole lines, then fsync: on return they survive a crash.  An
        OSError (disk full) propagates with the file as it was before the
        call, so the same lines can be appended again later.  Unbuffered: no
        byte of a failed call is left in a buffer to be written later.
        ResultsTooLarge if they would take the file past ``max_bytes``: none is written."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fd = self._fd
        start = os.fstat(fd).st_size
        data = b"".join(lines)
        if self.max_bytes is not None and start + len(data) > self.max_bytes:
            raise ResultsTooLarge(
                f"The batch's results would pass {self.max_bytes} bytes in {self.path.name} "
                "(batch.max_result_bytes); what was written is kept."
            )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]  # a short write (disk filling up): the rest, or ENOSPC
            os.fsync(fd)
        except OSError:
            try:  # leave no partial line behind
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
        self.lines += len(lines)

    def touch(self) -> None:
        self.path.touch()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def is_done(done: bytearray, line: int) -> bool:
    return bool(done[line // 8] & (1 << (line % 8)))


def mark_done(done: bytearray, line: int) -> None:
    done[line // 8] |= 1 << (line % 8)
