"""One batch running on this router: its lines fed into the normal submit path.

``BatchRun`` streams the input file (never loaded whole) and submits each
line through ``RouterCore.submit`` -- the same admission, budgets, policy and
workers as a live request -- in the lowest class (``batch``, or the config's
last), as the key that created the batch.  The policy's class headroom and
ordering keep interactive work ahead of it; the feeder keeps only
``queued_target`` lines waiting and ``max_in_flight`` in the router at once
(router.services.batch.rules.lines_to_send), topping up as lines end.

A line refused for room or budget (429/503: router.services.batch.rules.retryable)
waits ``retry_s`` (or its Retry-After) and is sent again: batch lines are
never refused for predicted wait, their deadline is the completion window.
Any other refusal, or a line that does not parse, is an entry in the error
file, keyed by its custom_id.  A line of several jobs (an embeddings line's
inputs, a completions line's prompt list: router.services.batch.lines) counts each
job against the window; one refused or failed ends the whole line.  Each
line's end goes to the run's ``ResultWriter`` (router.services.batch.results),
which writes the result and error files and the batch's state under its
fence: a run whose lease another router has taken over is refused there and
stops, writing nothing.  The run decides; the writer writes.

A draining router (router.lifecycle.drain) hands its batches on: the feeder sends no
more lines, withdraws those still queued, lets the running ones finish (or
the drain's deadline refuse them: retryable, so not written), writes what
finished, and ends the run without ending the batch; the service then
releases the lease at once, so another router -- or this one, restarted --
takes the batch over where it stopped.

A full disk (ENOSPC, EDQUOT) pauses the run: no new line is sent while the
writer waits for room (router.services.batch.results), and feeding resumes
once a write goes through.  The batch never fails for it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from router import api
from router.lifecycle.fanout import PromptFanOut, echo_texts
from router.lifecycle.jobs import RUNNING, job_id_of
from router.services.batch import rules as m
from router.services.batch.lines import AsOwner, EmbeddingLine, InFlightLine, LineSink
from router.services.batch.results import ResultWriter
from router.services.batch.store import BatchError, BatchRecord, ResultsTooLarge, StaleLease, disk_full, result_id
from router.services.batch.validate import LineJobs, check_file, decode_line, to_jobs
from router.tenancy.identity import ANONYMOUS_TENANT, Identity
from router.tenancy.ownership import key_live
from shared import protocol as p
from shared.errors import Code, error
from shared.keys import key_id

if TYPE_CHECKING:
    from router.services.batch.host import BatchHost

log = logging.getLogger("weir.batch")

READ_PER_PASS = 4096  # input lines read per feeding pass at most (bad lines cost no slot)
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
REVOKED_CODE = "api_key_revoked"
REVOKED_MESSAGE = (
    "The API key that created this batch was removed or moved to another tenant: the batch was cancelled "
    "and this request was not executed."
)


class BatchRun:
    """One batch on this router: its lines fed into the core, its ends decided (written by ``results``)."""

    def __init__(self, host: BatchHost, rec: BatchRecord, token: int = 0) -> None:
        self.svc = host
        self.core = host.core
        self.rec = rec
        bcfg = host.bcfg
        self.window, self.queue_target, self.retry_s = bcfg.max_in_flight, bcfg.queued_target, bcfg.retry_s
        self.max_body = host.max_body_bytes
        self.max_prompts = host.max_prompts
        self.input_path = host.files.data_path(rec.input_file_id)
        self.results = ResultWriter(host, rec, token, resume=self.kick, fail=self._fail, stale=self._stale)
        self.cursor = 0  # the next physical input line to read
        self._input: IO[bytes] | None = None
        self.eof = False
        self.in_flight: dict[int, InFlightLine] = {}  # job handle -> its line
        self.retry: collections.deque[tuple[float, int, bytes]] = collections.deque()  # (not before, line, raw)
        self._kicked = False
        self.wake = asyncio.Event()
        self.ended = False
        self.draining = False  # the router drains: no more lines; hand the batch on once the running ones end
        self.handed_off = False  # the run ended with the batch still running: its lease goes to another router
        self.started_mono = time.monotonic()
        self.done_at_start = 0
        self.who: Identity | p.ErrorInfo = self._identity()
        self.revoked = isinstance(self.who, p.ErrorInfo)  # its key is gone: cancelled at the next step

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
        self.who = self._identity()
        if isinstance(self.who, p.ErrorInfo) and not self.revoked:
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
        self._input = await self._io(open, self.input_path, "rb")

    async def step(self) -> None:
        rec = self.rec
        if rec.status == m.FINALIZING:
            return await self._finish(m.COMPLETED)
        if self.revoked and rec.status in (m.IN_PROGRESS, m.CANCELLING):
            return await self._revoke()
        if time.time() >= rec.expires_at and rec.status in (m.IN_PROGRESS, m.CANCELLING):
            return await self._expire()
        if rec.status == m.IN_PROGRESS and self.svc.store.cancel_requested(rec.id):
            rec.move(m.CANCELLING)
            self.results.dirty = True
            self._cancel_queued()
        if rec.status == m.IN_PROGRESS:
            self.feed()
            if self.draining:
                if not self.in_flight:
                    await self._hand_off()
                return
            if self.eof and not self.retry and not self.in_flight:
                await self.results.drain()
                if self.stopped or self.results.write_failed or rec.status != m.IN_PROGRESS:
                    return
                rec.move(m.FINALIZING)
                return await self._finish(m.COMPLETED)
        elif rec.status == m.CANCELLING and not self.in_flight:
            return await self._finish(m.CANCELLED)
        if self.results.dirty:
            await self.results.save_or_wait()

    # ------------------------------------------------------------ feeding

    def kick(self) -> None:
        """A line ended: top the queue up at the end of this loop turn (once per turn)."""
        if not self._kicked:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._kick)

    def _kick(self) -> None:
        self._kicked = False
        if not self.stopped and self.rec.status == m.IN_PROGRESS:
            self.feed()
            if (self.draining or (self.eof and not self.retry)) and not self.in_flight:
                self.wake.set()
        elif self.rec.status == m.CANCELLING and not self.in_flight:
            self.wake.set()

    def queued(self) -> int:
        jobs = self.core.jobs
        n = 0
        for handle in self.in_flight:
            j = jobs.get(job_id_of(handle))
            if j is not None and j.state is not RUNNING:
                n += 1
        return n

    def running(self) -> int:
        return len(self.in_flight) - self.queued()

    def feed(self) -> None:
        if self.draining or self.core.draining:
            self.drain()
            return
        want = m.lines_to_send(m.FeedState(len(self.in_flight), self.queued(), self.window, self.queue_target))
        reads = 0
        now = time.monotonic()
        if want > 0 and not self.svc.budget_allows(self.rec.owner):
            return  # batch_tokens_per_day spent: the batch waits (checked again at each scan)
        if self.results.paused:
            return  # results cannot be written: no new line until they can
        while want > 0 and reads < READ_PER_PASS:
            if self.retry and self.retry[0][0] <= now:
                _, line, raw = self.retry.popleft()
            else:
                got = self._next_line()
                if got is None:
                    break
                line, raw = got
                reads += 1
            want -= self._send(line, raw)

    def drain(self) -> None:
        """The router drains: send nothing more, withdraw the lines still queued
        (not started: the next holder sends them), let the running ones end."""
        if self.draining:
            return
        self.draining = True
        if self.rec.status == m.IN_PROGRESS:
            self._cancel_queued()
        log.info(
            "batch %s: router draining; %d lines running finish here, then the batch moves on",
            self.rec.id,
            len(self.in_flight),
        )
        self.wake.set()

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

    def _next_line(self) -> tuple[int, bytes] | None:
        f = self._input
        if f is None or self.eof:
            return None
        while True:
            raw = f.readline()
            if not raw:
                self.eof = True
                return None
            line = self.cursor
            self.cursor += 1
            if raw.strip() and line < self.rec.input_lines and not self.results.is_done(line):
                return line, raw

    def _send(self, line: int, raw: bytes) -> int:
        """Submit one line; the number of its jobs now in flight (0: it is not)."""
        rec = self.rec
        decoded = decode_line(raw)
        if decoded is None:
            self._error_entry(line, "", error(Code.BAD_REQUEST, "This line is not a valid request object."))
            return 0
        rid = result_id(rec.id, line)
        try:
            jobs = to_jobs(decoded, rec.endpoint, self.max_body, rid, self.max_prompts)
        except api.RequestError as e:
            self._error_entry(line, decoded.custom_id, e.info)
            return 0
        if isinstance(self.who, p.ErrorInfo):
            self._error_entry(line, decoded.custom_id, self.who)
            return 0
        for sub in jobs.subs:
            sub.trace_id = rid
        sink, result = self._submit(line, raw, decoded.custom_id, jobs, AsOwner(self.core, self.who))
        if result is None:
            for h in sink.handles:
                self.in_flight[h] = sink
            self.svc.stats.sent += 1
            return len(sink.handles)
        if m.retryable(result.status, result.code, result.type):
            self._retry_later(line, raw, result)
        else:
            self._error_entry(line, decoded.custom_id, result)
        return 0

    def _submit(
        self, line: int, raw: bytes, custom_id: str, jobs: LineJobs, who: AsOwner
    ) -> tuple[InFlightLine, p.ErrorInfo | None]:
        """The line's jobs into the core, as the live ingress submits them; a refusal withdraws them all."""
        ctx, subs = jobs.ctx, jobs.subs
        if isinstance(ctx, api.EmbeddingContext):
            emb = EmbeddingLine(self, line, raw, custom_id, ctx)
            return emb, emb.submit(who, subs)
        ctx.request_id = subs[0].trace_id
        if ctx.logprobs is not None:  # as router.ingress.http_server: token ids shown as text
            ctx.token_text = self.core.token_text(subs[0].model) or api.token_id_text
        echoes = echo_texts(who, api.CompletionJobs(subs, ctx, jobs.n, jobs.echoes))
        if len(subs) == 1 and echoes:
            ctx.echo = echoes[0]
        sink = LineSink(self, line, raw, custom_id, ctx)
        if len(subs) == 1:
            got = who.submit(subs[0], sink)
            if isinstance(got, p.ErrorInfo):
                return sink, got
            sink.handles.append(got)
            return sink, None
        fan = PromptFanOut(who, sink, jobs.n, len(subs), echoes)
        err = fan.submit(subs)
        sink.handles = fan.handles
        return sink, err

    def _retry_later(self, line: int, raw: bytes, err: p.ErrorInfo) -> None:
        wait = max(self.retry_s, err.retry_after or 0.0)
        self.retry.append((time.monotonic() + wait, line, raw))
        self.svc.stats.retried += 1

    # ------------------------------------------------------------ line ends

    def _end_line(self, sink: InFlightLine) -> None:
        """The line is over: none of its jobs is in flight (those still running are cancelled)."""
        for h in sink.handles:
            if self.in_flight.pop(h, None) is not None and len(sink.handles) > 1:
                self.core.cancel(h)  # (a job that ended already: a no-op)

    def line_ok(self, sink: InFlightLine, body: bytes) -> None:
        self._end_line(sink)
        tokens = self.results.ok(sink.line, sink.custom_id, sink.ctx.id, body)
        if tokens is not None:
            self.svc.charge(self.rec.owner, tokens)
        self.svc.stats.line_done(self.rec.owner, 1, 0, tokens or 0)
        self.kick()

    def line_refused(self, sink: InFlightLine, err: p.ErrorInfo) -> None:
        self._end_line(sink)
        if m.retryable(err.status, err.code, err.type) and self.rec.status == m.IN_PROGRESS:
            self._retry_later(sink.line, sink.raw, err)
            self.kick()
            return
        self._error_entry(sink.line, sink.custom_id, err)
        self.kick()

    def _error_entry(self, line: int, custom_id: str, err: p.ErrorInfo) -> None:
        self.results.error(line, custom_id, err)
        self.svc.stats.line_done(self.rec.owner, 0, 1)

    # ------------------------------------------------------------ ends

    def _cancel_queued(self) -> None:
        """Cancel: lines still waiting in the queue are withdrawn; running ones finish
        (a line of several jobs with any of them still queued is withdrawn whole)."""
        jobs = self.core.jobs
        for handle, sink in list(self.in_flight.items()):
            j = jobs.get(job_id_of(handle))
            if handle in self.in_flight and (j is None or j.state is not RUNNING):
                self._withdraw(sink)
        self.retry.clear()

    def _withdraw(self, sink: InFlightLine) -> None:
        sink.muted = True
        for h in sink.handles:
            if self.in_flight.pop(h, None) is not None:
                self.core.cancel(h)

    def _withdraw_all(self) -> None:
        for sink in list(self.in_flight.values()):
            self._withdraw(sink)
        self.retry.clear()

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
        self._withdraw_all()
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
        self._withdraw_all()
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
        self._withdraw_all()
        self.wake.set()

    def _close(self) -> None:
        if self._input is not None:
            self._input.close()
            self._input = None

    # ------------------------------------------------------------ views

    def eta_s(self) -> float | None:
        rec = self.rec
        done = rec.completed + rec.failed - self.done_at_start
        return m.eta_seconds(done, rec.total - self.done_at_start, time.monotonic() - self.started_mono)
