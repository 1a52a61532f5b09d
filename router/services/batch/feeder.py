"""One batch running on this router: its lines fed into the normal submit path.

``BatchRun`` streams the input file (never loaded whole) and submits each
line through ``RouterCore.submit`` -- the same admission, budgets, policy and
workers as a live request -- in the lowest class (``batch``, or the config's
last), as the key that created the batch.  The policy's class headroom and
ordering keep interactive work ahead of it; the feeder keeps only
``queued_target`` lines waiting and ``max_in_flight`` in the router at once
(router.services.batch.model.lines_to_send), topping up as lines end.

A line refused for room or budget (429/503: router.services.batch.model.retryable)
waits ``retry_s`` (or its Retry-After) and is sent again: batch lines are
never refused for predicted wait, their deadline is the completion window.
Any other refusal, or a line that does not parse, is an entry in the error
file, keyed by its custom_id.  A line of several jobs (an embeddings line's
inputs, a completions line's prompt list: router.services.batch.lines) counts each
job against the window; one refused or failed ends the whole line.  Results are appended and fsync'ed on a
thread, in groups (router.services.batch.store.ResultLog), each group and each state
write under the batch's fence (router.services.batch.store.Fence): a run whose lease
another router has taken over is refused there and stops, writing nothing.

A draining router (router.lifecycle.drain) hands its batches on: the feeder sends no
more lines, withdraws those still queued, lets the running ones finish (or
the drain's deadline refuse them: retryable, so not written), writes what
finished, and ends the run without ending the batch; the service then
releases the lease at once, so another router -- or this one, restarted --
takes the batch over where it stopped.


A full disk (ENOSPC, EDQUOT) is nobody's fault, least of all this batch's:
the results not written stay in memory (at most the window's lines), no new
line is sent, and the write is tried again every ``retry_s`` until it
succeeds; then feeding resumes.  The batch never fails for it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import msgspec

from router import api
from router.lifecycle.fanout import PromptFanOut, echo_texts
from router.lifecycle.jobs import RUNNING, job_id_of
from router.services.batch import model as m
from router.services.batch.lines import AsOwner, EmbeddingLine
from router.services.batch.store import (
    BatchError,
    BatchRecord,
    ResultLog,
    ResultsTooLarge,
    StaleLease,
    disk_full,
    is_done,
    mark_done,
    result_id,
)
from router.services.batch.validate import LineJobs, check_file, decode_line, to_jobs
from router.tenancy.identity import ANONYMOUS_TENANT, Identity
from router.tenancy.ownership import key_live
from shared import protocol as p
from shared.errors import Code, error
from shared.keys import key_id

if TYPE_CHECKING:
    from router.services.batch.service import BatchService

log = logging.getLogger("weir.batch")

FLUSH_S = 0.05  # results wait at most this long for their group's fsync
READ_PER_PASS = 4096  # input lines read per feeding pass at most (bad lines cost no slot)
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
REVOKED_CODE = "api_key_revoked"
REVOKED_MESSAGE = (
    "The API key that created this batch was removed or moved to another tenant: the batch was cancelled "
    "and this request was not executed."
)


class _UsageOnly(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class _BodyUsage(msgspec.Struct):
    usage: _UsageOnly | None = None


_usage_decoder = msgspec.json.Decoder(_BodyUsage)
_encode = msgspec.json.Encoder().encode


class LineSink:
    """One chat or completions line in flight: the RequestSink its job reports to
    (a non-streamed body); for a prompt list, the sink of the merge of its jobs."""

    __slots__ = ("run", "line", "raw", "custom_id", "ctx", "counts", "texts", "handles", "muted", "preempted")

    def __init__(self, run: BatchRun, line: int, raw: bytes, custom_id: str, ctx: api.ResponseContext) -> None:
        self.run = run
        self.line = line
        self.raw = raw  # the input line, for a retry (in flight only: bounded by the window)
        self.custom_id = custom_id
        self.ctx = ctx
        self.counts: api.Accumulator | api.TokenCounts = api.Accumulator(ctx) if ctx.rich else api.TokenCounts()
        self.texts: list[str] = []
        self.handles: list[int] = []
        self.muted = False  # cancelled by the batch (expiry, cancel, lease lost): news is ignored
        self.preempted = False  # stepped aside for interactive work once already

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        if self.muted or not deltas:
            return
        if deltas[0].model and deltas[0].model != self.ctx.model:  # a fallback model answers
            self.ctx.model = deltas[0].model
        counts = self.counts
        if isinstance(counts, api.Accumulator):
            counts.add(deltas)
        else:
            for d in deltas:
                counts.add(d)
                if d.text:
                    self.texts.append(d.text)
        last = deltas[-1]
        if last.error is not None:
            self.muted = True
            self.run.line_refused(self, last.error)
        elif last.finish_reason is not None:
            self.muted = True
            if isinstance(counts, api.Accumulator):
                body = counts.render()
            else:
                body = api.render_completion(
                    self.ctx,
                    "".join(self.texts),
                    last.finish_reason,
                    counts.prompt,
                    counts.completion_total,
                    counts.cached,
                )
            self.run.line_ok(self, body)


class BatchRun:
    def __init__(self, service: BatchService, rec: BatchRecord, token: int = 0) -> None:
        self.svc = service
        self.core = service.core
        self.rec = rec
        bcfg = service.bcfg
        self.window, self.queue_target, self.retry_s = bcfg.max_in_flight, bcfg.queued_target, bcfg.retry_s
        self.max_body = service.max_body_bytes
        self.max_prompts = service.max_prompts
        self.input_path = service.files.data_path(rec.input_file_id)
        self.out = ResultLog(service.files.data_path(rec.output_file_id), bcfg.max_result_bytes)
        self.err = ResultLog(service.files.data_path(rec.error_file_id), bcfg.max_result_bytes)
        self.fence = service.store.fence(
            rec.id, token
        )  # token: this router's lease grant (router.services.batch.lease)
        self.done = bytearray()
        self.cursor = 0  # the next physical input line to read
        self._input: IO[bytes] | None = None
        self.eof = False
        self.in_flight: dict[int, LineSink | EmbeddingLine] = {}  # job handle -> its line
        self.retry: collections.deque[tuple[float, int, bytes]] = collections.deque()  # (not before, line, raw)
        self._out_buf: list[bytes] = []
        self._err_buf: list[bytes] = []
        self._flushing: asyncio.Future[Any] | None = None
        self._write_failed = False  # the batch fails: nothing more is written
        self._flush_timer: asyncio.TimerHandle | None = None
        self._pending = [0, 0, 0, 0, 0]  # unflushed: completed, failed, input, output, cached tokens
        self._kicked = False
        self.wake = asyncio.Event()
        self.ended = False
        self.stopped = False
        self.draining = False  # the router drains: no more lines; hand the batch on once the running ones end
        self.handed_off = False  # the run ended with the batch still running: its lease goes to another router
        self.started_mono = time.monotonic()
        self.done_at_start = 0
        self.dirty = True
        self.disk_full_since: float | None = None  # writes fail for want of room: feeding waits
        self._unfinished_written = 0  # expiry/revocation entries written by an attempt a full disk cut short
        self.who: Identity | p.ErrorInfo = self._identity()
        self.revoked = isinstance(self.who, p.ErrorInfo)  # its key is gone: cancelled at the next step

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
                    self._disk_full(e)  # tried again at the next step
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
            await self._save()
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
            await self._save()
            self.ended = True
            return False
        rec.move(m.IN_PROGRESS)
        await self._save_or_wait()
        return True

    async def _recover(self) -> None:
        """What is done already: from the result files alone (a line written is never sent again)."""
        self.done = bytearray((self.rec.input_lines + 7) // 8)
        await self._io(self.out.recover, self.done)
        await self._io(self.err.recover, self.done)
        rec = self.rec
        if (rec.completed, rec.failed) != (self.out.lines, self.err.lines):
            rec.completed, rec.failed = self.out.lines, self.err.lines
            self.dirty = True
        if rec.usage != self.out.usage:  # (the state saved last may lag the files: a crash between)
            rec.usage = msgspec.structs.replace(self.out.usage)
            self.dirty = True
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
            self.dirty = True
            self._cancel_queued()
        if rec.status == m.IN_PROGRESS:
            self.feed()
            if self.draining:
                if not self.in_flight:
                    await self._hand_off()
                return
            if self.eof and not self.retry and not self.in_flight:
                await self._drain()
                if self.stopped or self._write_failed or rec.status != m.IN_PROGRESS:
                    return
                rec.move(m.FINALIZING)
                return await self._finish(m.COMPLETED)
        elif rec.status == m.CANCELLING and not self.in_flight:
            return await self._finish(m.CANCELLED)
        if self.dirty:
            await self._save_or_wait()

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
        if self.disk_full_since is not None:
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
        await self._drain()
        if self.stopped or self._write_failed:  # (a failed write: _fail ends the batch, under the lease still)
            return
        await self._save()
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
            if raw.strip() and line < self.rec.input_lines and not is_done(self.done, line):
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
    ) -> tuple[LineSink | EmbeddingLine, p.ErrorInfo | None]:
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

    # ------------------------------------------------------------ results

    def _end_line(self, sink: LineSink | EmbeddingLine) -> None:
        """The line is over: none of its jobs is in flight (those still running are cancelled)."""
        for h in sink.handles:
            if self.in_flight.pop(h, None) is not None and len(sink.handles) > 1:
                self.core.cancel(h)  # (a job that ended already: a no-op)

    def line_ok(self, sink: LineSink | EmbeddingLine, body: bytes) -> None:
        self._end_line(sink)
        entry = {
            "id": result_id(self.rec.id, sink.line),
            "custom_id": sink.custom_id,
            "response": {"status_code": 200, "request_id": sink.ctx.id, "body": msgspec.Raw(body)},
            "error": None,
        }
        mark_done(self.done, sink.line)
        self._out_buf.append(_encode(entry) + b"\n")
        pend = self._pending
        pend[0] += 1
        usage = _usage_decoder.decode(body).usage
        tokens = 0
        if usage is not None:
            pend[2] += usage.prompt_tokens
            pend[3] += usage.completion_tokens
            pend[4] += (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
            tokens = usage.prompt_tokens + usage.completion_tokens
            self.svc.charge(self.rec.owner, tokens)
        self.svc.stats.line_done(self.rec.owner, 1, 0, tokens)
        self._flush_soon()
        self.kick()

    def line_refused(self, sink: LineSink | EmbeddingLine, err: p.ErrorInfo) -> None:
        self._end_line(sink)
        if m.retryable(err.status, err.code, err.type) and self.rec.status == m.IN_PROGRESS:
            self._retry_later(sink.line, sink.raw, err)
            self.kick()
            return
        self._error_entry(sink.line, sink.custom_id, err)
        self.kick()

    def _error_entry(self, line: int, custom_id: str, err: p.ErrorInfo) -> None:
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
        self.svc.stats.line_done(self.rec.owner, 0, 1)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flush_timer is None and self._flushing is None:
            wait = FLUSH_S if self.disk_full_since is None else self.retry_s
            self._flush_timer = asyncio.get_running_loop().call_later(wait, self._flush)

    def _flush(self) -> None:
        self._flush_timer = None
        if self._flushing is not None or self.stopped or self._write_failed or not (self._out_buf or self._err_buf):
            return
        out, self._out_buf = self._out_buf, []
        err, self._err_buf = self._err_buf, []
        counts, self._pending = self._pending, [0, 0, 0, 0, 0]
        fut = asyncio.get_running_loop().run_in_executor(self.svc.io, self._write, out, err)
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
            if not self.stopped and not self._write_failed:
                self._write_failed = True
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
            self._disk_full(exc)
        elif self.disk_full_since is not None:
            self._disk_ok()
        rec = self.rec
        rec.completed += counts[0]
        rec.failed += counts[1]
        rec.usage.input_tokens += counts[2]
        rec.usage.output_tokens += counts[3]
        rec.usage.cached_tokens += counts[4]
        self.dirty = True
        if (self._out_buf or self._err_buf) and not self.stopped and not self._write_failed:
            self._flush_soon()

    def _disk_full(self, exc: BaseException) -> None:
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
        self.kick()

    async def _drain(self) -> None:
        """Every result so far on disk."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        while not self.stopped and not self._write_failed:
            if self._flushing is not None:
                await asyncio.wait([self._flushing])
                continue
            if not (self._out_buf or self._err_buf):
                return
            if self.disk_full_since is not None:
                await asyncio.sleep(self.retry_s)  # no room: try again in a while, not in a loop
            self._flush()  # (nothing if a timer's flush runs already: awaited above next turn)

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

    def _withdraw(self, sink: LineSink | EmbeddingLine) -> None:
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
        await self._drain()
        if self.stopped or self._write_failed:  # (a failed write: _fail ends it)
            return False
        try:
            await self._io(self._write_unfinished, code, message)
        except ResultsTooLarge as e:
            await self._fail("results_too_large", str(e))
            return False
        except OSError as e:
            if disk_full(e):
                raise  # tried again at the next step (main): the entries written so far are marked done
            await self._fail("results_write_failed", f"Writing {what} entries failed ({e}).")
            return False
        self.rec.failed += self._unfinished_written
        self._unfinished_written = 0
        return True

    def _write_unfinished(self, code: str, message: str) -> None:
        with self.fence.hold():
            self._write_unfinished_fenced(code, message)

    def _write_unfinished_fenced(self, code: str, message: str) -> None:
        """An error entry (``code``, ``message``) for every line not done (counted in ``_unfinished_written``)."""
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
                if len(chunk) >= 4096:
                    write()
        if chunk:
            write()

    async def _finish(self, status: str) -> None:
        await self._drain()
        if self.stopped or self._write_failed:  # (a failed write: _fail ends it)
            return
        if status == m.COMPLETED and self.rec.status != m.FINALIZING:
            self.rec.move(m.FINALIZING)
        await self._end_files(status)

    async def _end_files(self, status: str) -> None:
        """Output and error files become visible (/v1/files), then the batch ends and is saved.

        In that order: a terminal batch shows its file ids at once, and a client that reads
        one on seeing the status must find the file (the register runs off the loop)."""
        rec = self.rec
        await self._register_files()
        was, stamps = rec.status, dict(rec.stamps)
        rec.move(status)
        try:
            await self._save()
        except OSError as e:
            if disk_full(e):  # not ended until saved: back as it was, tried again at the next step
                rec.status, rec.stamps = was, stamps
            raise
        self.ended = True
        log.info("batch %s %s: %d completed, %d failed of %d", rec.id, rec.status, rec.completed, rec.failed, rec.total)

    async def _register_files(self) -> None:
        """The result files become visible: before any end status shows their ids."""
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
        rec, files = self.rec, self.svc.files
        self.out.close()
        self.err.close()
        exp = rec.output_expires_after_s
        if rec.completed:
            files.register(rec.owner, rec.output_file_id, f"{rec.id}_output.jsonl", "batch_output", exp)
        if rec.failed:
            files.register(rec.owner, rec.error_file_id, f"{rec.id}_error.jsonl", "batch_output", exp)

    async def _fail(self, code: str, message: str) -> None:
        try:
            await self._fail_fenced(code, message)
        except StaleLease as e:
            self._stale(e)

    async def _fail_fenced(self, code: str, message: str) -> None:
        self._withdraw_all()
        rec = self.rec
        rec.failed += self._unfinished_written  # expiry/revocation entries written before the failure
        self._unfinished_written = 0
        try:
            await self._register_files()
        except OSError as e:  # (a full disk: failing anyway, what could be registered was)
            log.error("batch %s: registering result files failed: %s", rec.id, e)
        rec.errors = [*rec.errors, BatchError(code, message)]
        if rec.status not in m.TERMINAL:
            rec.status = m.FAILED  # from any state: a failure is always recorded
            rec.stamps[m.STAMP[m.FAILED]] = int(time.time())
        try:
            await self._save()
        except OSError as e:
            log.error("batch %s: saving its failed state failed too: %s", rec.id, e)
        self.ended = True

    async def _save(self) -> None:
        self.dirty = False
        try:
            await self._io(self.svc.store.save, msgspec.structs.replace(self.rec), self.fence)
        except BaseException:
            self.dirty = True
            raise
        if self.disk_full_since is not None and self._flushing is None and not (self._out_buf or self._err_buf):
            self._disk_ok()  # the pause came from a save, and this one went through (no result waits for room)

    async def _save_or_wait(self) -> None:
        """Save; with the disk full, carry on: it is saved at a later step."""
        try:
            await self._save()
        except OSError as e:
            if not disk_full(e):
                raise
            self._disk_full(e)

    def stop(self) -> None:
        """The lease is lost (or the router stops): drop out at once, write nothing more."""
        self.stopped = True
        self._withdraw_all()
        self._out_buf.clear()
        self._err_buf.clear()
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
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
