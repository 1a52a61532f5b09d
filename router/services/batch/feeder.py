"""One batch's lines fed into the normal submit path.

``LineFeeder`` streams the input file (never loaded whole) and submits each
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
line's end goes to the run's ``ResultWriter`` (router.services.batch.results);
while it waits for room on a full disk, no new line is sent.

A draining router (router.lifecycle.drain): the feeder sends no more lines,
withdraws those still queued (not started: the next holder sends them) and
lets the running ones finish; the run (router.services.batch.run) then hands
the batch on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import IO, TYPE_CHECKING

from router import api
from router.lifecycle.fanout import PromptFanOut, echo_texts
from router.lifecycle.jobs import RUNNING, job_id_of
from router.services.batch import rules as m
from router.services.batch.lines import AsOwner, EmbeddingLine, InFlightLine, LineSink
from router.services.batch.store import BatchRecord, result_id
from router.services.batch.validate import LineJobs, decode_line, to_jobs, with_model_tools
from router.tenancy.identity import Identity
from shared import protocol as p
from shared.errors import Code, error

if TYPE_CHECKING:
    from router.services.batch.host import BatchHost
    from router.services.batch.results import ResultWriter

log = logging.getLogger("weir.batch")

READ_PER_PASS = 4096  # input lines read per feeding pass at most (bad lines cost no slot)


class LineFeeder:
    """One run's feeding: the ``LineOwner`` of its lines in flight (router.services.batch.lines)."""

    def __init__(
        self,
        host: BatchHost,
        rec: BatchRecord,
        results: ResultWriter,
        wake: asyncio.Event,
        who: Identity | p.ErrorInfo,
    ) -> None:
        self.svc = host
        self.core = host.core
        self.rec = rec
        self.results = results
        self.wake = wake  # the run's: it steps when a line's end may end the batch, or the drain starts
        self.who = who  # the lines' identity (the run's, checked again when the keys are reloaded)
        bcfg = host.bcfg
        self.window, self.queue_target, self.retry_s = bcfg.max_in_flight, bcfg.queued_target, bcfg.retry_s
        self.max_body = host.max_body_bytes
        self.max_prompts = host.max_prompts
        self.input_path = host.files.data_path(rec.input_file_id)
        self.cursor = 0  # the next physical input line to read
        self._input: IO[bytes] | None = None
        self.eof = False
        self.in_flight: dict[int, InFlightLine] = {}  # job handle -> its line
        self.retry: collections.deque[tuple[float, int, bytes]] = collections.deque()  # (not before, line, raw)
        self._kicked = False
        self.draining = False  # the router drains: no more lines; the batch is handed on once the running ones end

    async def open(self) -> None:
        """The input, from its start (the lines done already are skipped as they are read)."""
        self._input = await asyncio.get_running_loop().run_in_executor(self.svc.io, open, self.input_path, "rb")

    def close(self) -> None:
        if self._input is not None:
            self._input.close()
            self._input = None

    # ------------------------------------------------------------ sending

    def kick(self) -> None:
        """A line ended: top the queue up at the end of this loop turn (once per turn)."""
        if not self._kicked:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._kick)

    def _kick(self) -> None:
        self._kicked = False
        if not self.results.stopped and self.rec.status == m.IN_PROGRESS:
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
            self.cancel_queued()
        log.info(
            "batch %s: router draining; %d lines running finish here, then the batch moves on",
            self.rec.id,
            len(self.in_flight),
        )
        self.wake.set()

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
            with_model_tools(jobs, self.core.tool_parser)
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

    # ------------------------------------------------------------ withdrawing

    def cancel_queued(self) -> None:
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

    def withdraw_all(self) -> None:
        for sink in list(self.in_flight.values()):
            self._withdraw(sink)
        self.retry.clear()
