"""``POST /v1/embeddings`` on the HTTP ingress: one job per input, one answer.

The parser (router.api.embeddings) turns the body into one
``Submit`` per input; each goes to the core as its own job with its own
sink (``_Part``), so each is admitted, reserved, budgeted and placed on its
own (their request units, though, are one reservation: router.tenancy.budgets.Group).
``EmbeddingsExchange`` gathers their vectors and writes the response when
the last one arrives.  The first refusal or error ends the whole request:
the other inputs are cancelled (their reservations released, their budgets
settled on what ran: nothing for what never started) and the client gets
that error.  A client that goes away cancels every input the same way.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from router import api
from router.ingress.connection import Connection, Request
from router.ingress.exchange import STATUS_CLIENT_GONE
from router.ingress.headers import ratelimit_headers
from router.ingress.routes import JSON
from router.lifecycle.ports import RequestSink
from router.tenancy.budgets import Group
from shared.errors import Code, error
from shared.otlp import parse_traceparent
from shared.protocol import Delta, ErrorInfo, Submit

log = logging.getLogger("weir.http")


class _Core(Protocol):
    def submit(self, sub: Submit, sink: RequestSink, *, group: Group | None = None) -> int | ErrorInfo: ...

    def cancel(self, handle: int) -> None: ...


class _Part:
    """The sink of one input's job."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: EmbeddingsExchange, index: int) -> None:
        self.batch = batch
        self.index = index

    def on_deltas(self, deltas: list[Delta]) -> None:
        self.batch.on_part(self.index, deltas)


class EmbeddingsExchange:
    """One /v1/embeddings request in flight (the connection's current exchange)."""

    __slots__ = ("conn", "req", "ctx", "label", "core", "handles", "vectors", "left", "prompt_tokens", "done", "rl")

    # What its connection reads of the response in progress (router.ingress.connection.InFlight).
    renderer = None
    queued = False

    def __init__(self, conn: Connection, req: Request, ctx: api.EmbeddingContext, label: str, core: _Core) -> None:
        self.conn = conn
        self.req = req
        self.ctx = ctx
        self.label = label
        self.core = core
        self.handles: list[int] = []
        self.vectors: list[bytes] = [b""] * ctx.count
        self.left = ctx.count
        self.prompt_tokens = 0
        self.done = False
        self.rl = b""  # x-ratelimit-* headers, from the latest input that carried them

    def start(self, subs: list[Submit]) -> None:
        group = Group(len(subs)) if len(subs) > 1 else None  # its request units: all or none
        failed = True
        try:
            for i, sub in enumerate(subs):
                result = self.core.submit(sub, _Part(self, i), group=group)
                if isinstance(result, ErrorInfo):
                    return self._fail(result)
                self.handles.append(result)
            failed = False
        finally:
            if group is not None:
                group.close(failed)

    def on_part(self, index: int, deltas: list[Delta]) -> None:
        if self.done:
            return
        for d in deltas:
            if d.ratelimit is not None:
                self.rl = ratelimit_headers(d.ratelimit)
        last = deltas[-1]
        if last.error is not None:
            return self._fail(last.error)
        if last.finish_reason is None:
            return  # (an embedding has one Delta; nothing else is expected before it)
        if not last.embedding:
            return self._fail(
                error(Code.ENGINE_ERROR, f"The engine ended an embedding without a vector ({last.finish_reason}).")
            )
        self.vectors[index] = last.embedding
        self.prompt_tokens += last.prompt_tokens
        self.left -= 1
        if self.left == 0:
            self.done = True
            try:
                body = api.encode(api.render_embeddings(self.ctx, self.vectors, self.prompt_tokens))
            except Exception:  # a bug here must not escape into the core's loop
                log.exception("rendering embeddings failed")
                return self.conn.respond_error(self.req, error(Code.INTERNAL, "Internal error"), self.label)
            rid = self.req.rid or ""
            self.conn.respond(self.req, 200, JSON, body, self.label, b"x-request-id: %b\r\n" % rid.encode() + self.rl)

    def _fail(self, err: ErrorInfo) -> None:
        self.done = True
        self.cancel_jobs()
        self.conn.respond_error(self.req, err, self.label, self.rl if err.ratelimit is None else b"")

    def cancel_jobs(self) -> None:
        """End every input's job in the core."""
        for h in self.handles:  # (one that ended already: a no-op)
            self.core.cancel(h)

    def client_gone(self) -> None:
        """The connection closed before the answer: cancel every input."""
        if not self.done:
            self.done = True
            self.cancel_jobs()
            self.conn.ingress.metrics.observe_http(self.label, STATUS_CLIENT_GONE, time.perf_counter() - self.req.t0)


def start_embeddings(conn: Connection, req: Request, label: str, core: _Core) -> None:
    meta = api.meta_from_headers(
        req.header(b"authorization"),
        req.header(b"x-api-key"),
        req.header(b"x-weir-priority"),
        req.header(b"x-weir-task-type"),
    )
    request_id = api.new_request_id()
    if req.rid is None:
        req.rid = "embd-" + request_id
    try:
        subs, ctx = api.parse_embeddings(req.body, meta, request_id)
    except api.RequestError as e:
        return conn.respond_error(req, e.info, label)
    tp = req.headers.get(b"traceparent")  # (router.observe.tracing: one request span per input)
    ctx_in = parse_traceparent(tp, req.headers.get(b"tracestate")) if tp is not None else None
    for sub in subs:
        sub.trace_id = req.rid
        sub.trace_context = ctx_in
    req.body = b""
    batch = EmbeddingsExchange(conn, req, ctx, label, core)
    conn.current = batch
    conn.busy = True
    try:
        batch.start(subs)
    except Exception:
        batch.done = True
        batch.cancel_jobs()
        conn.current = None
        conn.busy = False
        raise
