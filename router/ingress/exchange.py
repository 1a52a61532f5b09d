"""One generation request in flight on the HTTP ingress (router.ingress.http_server):
``Exchange`` is the ``RequestSink`` the core feeds its Deltas, and it turns
them into the response -- accumulated into one JSON body, or streamed as SSE
events, all of one event-loop turn in one write (the rules in
router.ingress.http_server's docstring)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from router import api
from router.ingress.connection import Connection, Request
from router.ingress.headers import ratelimit_headers, response_head
from router.ingress.routes import JSON as _JSON
from router.lifecycle.fanout import PromptFanOut
from router.observe.phases import server_timing
from shared.protocol import Delta

log = logging.getLogger("weir.http")

STATUS_CLIENT_GONE = 499  # metrics label for requests the client abandoned (nginx's convention)
# A stream's output waits for the end of the loop turn, unless this much is
# pending: when the router lags, one turn can drain hundreds of engine steps,
# and their tokens should not all wait for the last one.
STREAM_FLUSH_BYTES = 8192

_CHUNK_END = b"0\r\n\r\n"


class Exchange:
    """One generation request in flight: the ``RequestSink`` the core feeds."""

    __slots__ = (
        "conn",
        "req",
        "ctx",
        "label",
        "handle",
        "done",
        "started",
        "renderer",
        "texts",
        "counts",
        "out",
        "out_bytes",
        "head_unsent",
        "queued",
        "ended",
        "extra",
        "rl",
        "fan",
        "timing",
    )

    def __init__(self, conn: Connection, req: Request, ctx: api.ResponseContext, label: str):
        self.conn = conn
        self.req = req
        self.ctx = ctx
        self.label = label
        self.handle: int | None = None
        self.fan: PromptFanOut | None = None  # several prompts: their jobs (instead of ``handle``)
        self.done = False
        self.rl: bytes = b""  # x-ratelimit-* headers, from the first Delta (router/tenancy/budgets.py)
        self.started = False  # stream: the response is a 200 event stream (head sent or on its way)
        self.timing = b""  # the server-timing header, from the job's first and last news (router.observe.phases)
        rid = req.rid
        assert rid is not None  # the connection gave it one (HttpConnection.run_jobs)
        self.extra = b"x-request-id: %b\r\n" % rid.encode()  # + headers learnt from the core (x-weir-model)
        self.renderer: api.StreamRenderer | None  # None: a whole (non-streamed) response
        if ctx.stream:
            self.renderer = api.StreamRenderer(ctx)
            self.out: list[bytes] = []  # SSE bytes of this turn, written by flush()
            self.out_bytes = 0
            self.head_unsent = True
            self.queued = False  # flush() is scheduled
            self.ended = False  # the end of the stream is written
        else:
            self.renderer = None
            self.texts: list[str] = []
            # n > 1, logprobs, echo: the general accumulator; else the plain one below
            self.counts = api.Accumulator(ctx) if ctx.rich else api.TokenCounts()

    def cancel_jobs(self) -> None:
        """The client is gone or the response abandoned: end its job(s) in the core."""
        if self.fan is not None:
            self.fan.cancel()
        elif self.handle is not None:
            self.conn.ingress.core.cancel(self.handle)

    def on_deltas(self, deltas: list[Delta]) -> None:
        if self.done or self.conn.closed or not deltas:
            return
        last = deltas[-1]
        if last.error is not None and self.ctx.echo_logprobs:
            deltas = [*deltas[:-1], msgspec.structs.replace(last, error=api.echo_param(self.ctx, last.error))]
        if deltas[0].model and not self.started:
            self._answered_by(deltas[0].model)
        if deltas[0].ratelimit is not None:
            self.rl = ratelimit_headers(deltas[0].ratelimit)
        t = deltas[-1].timing or deltas[0].timing
        if t is not None:
            self.timing = server_timing(t)
        try:
            renderer = self.renderer
            if renderer is not None:
                self._stream(deltas, renderer)
            else:
                self._accumulate(deltas)
        except Exception:  # a bug here must not escape into the core's loop
            log.exception("rendering deltas failed; dropping connection")
            self.conn.abort(self, STATUS_CLIENT_GONE if self.started else 500)

    def _answered_by(self, model: str) -> None:
        """A fallback model answers: the body's ``model`` and a header say so."""
        self.ctx.model = model
        self.extra += b"x-weir-model: " + model.encode("latin-1", "replace") + b"\r\n"
        if self.renderer is not None:
            self.renderer = api.StreamRenderer(self.ctx)  # nothing rendered yet
        elif type(self.counts) is api.Accumulator:
            self.counts = api.Accumulator(self.ctx)

    def _accumulate(self, deltas: list[Delta]) -> None:
        counts = self.counts
        if isinstance(counts, api.Accumulator):
            counts.add(deltas)
            last = deltas[-1]
            if last.error is not None:
                self.done = True
                self.conn.respond_error(
                    self.req, last.error, self.label, (self.rl if last.error.ratelimit is None else b"") + self.timing
                )
            elif last.finish_reason is not None:
                self.done = True
                self.conn.respond(self.req, 200, _JSON, counts.render(), self.label, self.extra + self.rl + self.timing)
            return
        texts = self.texts
        for d in deltas:
            counts.add(d)
            if d.text:
                texts.append(d.text)
        last = deltas[-1]
        if last.error is not None:
            self.done = True
            self.conn.respond_error(
                self.req, last.error, self.label, (self.rl if last.error.ratelimit is None else b"") + self.timing
            )
        elif last.finish_reason is not None:
            self.done = True
            body = api.render_completion(
                self.ctx,
                "".join(texts),
                last.finish_reason,
                counts.prompt,
                counts.completion_total,
                counts.cached,
                last.stop_reason,
            )
            self.conn.respond(self.req, 200, _JSON, body, self.label, self.extra + self.rl + self.timing)

    def _stream(self, deltas: list[Delta], renderer: api.StreamRenderer) -> None:
        if not self.started:
            last = deltas[-1]
            if last.error is not None and not any(d.text for d in deltas):
                # Refused before any output (e.g. queue deadline): a real status.
                self.done = True
                self.conn.respond_error(
                    self.req, last.error, self.label, (self.rl if last.error.ratelimit is None else b"") + self.timing
                )
                return
            self.started = True
        payload = renderer.render(deltas)
        if payload:
            self.out.append(payload)
            self.out_bytes += len(payload)
        if renderer.finished:
            self.done = True
        if self.out_bytes >= STREAM_FLUSH_BYTES:
            self.flush()
        elif not self.queued:
            self.queued = True
            self.conn.ingress.flush_later(self)

    def flush(self) -> None:
        """Write what this turn produced (head, events, terminator) at once."""
        self.queued = False
        conn = self.conn
        if conn.closed or self.ended:
            return  # gone or aborted (the core was told already), or already complete
        try:
            transport = conn.transport
            req = self.req
            out = self.out
            payload = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self.out_bytes = 0
            renderer = self.renderer
            assert renderer is not None  # only a stream is flushed
            finished = renderer.finished
            self.ended = finished
            if self.head_unsent:
                self.head_unsent = False
                head = response_head(
                    200,
                    b"text/event-stream",
                    None,
                    req.keep_alive and req.http11,
                    chunked=req.http11,
                    extra=b"cache-control: no-cache\r\n" + self.extra + self.rl + self.timing,
                )
            else:
                head = b""
            if req.http11:
                if payload:
                    data = b"%b%x\r\n%b\r\n" % (head, len(payload), payload)
                else:  # an empty chunk would end the body
                    data = head
                if finished:
                    data += _CHUNK_END
            else:
                data = head + payload
            if data:
                transport.write(data)
            if finished:
                conn.response_complete(req, 200, self.label, req.keep_alive and req.http11)
            elif conn.write_paused and transport.get_write_buffer_size() > conn.ingress.max_buffered_bytes:
                log.warning(
                    "client too slow for its stream (%d bytes unsent); cancelling %s",
                    transport.get_write_buffer_size(),
                    self.ctx.id,
                )
                conn.abort(self, STATUS_CLIENT_GONE)
        except Exception:  # a bug here must not escape into the loop
            log.exception("writing a stream failed; dropping connection")
            conn.abort(self, STATUS_CLIENT_GONE)


# What makes a request's Exchange (router.ingress.responses: a Responses one).
ExchangeFactory = Callable[[Connection, Request, api.ResponseContext, str], Exchange]
