"""One batch running on this router, from its validation to its end or its hand-off.

``BatchRun`` is the batch's life here: it validates a new batch's input (or
recovers one this or another router ran: what is done is read from the
result files alone), then steps until the batch ends -- its lines fed by its
``LineFeeder`` (router.services.batch.feeder), their results written by its
``ResultWriter`` (router.services.batch.results) -- and decides each end:
completed once every line is answered; cancelled (a cancel request: queued
lines withdrawn, running ones finish); expired (the window passed: every line
not done gets a batch_expired entry); cancelled too when its creating key is
revoked (api_key_revoked entries); failed when results cannot be written.
Every write goes through the batch's fence: a run whose lease another router
has taken over is refused there and stops, writing nothing.

A draining router (router.lifecycle.drain) hands its batches on: the feeder
sends no more lines, withdraws those still queued, lets the running ones
finish (or the drain's deadline refuse them: retryable, so not written), the
writer writes what finished, and the run ends without ending the batch; the
service then releases the lease at once, so another router -- or this one,
restarted -- takes the batch over where it stopped.

A full disk (ENOSPC, EDQUOT) is nobody's fault, least of all this batch's:
the writer keeps what it could not write and tries again every ``retry_s``;
no new line is sent meanwhile.  The batch never fails for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from router.services.batch import rules as m
from router.services.batch.feeder import LineFeeder
from router.services.batch.results import ResultWriter
from router.services.batch.store import BatchError, BatchRecord, ResultsTooLarge, StaleLease, disk_full
from router.services.batch.validate import check_file
from router.tenancy.identity import ANONYMOUS_TENANT, Identity
from router.tenancy.ownership import key_live
from shared import protocol as p
from shared.errors import Code, error
from shared.keys import key_id

if TYPE_CHECKING:
    from router.services.batch.host import BatchHost

log = logging.getLogger("weir.batch")

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
REVOKED_CODE = "api_key_revoked"
REVOKED_MESSAGE = (
    "The API key that created this batch was removed or moved to another tenant: the batch was cancelled "
    "and this request was not executed."
)


class BatchRun:
    """One batch on this router: its steps and its ends decided; fed by ``feeder``, written by ``results``."""

    def __init__(self, host: BatchHost, rec: BatchRecord, token: int = 0) -> None:
        self.svc = host
        self.core = host.core
        self.rec = rec
        self.input_path = host.files.data_path(rec.input_file_id)
        self.wake = asyncio.Event()
        self.results = ResultWriter(host, rec, token, resume=self._resume, fail=self._fail, stale=self._stale)
        who = self._identity()
        self.revoked = isinstance(who, p.ErrorInfo)  # its key is gone: cancelled at the next step
        self.feeder = LineFeeder(host, rec, self.results, self.wake, who)
        self.ended = False
        self.handed_off = False  # the run ended with the batch still running: its lease goes to another router
        self.started_mono = time.monotonic()
        self.done_at_start = 0

    @property
    def stopped(self) -> bool:
        """The lease is lost (or the router stops): this run writes nothing more."""
        return self.results.stopped

    # ------------------------------------------------------------ identity and class

    def _identity(self) -> Identity | p.ErrorInfo:
        """Who the lines run as: the creating key, while it still speaks for the batch's tenant."""
        keys = self.core.keys
        klass = self.svc.batch_class
        if not key_live(self.rec.owner, self.rec.key_digest, keys.by_key):
            return error(Code.INVALID_API_KEY, "The API key that created this batch is no longer valid.")
        if not keys.by_key:
            return Identity(ANONYMOUS_TENANT, klass, 1.0, "")
        key = keys.by_key[self.rec.key_digest]
        return Identity(key.tenant, klass, key.weight, key_id(self.rec.key_digest))

    def recheck(self) -> None:
        """The keys were reloaded: a batch whose key was removed or moved to another tenant is cancelled."""
        who = self.feeder.who = self._identity()
        if isinstance(who, p.ErrorInfo) and not self.revoked:
            self.revoked = True
            log.warning("batch %s: its API key was revoked; cancelling it", self.rec.id)
            self.wake.set()

    # ------------------------------------------------------------ the run

    async def main(self) -> None:
        """Validate (a new batch) or recover (one this or another router ran), then feed until it ends."""
        try:
            if self.rec.status == m.VALIDATING:
                if not await self._validate():
                    return
            await self._recover()
            while not self.stopped:
                try:
                    await self.step()
                except OSError as e:
                    if not disk_full(e) or self.stopped:
                        raise
                    self.results.disk_full(e)  # tried again at the next step
                if self.ended or self.handed_off:
                    return
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), self.svc.bcfg.scan_interval_s)
                except TimeoutError:
                    pass
        except StaleLease as e:
            self._stale(e)
        except Exception as e:
            log.exception("batch %s failed", self.rec.id)
            if not self.stopped:
                await self._fail("internal_error", f"The batch failed: {e}")
        finally:
            self._close()

    def _stale(self, e: StaleLease) -> None:
        """A write was refused: another router holds the batch now.  Stop, write nothing more."""
        if not self.stopped:
            log.warning("batch %s: %s; another router runs it now, this one stops", self.rec.id, e)
            self.stop()

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.svc.io, fn, *args)

    async def _validate(self) -> bool:
        rec = self.rec
        if self.svc.store.cancel_requested(rec.id):
            rec.move(m.CANCELLED)
            await self.results.save()
            self.ended = True
            return False
        try:
            checked = await self._io(check_file, self.input_path)
        except OSError as e:
            checked = None
            rec.errors = [BatchError("input_file_unreadable", f"The input file could not be read: {e}")]
        if checked is not None:
            rec.total, rec.input_lines = checked.total, checked.lines
            if checked.errors:
                rec.errors = checked.errors
        if rec.errors:
            rec.move(m.FAILED)
            await self.results.save()
            self.ended = True
            return False
        rec.move(m.IN_PROGRESS)
        await self.results.save_or_wait()
        return True

    async def _recover(self) -> None:
        """What is done already (router.services.batch.results: from the result files alone); the input opened."""
        await self.results.recover()
        rec = self.rec
        self.done_at_start = rec.completed + rec.failed
        self.started_mono = time.monotonic()
        await self.feeder.open()

    async def step(self) -> None:
        rec, feeder = self.rec, self.feeder
        if rec.status == m.FINALIZING:
            return await self._finish(m.COMPLETED)
        if self.revoked and rec.status in (m.IN_PROGRESS, m.CANCELLING):
            return await self._revoke()
        if time.time() >= rec.expires_at and rec.status in (m.IN_PROGRESS, m.CANCELLING):
            return await self._expire()
        if rec.status == m.IN_PROGRESS and self.svc.store.cancel_requested(rec.id):
            rec.move(m.CANCELLING)
            self.results.dirty = True
            self.feeder.cancel_queued()
        if rec.status == m.IN_PROGRESS:
            feeder.feed()
            if feeder.draining:
                if not feeder.in_flight:
                    await self._hand_off()
                return
            if feeder.eof and not feeder.retry and not feeder.in_flight:
                await self.results.drain()
                if self.stopped or self.results.write_failed or rec.status != m.IN_PROGRESS:
                    return
                rec.move(m.FINALIZING)
                return await self._finish(m.COMPLETED)
        elif rec.status == m.CANCELLING and not feeder.in_flight:
            return await self._finish(m.CANCELLED)
        if self.results.dirty:
            await self.results.save_or_wait()

    def _resume(self) -> None:
        """Room came back for the results: feeding resumes."""
        self.feeder.kick()

    def drain(self) -> None:
        """The router drains: the feeder sends nothing more; the batch is handed on once its running lines end."""
        self.feeder.drain()

    async def _hand_off(self) -> None:
        """Nothing of this run is in flight: write what finished, save, and end the run (not the batch)."""
        await self.results.drain()
        if self.stopped or self.results.write_failed:  # (a failed write: _fail ends the batch, under the lease still)
            return
        await self.results.save()
        self.handed_off = True
        log.info(
            "batch %s: handed on (%d of %d done)", self.rec.id, self.rec.completed + self.rec.failed, self.rec.total
        )

    # ------------------------------------------------------------ ends

    async def _expire(self) -> None:
        """The window passed: what finished stays; every other line gets a batch_expired entry."""
        if await self._end_unfinished("batch_expired", EXPIRED_MESSAGE, "expiry"):
            await self._end_files(m.EXPIRED)

    async def _revoke(self) -> None:
        """Its key was revoked: what finished stays; every other line gets an api_key_revoked
        entry in the error file, and the batch ends cancelled with that error."""
        if not await self._end_unfinished(REVOKED_CODE, REVOKED_MESSAGE, "revocation"):
            return
        rec = self.rec
        if not any(e.code == REVOKED_CODE for e in rec.errors):  # (once: an end a full disk cut short runs again)
            rec.errors = [*rec.errors, BatchError(REVOKED_CODE, REVOKED_MESSAGE)]
        if rec.status == m.IN_PROGRESS:
            rec.move(m.CANCELLING)
        await self._end_files(m.CANCELLED)

    async def _end_unfinished(self, code: str, message: str, what: str) -> bool:
        """Stop feeding, let the running lines end, then an error entry (``code``)
        for every line not done, counted in ``failed``; whether the batch may end
        now (not when the run stopped or a failed write ends it through _fail)."""
        self.feeder.withdraw_all()
        await self.results.drain()
        if self.stopped or self.results.write_failed:  # (a failed write: _fail ends it)
            return False
        try:
            await self.results.write_unfinished(code, message)
        except ResultsTooLarge as e:
            await self._fail("results_too_large", str(e))
            return False
        except OSError as e:
            if disk_full(e):
                raise  # tried again at the next step (main): the entries written so far are marked done
            await self._fail("results_write_failed", f"Writing {what} entries failed ({e}).")
            return False
        self.results.count_unfinished()
        return True

    async def _finish(self, status: str) -> None:
        await self.results.drain()
        if self.stopped or self.results.write_failed:  # (a failed write: _fail ends it)
            return
        if status == m.COMPLETED and self.rec.status != m.FINALIZING:
            self.rec.move(m.FINALIZING)
        await self._end_files(status)

    async def _end_files(self, status: str) -> None:
        """Output and error files become visible (/v1/files), then the batch ends and is saved.

        In that order: a terminal batch shows its file ids at once, and a client that reads
        one on seeing the status must find the file (the register runs off the loop)."""
        rec = self.rec
        await self.results.register()
        was, stamps = rec.status, dict(rec.stamps)
        rec.move(status)
        try:
            await self.results.save()
        except OSError as e:
            if disk_full(e):  # not ended until saved: back as it was, tried again at the next step
                rec.status, rec.stamps = was, stamps
            raise
        self.ended = True
        log.info("batch %s %s: %d completed, %d failed of %d", rec.id, rec.status, rec.completed, rec.failed, rec.total)

    async def _fail(self, code: str, message: str) -> None:
        try:
            await self._fail_fenced(code, message)
        except StaleLease as e:
            self._stale(e)

    async def _fail_fenced(self, code: str, message: str) -> None:
        self.feeder.withdraw_all()
        rec = self.rec
        self.results.count_unfinished()  # expiry/revocation entries written before the failure
        try:
            await self.results.register()
        except OSError as e:  # (a full disk: failing anyway, what could be registered was)
            log.error("batch %s: registering result files failed: %s", rec.id, e)
        rec.errors = [*rec.errors, BatchError(code, message)]
        if rec.status not in m.TERMINAL:
            rec.status = m.FAILED  # from any state: a failure is always recorded
            rec.stamps[m.STAMP[m.FAILED]] = int(time.time())
        try:
            await self.results.save()
        except OSError as e:
            log.error("batch %s: saving its failed state failed too: %s", rec.id, e)
        self.ended = True

    def stop(self) -> None:
        """The lease is lost (or the router stops): drop out at once, write nothing more."""
        self.results.stop()  # (first: what a withdrawn line reports is written nowhere)
        self.feeder.withdraw_all()
        self.wake.set()

    def _close(self) -> None:
        self.feeder.close()

    # ------------------------------------------------------------ views

    def eta_s(self) -> float | None:
        rec = self.rec
        done = rec.completed + rec.failed - self.done_at_start
        return m.eta_seconds(done, rec.total - self.done_at_start, time.monotonic() - self.started_mono)
