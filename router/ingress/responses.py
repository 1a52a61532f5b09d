"""``/v1/responses`` on the HTTP ingress: create (streamed, whole or in the
background), retrieve, delete and cancel, over a ``router.services.response_store``.

A turn runs as a chat request through the lifecycle like any other (the
same admission, budgets, scheduling, resume on worker loss); only its
rendering differs (router.api.responses_stream) and, when it is to be
stored, its last bytes wait for the store: a client that continues at once
finds it.  A response that could not be stored (store error, over
``max_stored_bytes``) is still served; continuing it gets the 404.

Ownership (router.tenancy.ownership): a stored response keeps its tenant and key;
retrieve, delete, cancel and ``previous_response_id`` answer another
tenant's response (or one whose key a reload removed) with the 404 of an
unknown id, and a caller without a valid key (keys configured) with 401.

Cancel: a background response running on this router is aborted and stored
as ``cancelled``; one that is not in progress gets a 400 (vLLM's answer for
a synchronous response); an unknown id a 404.  With the Redis store a cancel
must reach the router running the response (as vLLM's in-process task); on
another router it gets the 400 of a response not in progress here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import msgspec

from router import api
from router.api import responses as rs
from router.api.responses_stream import ResponsesAccumulator, ResponsesStream
from router.ingress.connection import Connection, Generation, Request
from router.ingress.exchange import Exchange, ExchangeFactory
from router.ingress.routes import JSON, Answer, ErrorReply, Reply
from router.services.response_store import ResponseStore, StoredResponse, decode_record, encode_record
from router.tenancy.ownership import Caller, KeyEntry, caller_of, may_see
from shared.errors import Code, error
from shared.protocol import Delta, ErrorInfo, Submit

log = logging.getLogger("weir.responses")

_PREFIX = b"/v1/responses/"


class TurnConnection(Connection, Protocol):
    """What a turn asks of its connection besides a handler's (router.ingress.http_server.HttpConnection)."""

    def meta(self, req: Request) -> api.RequestMeta: ...

    def run(
        self,
        req: Request,
        label: str,
        sub: Submit,
        ctx: api.ResponseContext,
        exchange: ExchangeFactory | None = None,
    ) -> None: ...


def _store_unavailable() -> ErrorInfo:
    return error(Code.SERVICE_UNAVAILABLE, "The response store is unavailable; retry later", retry_after=1.0)


class ResponsesApi:
    """/v1/responses: what the HTTP server (router.ingress.http_server) routes to it."""

    def __init__(
        self, core: Generation, store: ResponseStore, keys: Callable[[], Mapping[str, KeyEntry]] | None = None
    ) -> None:
        self.core = core
        self.store = store
        # the configured keys by digest, as the last reload left them (default: no keys)
        self.keys: Callable[[], Mapping[str, KeyEntry]] = keys or dict
        self.background: dict[str, tuple[int, BackgroundTurn]] = {}  # response id -> (handle, sink)

    def caller(self, req: Request) -> Caller | ErrorInfo:
        meta = api.meta_from_headers(req.header(b"authorization"), req.header(b"x-api-key"))
        return caller_of(self.keys(), meta.api_key)

    def _visible(self, record: StoredResponse, caller: Caller) -> bool:
        return may_see(record.tenant, caller.tenant, record.key, self.keys())

    # ------------------------------------------------------------ create

    def create(self, conn: TurnConnection, req: Request, label: str) -> None:
        caller = self.caller(req)
        if isinstance(caller, ErrorInfo):
            return conn.refuse(req, caller, label)
        try:
            rq = rs.decode_responses(req.body)
        except api.RequestError as e:
            return conn.refuse(req, e.info, label)
        if rq.previous_response_id is None:
            return self._start(conn, req, label, rq, None, caller)
        conn.busy = True  # later requests on the connection wait for the lookup
        asyncio.get_running_loop().create_task(self._continue(conn, req, label, rq, caller))

    async def _continue(
        self, conn: TurnConnection, req: Request, label: str, rq: rs.ResponsesRequest, caller: Caller
    ) -> None:
        prev = rq.previous_response_id
        assert prev is not None
        try:
            data = await self.store.get(prev)
        except Exception as e:
            log.warning("response store get failed: %s", e)
            return conn.refuse(req, _store_unavailable(), label)
        if conn.closed:
            return
        record = None if data is None else decode_record(data)
        if record is None or not self._visible(record, caller):
            return conn.refuse(req, rs.not_found(prev, "previous_response_id").info, label)
        try:
            self._start(conn, req, label, rq, record.messages, caller)
        except Exception:
            log.exception("continuing response %s failed", prev)
            conn.refuse(req, error(Code.INTERNAL, "Internal error"), label)

    def _start(
        self,
        conn: TurnConnection,
        req: Request,
        label: str,
        rq: rs.ResponsesRequest,
        previous: list[dict[str, Any]] | None,
        caller: Caller,
    ) -> None:
        try:
            sub, ctx, turn = rs.build_turn(rq, previous, conn.meta(req), api.new_request_id())
        except api.RequestError as e:
            return conn.refuse(req, e.info, label)
        if rq.background:
            return self._start_background(conn, req, label, sub, ctx, turn, caller)

        def exchange(c: Connection, r: Request, x: api.ResponseContext, lb: str) -> Exchange:
            return ResponsesExchange(c, r, x, lb, turn, self, caller)

        conn.run(req, label, sub, ctx, exchange)

    def _start_background(
        self,
        conn: TurnConnection,
        req: Request,
        label: str,
        sub: Submit,
        ctx: api.ResponseContext,
        turn: rs.Turn,
        caller: Caller,
    ) -> None:
        """Answer at once with the queued object; the turn runs on, its end stored."""
        if ctx.tools is not None:  # as HttpConnection.run does
            try:
                api.read_with_model(sub, ctx.tools, self.core.tool_parser)
            except api.RequestError as e:
                return conn.refuse(req, e.info, label)
        sink = BackgroundTurn(self, ctx, turn, caller)
        sub.trace_id = turn.id
        result = self.core.submit(sub, sink)
        if isinstance(result, ErrorInfo):
            return conn.refuse(req, result, label)
        self.background[turn.id] = (result, sink)
        queued = api.encode(rs.response_object(turn, "queued", [], None))
        conn.busy = True

        async def answer() -> None:
            await self.put(turn, queued, [], caller)
            if not conn.closed:
                conn.respond(req, 200, JSON, queued, label)

        asyncio.get_running_loop().create_task(answer())

    async def put(self, turn: rs.Turn, body: bytes, output: list[dict[str, Any]], owner: Caller) -> None:
        """Store a response (when its request says so) as ``owner``'s; never raises."""
        if turn.req.store is False:
            return
        record = encode_record(body, [*turn.history, *rs.output_messages(output)], owner.tenant, owner.key)
        try:
            await self.store.put(turn.id, record, owner.tenant)
        except Exception as e:
            log.warning("storing response %s failed (served, not stored): %s", turn.id, e)

    # ------------------------------------------------------------ by id

    def by_id(self, req: Request) -> Answer | Awaitable[Answer]:
        """GET /v1/responses/{id}, DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel."""
        rest = req.path[len(_PREFIX) :].decode("utf-8", "replace")
        rid, _, action = rest.partition("/")
        known = (action == "cancel" and req.method == b"POST") or (not action and req.method in (b"GET", b"DELETE"))
        if not known:
            if action in ("", "cancel"):
                allow = b"POST" if action else b"GET, DELETE"
                return ErrorReply(error(Code.METHOD_NOT_ALLOWED, "use " + allow.decode()), b"allow: " + allow + b"\r\n")
            return ErrorReply(error(Code.NOT_FOUND, f"No route for {req.path.decode('latin-1')!r}"))
        caller = self.caller(req)
        if isinstance(caller, ErrorInfo):
            return ErrorReply(caller)
        if action == "cancel":
            return self._cancel(rid, caller)
        return self._retrieve(rid, caller) if req.method == b"GET" else self._delete(rid, caller)

    async def _record(self, rid: str, caller: Caller) -> StoredResponse | ErrorInfo:
        """The caller's stored response ``rid``: another tenant's is the 404 of one never stored."""
        try:
            data = await self.store.get(rid)
        except Exception as e:
            log.warning("response store get failed: %s", e)
            return _store_unavailable()
        record = None if data is None else decode_record(data)
        if record is None or not self._visible(record, caller):
            return rs.not_found(rid, "response_id").info
        return record

    async def _retrieve(self, rid: str, caller: Caller) -> Answer:
        record = await self._record(rid, caller)
        if isinstance(record, ErrorInfo):
            return ErrorReply(record)
        return Reply(200, bytes(record.response))

    async def _delete(self, rid: str, caller: Caller) -> Answer:
        record = await self._record(rid, caller)
        if isinstance(record, ErrorInfo):
            return ErrorReply(record)
        try:
            deleted = await self.store.delete(rid, record.tenant)
        except Exception as e:
            log.warning("response store delete failed: %s", e)
            return ErrorReply(_store_unavailable())
        if not deleted:
            return ErrorReply(rs.not_found(rid, "response_id").info)
        return Reply(200, api.encode({"id": rid, "object": "response", "deleted": True}))

    async def _cancel(self, rid: str, caller: Caller) -> Answer:
        running = self.background.get(rid)
        owner = None if running is None else running[1].owner
        if owner is not None and not may_see(owner.tenant, caller.tenant, owner.key, self.keys()):
            running = None  # another tenant's: as if not running here, so the store answers (404)
        if running is None:
            record = await self._record(rid, caller)
            if isinstance(record, ErrorInfo):
                return ErrorReply(record)
            return ErrorReply(
                error(Code.BAD_REQUEST, "Cannot cancel a response that is not in progress.", param="response_id")
            )
        handle, sink = running
        self.core.cancel(handle)  # its sink hears nothing more: store the end here
        body = await sink.end("cancelled")
        return Reply(200, body)


class ResponsesExchange(Exchange):
    """One response in flight on its connection: Responses rendering, and
    its last bytes sent once it is stored."""

    __slots__ = ("turn", "service", "storing", "owner")

    def __init__(
        self,
        conn: Connection,
        req: Request,
        ctx: api.ResponseContext,
        label: str,
        turn: rs.Turn,
        service: ResponsesApi,
        owner: Caller,
    ) -> None:
        super().__init__(conn, req, ctx, label)
        self.turn = turn
        self.service = service
        self.owner = owner
        self.storing = False
        self._shape()

    def _shape(self) -> None:
        if self.ctx.stream:
            self.renderer = ResponsesStream(self.ctx, self.turn)
        else:
            self.counts = ResponsesAccumulator(self.ctx, self.turn)

    def _answered_by(self, model: str) -> None:
        super()._answered_by(model)
        self.turn.req = msgspec.structs.replace(self.turn.req, model=model)
        self._shape()

    def _accumulate(self, deltas: list[Delta]) -> None:
        acc = self.counts
        assert isinstance(acc, ResponsesAccumulator)
        acc.add(deltas)
        last = deltas[-1]
        if last.error is not None:
            self.done = True
            self.conn.respond_error(self.req, last.error, self.label, self.rl if last.error.ratelimit is None else b"")
        elif last.finish_reason is not None:
            self.done = True
            body = acc.render()
            extra = self.extra + self.rl

            async def store_then_answer() -> None:
                await self.service.put(self.turn, body, acc.output, self.owner)
                self.conn.respond(self.req, 200, JSON, body, self.label, extra)

            asyncio.get_running_loop().create_task(store_then_answer())

    def _stream(self, deltas: list[Delta], renderer: api.StreamRenderer) -> None:
        super()._stream(deltas, renderer)
        if not isinstance(renderer, ResponsesStream) or renderer.final is None or self.storing:
            return
        self.storing = True
        self.done = True  # the core is done with it; the end waits for the store
        response = renderer.response
        assert response is not None

        async def store_then_end() -> None:
            await self.service.put(self.turn, api.encode(response), renderer.output, self.owner)
            self.out.append(renderer.release_final())
            self.flush()

        asyncio.get_running_loop().create_task(store_then_end())


class BackgroundTurn:
    """The sink of a background response: no connection; its end is stored."""

    def __init__(self, service: ResponsesApi, ctx: api.ResponseContext, turn: rs.Turn, owner: Caller) -> None:
        self.service = service
        self.turn = turn
        self.owner = owner
        self.acc = ResponsesAccumulator(ctx, turn)
        self.ended = False

    def on_deltas(self, deltas: list[Delta]) -> None:
        if self.ended or not deltas:
            return
        self.acc.add(deltas)
        last = deltas[-1]
        if last.error is not None:
            asyncio.get_running_loop().create_task(self.end("failed", last.error))
        elif last.finish_reason is not None:
            asyncio.get_running_loop().create_task(self.end(None))

    async def end(self, status: str | None, err: ErrorInfo | None = None) -> bytes:
        """Store the response's end state: its output (``status`` None), or cancelled / failed."""
        self.ended = True
        self.service.background.pop(self.turn.id, None)
        if status is None:
            body = self.acc.render()
        else:
            usage = rs.usage_object(self.acc.counts)
            eobj = None if err is None else {"code": err.code or err.type, "message": err.message}
            body = api.encode(rs.response_object(self.turn, status, [], usage, None, eobj))
        await self.service.put(self.turn, body, self.acc.output, self.owner)
        return body
