"""One running batch's writes: its result entries, its end files and its state, under its fence.

``ResultWriter`` is the disk side of a run (router.services.batch.run.BatchRun
decides, router.services.batch.feeder.LineFeeder feeds).  It keeps which
input lines are done (a bitmap rebuilt from the result files alone:
``recover``), turns each line's end into an entry of the output or error
file (``ok``, ``error``), and appends them and fsyncs them on the batch I/O
thread, in groups (router.services.batch.store.ResultLog),
each group -- and each state write (``save``), the entries of an expiry or a
revocation (``write_unfinished``) and the files' registration (``register``)
-- under the batch's fence (router.services.batch.store.Fence): a run whose lease
another router has taken over is refused there and stops, writing nothing.
The counts a group adds (completed, failed, tokens) go into the record once
that group is on disk, never before.

A full disk (ENOSPC, EDQUOT) is nobody's fault, least of all this batch's:
the entries not written stay in memory (at most the window's lines), the run
sends no new line (``paused``), and the write is tried again every
``retry_s`` until it succeeds; then the run is told to resume.  Any other
write failure fails the batch (through the run: ``fail``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec

from router import api
from router.services.batch.store import (
    BatchRecord,
    ResultLog,
    ResultsTooLarge,
    StaleLease,
    disk_full,
    is_done,
    mark_done,
    result_id,
)
from router.services.batch.validate import decode_line
from shared import protocol as p

if TYPE_CHECKING:
    from router.services.batch.host import BatchHost

log = logging.getLogger("weir.batch")

GROUP_WAIT_S = 0.05  # results wait at most this long for their group's fsync
UNFINISHED_CHUNK = 4096  # expiry/revocation entries appended at once


class _UsageOnly(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class _BodyUsage(msgspec.Struct):
    usage: _UsageOnly | None = None


_usage_decoder = msgspec.json.Decoder(_BodyUsage)
_encode = msgspec.json.Encoder().encode


class ResultWriter:
    """Everything one run writes for its batch, in order, on the host's I/O thread."""

    def __init__(
        self,
        host: BatchHost,
        rec: BatchRecord,
        token: int,
        *,
        resume: Callable[[], None],
        fail: Callable[[str, str], Coroutine[Any, Any, None]],
        stale: Callable[[StaleLease], None],
    ) -> None:
        self.rec = rec
        self._host = host
        self._resume = resume  # room came back: the run feeds again
        self._fail = fail  # a write failed for good: the run fails the batch
        self._stale = stale  # the fence refused a group: the run stops
        bcfg = host.bcfg
        self.retry_s = bcfg.retry_s
        self.input_path = host.files.data_path(rec.input_file_id)
        self.out = ResultLog(host.files.data_path(rec.output_file_id), bcfg.max_result_bytes)
        self.err = ResultLog(host.files.data_path(rec.error_file_id), bcfg.max_result_bytes)
        self.fence = host.store.fence(rec.id, token)  # token: this router's lease grant (router.services.batch.lease)
        self.done = bytearray()
        self._out_buf: list[bytes] = []
        self._err_buf: list[bytes] = []
        self._flushing: asyncio.Future[Any] | None = None
        self.write_failed = False  # the batch fails: nothing more is written
        self._flush_timer: asyncio.TimerHandle | None = None
        self._pending = [0, 0, 0, 0, 0]  # unflushed: completed, failed, input, output, cached tokens
        self.dirty = True  # the record has changes not yet saved
        self.disk_full_since: float | None = None  # writes fail for want of room: feeding waits
        self._unfinished_written = 0  # expiry/revocation entries written by an attempt a full disk cut short
        self.stopped = False

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._host.io, fn, *args)

    @property
    def paused(self) -> bool:
        """Results cannot be written for want of room: no new line until they can."""
        return self.disk_full_since is not None

    def is_done(self, line: int) -> bool:
        return is_done(self.done, line)

    # ------------------------------------------------------------ recovery

    async def recover(self) -> None:
        """What is done already: from the result files alone (a line written is never sent again)."""
        rec = self.rec
        self.done = bytearray((rec.input_lines + 7) // 8)
        await self._io(self.out.recover, self.done)
        await self._io(self.err.recover, self.done)
        if (rec.completed, rec.failed) != (self.out.lines, self.err.lines):
            rec.completed, rec.failed = self.out.lines, self.err.lines
            self.dirty = True
        if rec.usage != self.out.usage:  # (the state saved last may lag the files: a crash between)
            rec.usage = msgspec.structs.replace(self.out.usage)
            self.dirty = True

    # ------------------------------------------------------------ entries

    def ok(self, line: int, custom_id: str, request_id: str, body: bytes) -> int | None:
        """A line's 200 ``body`` into the output file; its tokens (None: the body has no usage)."""
        entry = {
            "id": result_id(self.rec.id, line),
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": msgspec.Raw(body)},
            "error": None,
        }
        mark_done(self.done, line)
        self._out_buf.append(_encode(entry) + b"\n")
        pend = self._pending
        pend[0] += 1
        usage = _usage_decoder.decode(body).usage
        tokens = None
        if usage is not None:
            pend[2] += usage.prompt_tokens
            pend[3] += usage.completion_tokens
            pend[4] += (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
            tokens = usage.prompt_tokens + usage.completion_tokens
        self._flush_soon()
        return tokens

    def error(self, line: int, custom_id: str, err: p.ErrorInfo) -> None:
        """A line's refusal into the error file, keyed by its custom_id."""
        rid = result_id(self.rec.id, line)
        entry = {
            "id": rid,
            "custom_id": custom_id,
            "response": {"status_code": err.status, "request_id": rid, "body": msgspec.Raw(api.error_body(err, rid))},
            "error": None,
        }
        mark_done(self.done, line)
        self._err_buf.append(_encode(entry) + b"\n")
        self._pending[1] += 1
        self._flush_soon()

    # ------------------------------------------------------------ groups

    def _flush_soon(self) -> None:
        if self._flush_timer is None and self._flushing is None:
            wait = GROUP_WAIT_S if self.disk_full_since is None else self.retry_s
            self._flush_timer = asyncio.get_running_loop().call_later(wait, self._flush)

    def _flush(self) -> None:
        self._flush_timer = None
        if self._flushing is not None or self.stopped or self.write_failed or not (self._out_buf or self._err_buf):
            return
        out, self._out_buf = self._out_buf, []
        err, self._err_buf = self._err_buf, []
        counts, self._pending = self._pending, [0, 0, 0, 0, 0]
        fut = asyncio.get_running_loop().run_in_executor(self._host.io, self._write, out, err)
        self._flushing = fut
        fut.add_done_callback(lambda f: self._flushed(f, out, err, counts))

    def _write(self, out: list[bytes], err: list[bytes]) -> None:
        """Each list is emptied once written (ResultLog.append: all or nothing)."""
        with self.fence.hold():
            if out:
                self.out.append(out)
                out.clear()
            if err:
                self.err.append(err)
                err.clear()

    def _flushed(self, fut: asyncio.Future[Any], out: list[bytes], err: list[bytes], counts: list[int]) -> None:
        self._flushing = None
        exc = fut.exception()
        if isinstance(exc, StaleLease):
            return self._stale(exc)
        # What the write left unwritten (_write empties each list it appended): a failure
        # on the error file comes after the output file's lines are on disk, and those count.
        back = [0] * 5
        if out:
            back[0], back[2], back[3], back[4] = counts[0], counts[2], counts[3], counts[4]
        if err:
            back[1] = counts[1]
        counts = [a - b for a, b in zip(counts, back, strict=True)]
        if exc is not None and not disk_full(exc):
            log.error("batch %s: writing results failed: %s", self.rec.id, exc)
            if not self.stopped and not self.write_failed:
                self.write_failed = True
                code, message = (
                    ("results_too_large", str(exc))
                    if isinstance(exc, ResultsTooLarge)
                    else ("results_write_failed", f"Writing results failed ({exc}); what was written is kept.")
                )
                asyncio.get_running_loop().create_task(self._fail(code, message))
        elif exc is not None:  # no room: what was not written goes back, to be written when there is
            if out:
                self._out_buf[:0] = out
            if err:
                self._err_buf[:0] = err
            self._pending = [a + b for a, b in zip(self._pending, back, strict=True)]
            self.disk_full(exc)
        elif self.disk_full_since is not None:
            self._disk_ok()
        rec = self.rec
        rec.completed += counts[0]
        rec.failed += counts[1]
        rec.usage.input_tokens += counts[2]
        rec.usage.output_tokens += counts[3]
        rec.usage.cached_tokens += counts[4]
        self.dirty = True
        if (self._out_buf or self._err_buf) and not self.stopped and not self.write_failed:
            self._flush_soon()

    def disk_full(self, exc: BaseException) -> None:
        """A write found no room: feeding pauses until one goes through."""
        if self.disk_full_since is None:
            self.disk_full_since = time.monotonic()
            log.warning(
                "batch %s: the disk is full (%s); feeding paused, writes retried every %g s",
                self.rec.id,
                exc,
                self.retry_s,
            )

    def _disk_ok(self) -> None:
        waited = time.monotonic() - (self.disk_full_since or 0.0)
        log.warning("batch %s: results written again after %.1f s; feeding resumes", self.rec.id, waited)
        self.disk_full_since = None
        self._resume()

    async def drain(self) -> None:
        """Every result so far on disk."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        while not self.stopped and not self.write_failed:
            if self._flushing is not None:
                await asyncio.wait([self._flushing])
                continue
            if not (self._out_buf or self._err_buf):
                return
            if self.disk_full_since is not None:
                await asyncio.sleep(self.retry_s)  # no room: try again in a while, not in a loop
            self._flush()  # (nothing if a timer's flush runs already: awaited above next turn)

    # ------------------------------------------------------------ ends

    async def write_unfinished(self, code: str, message: str) -> None:
        """An error entry (``code``, ``message``) for every line not done, on the I/O thread;
        ResultsTooLarge or OSError as the append raised (those written so far are done)."""
        await self._io(self._write_unfinished, code, message)

    def count_unfinished(self) -> None:
        """The entries ``write_unfinished`` wrote count in ``failed`` (once)."""
        self.rec.failed += self._unfinished_written
        self._unfinished_written = 0

    def _write_unfinished(self, code: str, message: str) -> None:
        with self.fence.hold():
            self._write_unfinished_fenced(code, message)

    def _write_unfinished_fenced(self, code: str, message: str) -> None:
        rec = self.rec
        chunk: list[bytes] = []
        lines: list[int] = []

        def write() -> None:
            self.err.append(chunk)
            for line in lines:  # done once written: a retry after a full disk writes only the rest
                mark_done(self.done, line)
            self._unfinished_written += len(lines)
            chunk.clear()
            lines.clear()

        with open(self.input_path, "rb") as f:
            for line, raw in enumerate(f):
                if not raw.strip() or line >= rec.input_lines or is_done(self.done, line):
                    continue
                head = decode_line(raw)
                entry = {
                    "id": result_id(rec.id, line),
                    "custom_id": head.custom_id if head is not None else "",
                    "response": None,
                    "error": {"code": code, "message": message},
                }
                chunk.append(_encode(entry) + b"\n")
                lines.append(line)
                if len(chunk) >= UNFINISHED_CHUNK:
                    write()
        if chunk:
            write()

    async def register(self) -> None:
        """The result files become visible (/v1/files): before any end status shows their ids."""
        try:
            await self._io(self._register)
        except OSError as e:
            if disk_full(e) and not self.stopped:
                raise  # no end status before its files are visible: tried again at the next step
            log.error("batch %s: registering result files failed: %s", self.rec.id, e)

    def _register(self) -> None:
        with self.fence.hold():
            self._register_fenced()

    def _register_fenced(self) -> None:
        rec, files = self.rec, self._host.files
        self.out.close()
        self.err.close()
        exp = rec.output_expires_after_s
        if rec.completed:
            files.register(rec.owner, rec.output_file_id, f"{rec.id}_output.jsonl", "batch_output", exp)
        if rec.failed:
            files.register(rec.owner, rec.error_file_id, f"{rec.id}_error.jsonl", "batch_output", exp)

    # ------------------------------------------------------------ the state

    async def save(self) -> None:
        """The record as it is, by this batch's newest holder only."""
        self.dirty = False
        try:
            await self._io(self._host.store.save, msgspec.structs.replace(self.rec), self.fence)
        except BaseException:
            self.dirty = True
            raise
        if self.disk_full_since is not None and self._flushing is None and not (self._out_buf or self._err_buf):
            self._disk_ok()  # the pause came from a save, and this one went through (no result waits for room)

    async def save_or_wait(self) -> None:
        """Save; with the disk full, carry on: it is saved at a later step."""
        try:
            await self.save()
        except OSError as e:
            if not disk_full(e):
                raise
            self.disk_full(e)

    def stop(self) -> None:
        """Write nothing more: what waits for its group is dropped (the next holder sends those lines again)."""
        self.stopped = True
        self._out_buf.clear()
        self._err_buf.clear()
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
