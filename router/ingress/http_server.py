"""The router's HTTP/1.1 ingress: a lean asyncio.Protocol on the httptools parser.

Its production peer is Envoy (keep-alive HTTP/1.1, no pipelining), but any
well-formed HTTP/1.1 client works: keep-alive, ``Connection: close``,
HTTP/1.0, chunked request bodies, ``Expect: 100-continue`` and even
pipelining (requests queue behind the response in progress).

Hot-path rules (measured: one socket write costs ~5.9 us, encoding ~0.2 us):
  * everything a stream receives in one event-loop turn -- response head, all
    SSE events of every ``on_deltas`` call, chunk framing, the terminating
    chunk -- goes out in ONE write at the end of the turn: a router that falls
    behind drains several engine steps per turn and then writes each stream
    once for all of them, so its streaming ceiling rises with the load;
  * a stream's head is sent with its first Delta, so a request refused while
    queued (a final Delta carrying ``error``) still gets a real HTTP status.

Entry point: ``start_http_server(core, views, metrics, host, port, operator=...)``:
``core`` is what generation needs (``Generation``, declared with what handlers
see of their request and connection in router.ingress.connection: the
lifecycle in router.lifecycle.core); ``views`` what the read-only routes show and
``operator`` what the admin actions change (``Views`` and ``Operator``,
declared with those routes in router.ingress.routes).  Every route is an entry
of one table, path -> (method, handler).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import httptools

from router import api
from router.api import agent_headers
from router.api.prompt_forms import DEFAULT_MAX_PROMPTS
from router.ingress import tokenize as http_tokenize
from router.ingress.connection import Flushable, Generation, InFlight, Request
from router.ingress.embeddings import EmbeddingsExchange, start_embeddings
from router.ingress.exchange import STATUS_CLIENT_GONE, Exchange, ExchangeFactory
from router.ingress.headers import error_headers, response_head
from router.ingress.responses import ResponsesApi
from router.ingress.routes import (
    ADMIN_PREFIX,
    LORA_ADMIN_PATHS,
    Answer,
    BodyRoute,
    BodySink,
    ErrorReply,
    Handler,
    Operator,
    PatternRoute,
    Reply,
    Routes,
    Stream,
    Views,
    admin_allowed,
    admin_refusal,
    routes,
)
from router.ingress.routes import JSON as _JSON
from router.lifecycle.fanout import PromptFanOut, echo_texts
from router.observe.metrics import RouterMetrics
from router.observe.phases import total_only
from shared.errors import Code, error
from shared.otlp import parse_traceparent
from shared.protocol import MAX_TRACE_ID, ErrorInfo, Submit

log = logging.getLogger("weir.http")

# Headers the ingress reads; every other header is skipped while parsing.
_WANTED_HEADERS = frozenset(
    (
        b"authorization",
        b"x-api-key",
        b"x-weir-priority",
        b"x-weir-task-type",
        b"x-weir-allow-fallback",
        b"content-length",
        b"expect",
        b"x-request-id",
        b"content-type",  # multipart uploads (/v1/files)
        b"traceparent",  # W3C trace context: the client's or Envoy's (router.observe.tracing)
        b"tracestate",
        *agent_headers.HEADERS,  # sessions, gateways' priorities, latency targets
    )
)
_KEY_HEADERS = (b"x-api-key", b"authorization")
# What router.admin_http serves (probes, scrapes, operators); the API stays on router.http.
ADMIN_PLANE_PATHS = (ADMIN_PREFIX, b"/metrics", b"/health", *LORA_ADMIN_PATHS)
LINGER_S = 2.0  # after an error reply, how long to drain a client's remaining input
MAX_PIPELINED = 16  # queued requests per connection before reading pauses


def _is_loopback(peer: Any) -> bool:
    """A TCP peer ``(host, port, ...)`` on a loopback address."""
    try:
        return ipaddress.ip_address(peer[0]).is_loopback
    except (TypeError, ValueError, IndexError):
        return False


class _BodyTooLarge(Exception):
    pass


_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_TRACE_ID)  # a regex: ~0.3 us, a loop over bytes ~3 us


def _request_id(value: bytes | None) -> str | None:
    """The client's or Envoy's x-request-id, if it is one we can log and echo
    (printable ASCII, no spaces, at most MAX_TRACE_ID); else None (ours is used)."""
    if value is None or _REQUEST_ID.fullmatch(value) is None:
        return None
    return value.decode("ascii")


class _Request:
    """A parsed request (handlers see it as router.ingress.connection.Request)."""

    __slots__ = ("method", "path", "headers", "body", "keep_alive", "http11", "t0", "rid", "query", "sink")

    def __init__(
        self,
        method: bytes,
        path: bytes,
        headers: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        http11: bool,
        query: bytes = b"",
    ):
        self.method = method
        self.path = path
        self.query = query  # after the "?" (paged lists: after, limit)
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http11 = http11
        self.t0 = time.perf_counter()
        self.rid = _request_id(headers.get(b"x-request-id"))  # generation: its own id if None
        self.sink: BodySink | ErrorReply | None = None  # a streamed body's (router.ingress.routes.BodyRoute)

    def header(self, name: bytes) -> str | None:
        v = self.headers.get(name)
        return None if v is None else v.decode("latin-1")


class _Ingress:
    """State shared by every connection of one server."""

    def __init__(
        self,
        core: Generation,
        views: Views,
        operator: Operator | None,
        metrics: RouterMetrics,
        max_body_bytes: int,
        max_buffered_bytes: int,
        connections: set[HttpConnection],
        max_prompts: int,
        extra: Routes | None = None,
        max_upload_bytes: int = 0,
        responses: ResponsesApi | None = None,
        admin_token: str | None = None,
        admin_plane: bool = False,
        session_headers: Sequence[str] = (),
    ):
        self.core = core
        self.agent = agent_headers.AgentHeaders(session_headers)  # with scheduler.session_headers
        self.wanted = _WANTED_HEADERS | self.agent.names  # what a connection keeps of the headers
        self.admin_token = admin_token  # /admin/*: router.ingress.routes.admin_allowed
        self.admin_plane = admin_plane  # router.admin_http: ADMIN_PLANE_PATHS only
        self.connections = connections  # open ones: what a drain waits on (``written_out``)
        self.max_prompts = max_prompts  # per completion request (router.max_prompts_per_request)
        self.responses = responses
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max(max_upload_bytes, max_body_bytes)
        self.max_buffered_bytes = max_buffered_bytes
        self.started = int(time.time())
        self.loop = asyncio.get_running_loop()
        self._unflushed: list[Flushable] = []  # streams with output waiting for the end of this turn
        table = routes(views, operator, self.started)
        # path -> (the method it takes, or b"*": any; handler)
        self.routes: dict[bytes, tuple[bytes, Callable[[HttpConnection, _Request, str], None]]] = {
            b"/v1/completions": (b"POST", HttpConnection.completions),
            b"/v1/chat/completions": (b"POST", HttpConnection.chat),
            b"/v1/embeddings": (b"POST", HttpConnection.embeddings),
            b"/tokenize": (b"POST", http_tokenize.tokenize),
            b"/detokenize": (b"POST", http_tokenize.detokenize),
            **{path: (r.method, _answering(r.handler)) for path, r in table.exact.items()},
        }
        self.patterns: list[PatternRoute] = table.patterns  # when no path matches: in order
        self.bodies: dict[bytes, BodyRoute] = {}  # POST path -> where its body streams (uploads)
        if extra is not None:  # (the Batch API: router.ingress.files_batches)
            self.routes.update({path: (r.method, _answering(r.handler)) for path, r in extra.exact.items()})
            self.patterns = [*extra.patterns, *self.patterns]
            self.bodies.update(extra.bodies)
        if responses is not None:
            self.routes[b"/v1/responses"] = (b"POST", HttpConnection.responses)
            self.patterns.append(PatternRoute(b"/v1/responses/", (), b"*", "/v1/responses/{id}", responses.by_id))

    def flush_later(self, stream: Flushable) -> None:
        if not self._unflushed:
            self.loop.call_soon(self._flush)
        self._unflushed.append(stream)

    def _flush(self) -> None:
        streams, self._unflushed = self._unflushed, []
        for stream in streams:
            stream.flush()


class HttpConnection(asyncio.Protocol):
    """One client connection.  httptools calls the ``on_*`` methods while
    ``data_received`` feeds it; a complete request is answered at once, or
    queued behind the response in progress (pipelining)."""

    def __init__(self, ingress: _Ingress):
        self.ingress = ingress
        self.parser = httptools.HttpRequestParser(self)
        # set by connection_made, before any data_received: every use below comes after it
        self.transport: asyncio.Transport
        self.closed = False  # closing or closed: write nothing more
        self.dead_input = False  # parse error seen: ignore further bytes
        self.write_paused = False
        self.reading_paused = False  # too many pipelined requests queued
        self.body_paused = False  # a streamed body's sink is behind (router.ingress.routes.BodySink)
        self._drained: asyncio.Future[None] | None = None  # a streamed answer waiting for the socket
        self.current: InFlight | None = None  # generation whose response is in progress
        self.busy = False  # a response is in progress (generation or not)
        self.pending: deque[_Request | ErrorInfo] = deque()  # requests, or an input error to answer
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_len = 0
        self._body_limit = ingress.max_body_bytes
        self._wanted = ingress.wanted
        self._streamed: _Request | None = None  # the request whose body goes to its sink as it arrives
        self._keep_alive = True
        self._http11 = True
        self._upgrade = False
        self.loopback = False  # the peer's address is a loopback one (connection_made)

    # ---------------------------------------------------------- asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream server's transport: asyncio.Protocol's signature is BaseProtocol's)
        self.transport = cast(asyncio.Transport, transport)
        self.ingress.connections.add(self)
        self.loopback = _is_loopback(transport.get_extra_info("peername"))

    def data_received(self, data: bytes) -> None:
        if self.dead_input or self.closed:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            self._drop_streamed()
            if isinstance(e.__context__, _BodyTooLarge):
                self._input_error(Code.REQUEST_TOO_LARGE, f"Request body exceeds the limit of {self._body_limit} bytes")
            else:
                log.error("HTTP request handling failed", exc_info=e.__context__ or e)
                self._input_error(Code.INTERNAL, "Internal error while handling the request")
        except httptools.HttpParserUpgrade as e:
            # We never switch protocols (e.g. curl's h2c upgrade): the request
            # was answered as plain HTTP/1.1 (bodiless ones only, see
            # on_message_complete); carry on with a fresh parser.
            if not self.dead_input:
                self.parser = httptools.HttpRequestParser(self)
                rest = data[e.args[0] :]
                if rest:
                    self.data_received(rest)
        except httptools.HttpParserError as e:
            self._drop_streamed()
            self._input_error(Code.BAD_REQUEST, f"Malformed HTTP request: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.ingress.connections.discard(self)
        self._clear_pending()
        self._drop_streamed()
        self._wake_writer()
        ex = self.current
        if isinstance(ex, EmbeddingsExchange):
            self.current = None
            return ex.client_gone()
        # A stream whose end is rendered but not yet written (flush pending) is
        # finished for the core, yet its client never got it: count it as gone too.
        if ex is not None and (not ex.done or (ex.renderer is not None and ex.queued)):
            self.current = None
            if not ex.done:
                ex.done = True
                ex.cancel_jobs()
            self.ingress.metrics.observe_http(ex.label, STATUS_CLIENT_GONE, time.perf_counter() - ex.req.t0)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    def gone(self) -> bool:
        """Closing or closed (a method: read again after an await)."""
        return self.closed

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def _set_reading(self) -> None:
        """Read the socket unless something asked to stop (pipelined queue, a sink behind)."""
        if self.closed:
            return
        if self.reading_paused or self.body_paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _resume_body(self) -> None:
        if self.body_paused:
            self.body_paused = False
            self._set_reading()

    def _clear_pending(self) -> None:
        """Forget the queued requests; an upload among them discards what it wrote."""
        for item in self.pending:
            if isinstance(item, _Request) and item.sink is not None and not isinstance(item.sink, ErrorReply):
                item.sink.abort()
        self.pending.clear()

    def _drop_streamed(self) -> None:
        """A streamed body that will never be complete: its sink discards what it wrote."""
        req, self._streamed = self._streamed, None
        if req is not None and req.sink is not None and not isinstance(req.sink, ErrorReply):
            req.sink.abort()

    # ---------------------------------------------------------- httptools

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_len = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self._wanted:
            held = self._headers.get(name)
            if held is not None and name in _KEY_HEADERS:  # sent twice: ", "-joined as Envoy's Lua reads it
                value = held + b", " + value
            self._headers[name] = value

    def on_headers_complete(self) -> None:
        parser = self.parser
        self._http11 = parser.get_http_version() == "1.1"
        # HTTP/1.0 keep-alive is rare and needs extra response headers: close instead.
        self._keep_alive = self._http11 and parser.should_keep_alive()
        self._upgrade = parser.should_upgrade()
        length = self._headers.get(b"content-length")
        ingress = self.ingress
        # Only a streamed body (an upload) may be upload-sized: any other is
        # gathered in memory, so /v1/files/{id} or /v1/filesX get the request limit.
        body_route = ingress.bodies.get(self._url.split(b"?", 1)[0]) if parser.get_method() == b"POST" else None
        self._body_limit = ingress.max_upload_bytes if body_route is not None else ingress.max_body_bytes
        if length is not None and length.strip().isdigit() and int(length) > self._body_limit:
            raise _BodyTooLarge()
        if body_route is not None:
            self._start_streamed(body_route)
        expect = self._headers.get(b"expect")
        if expect is not None and expect.lower() == b"100-continue" and not self.busy and self._http11:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._body_limit:
            raise _BodyTooLarge()
        streamed = self._streamed
        if streamed is None:
            self._body.append(body)
            return
        sink = streamed.sink
        if isinstance(sink, ErrorReply):
            return  # refused at its head: the body is read and dropped, then the refusal answered
        assert sink is not None
        if not sink.feed(body) and not self.body_paused:
            self.body_paused = True
            self._set_reading()

    def _start_streamed(self, body_route: BodyRoute) -> None:
        """A body that goes to a sink as it arrives (an upload): the sink is
        made from the request's head, now, even behind a response in progress."""
        path, _, query = self._url.partition(b"?")
        req = _Request(self.parser.get_method(), path, self._headers, b"", self._keep_alive, self._http11, query)
        sink = body_route(req)
        if not isinstance(sink, ErrorReply):
            sink.resume = self._resume_body
        req.sink = sink
        self._streamed = req

    def on_message_complete(self) -> None:
        if self.closed:
            return
        if self._upgrade and self.parser.get_method() != b"GET":
            # llhttp hands a request's body to the upgraded protocol: it is lost.
            return self._input_error(
                Code.BAD_REQUEST, "HTTP protocol upgrade is not supported; send the request without Upgrade"
            )
        if self._streamed is not None:
            req, self._streamed = self._streamed, None
        else:
            path, _, query = self._url.partition(b"?")
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            req = _Request(self.parser.get_method(), path, self._headers, body, self._keep_alive, self._http11, query)
        self._body = []  # the request holds its body now, and lets it go when its response starts
        if self.busy or self.pending:
            self.pending.append(req)
            if len(self.pending) >= MAX_PIPELINED and not self.reading_paused:
                self.reading_paused = True
                self._set_reading()
        else:
            self._start(req)

    # ---------------------------------------------------------- requests

    def _start(self, req: _Request) -> None:
        if req.sink is not None:  # a streamed body, complete: its sink answers
            sink, req.sink = req.sink, None
            label = req.path.decode()
            if isinstance(sink, ErrorReply):
                return self.answer(req, sink, label)
            return self.answer_later(req, sink.finish(), label)
        ingress = self.ingress
        if ingress.admin_plane and not req.path.startswith(ADMIN_PLANE_PATHS):
            return self.respond_error(req, error(Code.NOT_FOUND, "Not served on the admin listener"), "other")
        if req.path.startswith(ADMIN_PREFIX) and not admin_allowed(
            ingress.admin_token, req.header(b"authorization"), self.loopback
        ):
            return self.respond_error(req, admin_refusal().info, "/admin")
        if req.path in LORA_ADMIN_PATHS and not admin_allowed(
            # vLLM's adapter routes: as /admin on the admin listener; on the API listener (Envoy's
            # requests come from loopback) only with the admin token
            ingress.admin_token,
            req.header(b"authorization"),
            self.loopback and ingress.admin_plane,
        ):
            return self.respond_error(req, admin_refusal().info, "/admin")
        route = ingress.routes.get(req.path)
        if route is not None:
            method, handler = route
            label = req.path.decode()
            if req.method != method and method != b"*":
                return self.respond_error(
                    req,
                    error(
                        Code.METHOD_NOT_ALLOWED,
                        f"Method {req.method.decode()} not allowed on {label}; use {method.decode()}",
                    ),
                    label,
                    extra=b"allow: " + method + b"\r\n",
                )
        else:
            pattern = next((r for r in ingress.patterns if r.matches(req.path, req.method)), None)
            if pattern is None:
                return self.respond_error(
                    req, error(Code.NOT_FOUND, f"No route for {req.path.decode('latin-1')!r}"), "other"
                )
            handler, label = _answering(pattern.handler), pattern.label
        try:
            handler(self, req, label)
        except Exception:
            log.exception("handler for %s failed", label)
            if not self.busy and not self.closed:
                self.respond_error(req, error(Code.INTERNAL, "Internal error"), label)

    def _generate(
        self,
        req: Request,
        label: str,
        parse: Callable[[bytes, api.RequestMeta, str], tuple[Submit, api.ResponseContext] | api.CompletionJobs],
    ) -> None:
        try:
            got = parse(req.body, self.meta(req), api.new_request_id())
        except api.RequestError as e:
            return self.refuse(req, e.info, label)
        if isinstance(got, api.CompletionJobs):
            self.run_jobs(req, label, got)
        else:
            self.run(req, label, *got)

    def meta(self, req: Request) -> api.RequestMeta:
        """The headers a generation reads; a bad agent header raises api.RequestError."""
        meta = api.meta_from_headers(
            req.header(b"authorization"),
            req.header(b"x-api-key"),
            req.header(b"x-weir-priority"),
            req.header(b"x-weir-task-type"),
            req.header(b"x-weir-allow-fallback"),
        )
        meta.routing = self.ingress.agent.routing(req.headers)
        return meta

    def refuse(self, req: Request, info: ErrorInfo, label: str) -> None:
        """A request refused before it is submitted (its own id for the log)."""
        if req.rid is None:
            req.rid = api.new_request_id()
        self.respond_error(req, info, label)

    def run(
        self,
        req: Request,
        label: str,
        sub: Submit,
        ctx: api.ResponseContext,
        exchange: ExchangeFactory | None = None,
    ) -> None:
        """Submit a parsed request; its Exchange (``exchange`` makes another
        kind: /v1/responses's) writes the answer."""
        self.run_jobs(req, label, api.CompletionJobs([sub], ctx, 1, []), exchange)

    def run_jobs(
        self,
        req: Request,
        label: str,
        jobs: api.CompletionJobs,
        exchange: ExchangeFactory | None = None,
    ) -> None:
        """Submit a parsed request's jobs (one, or one per prompt of a completion)."""
        subs, ctx = jobs.subs, jobs.ctx
        if req.rid is None:
            req.rid = ctx.id  # router-direct without x-request-id: the response's own id
        ctx.request_id = req.rid
        tp = req.headers.get(b"traceparent")
        ctx_in = parse_traceparent(tp, req.headers.get(b"tracestate")) if tp is not None else None
        for sub in subs:
            sub.trace_id = req.rid
            sub.trace_context = ctx_in
        req.body = b""  # a stream may live for minutes; its body is not needed
        core = self.ingress.core
        if ctx.logprobs is not None:
            # (None: an unknown model, refused by submit, or one without a tokenizer --
            # the simulated engine, which refuses logprobs -- so ids as vLLM's
            # return_tokens_as_token_ids would show them)
            ctx.token_text = core.token_text(subs[0].model) or api.token_id_text
        echoes = echo_texts(core, jobs)
        if len(subs) == 1 and echoes:
            ctx.echo = echoes[0]
        if ctx.tools is not None:  # how the model writes tool calls (its config; None: refused by submit)
            try:  # (and auto with a strict tool: vLLM's structural tag)
                api.read_with_model(subs[0], ctx.tools, core.tool_parser)
            except api.RequestError as e:  # (tools nested too deeply to write the tag)
                return self.refuse(req, e.info, label)
        ex = (exchange or Exchange)(self, req, ctx, label)
        self.current = ex
        self.busy = True
        try:
            if len(subs) == 1:
                result: int | ErrorInfo | None = core.submit(subs[0], ex)
            else:
                ex.fan = PromptFanOut(core, ex, jobs.n, len(subs), echoes)
                result = ex.fan.submit(subs)
        except Exception:
            self.current = None
            self.busy = False
            raise
        if isinstance(result, ErrorInfo):
            ex.done = True
            self.current = None
            self.busy = False
            return self.respond_error(req, result, label, total_only(time.perf_counter() - req.t0))
        ex.handle = result

    def completions(self, req: Request, label: str) -> None:
        max_prompts = self.ingress.max_prompts
        self._generate(req, label, lambda body, meta, rid: api.parse_completions(body, meta, rid, max_prompts))

    def chat(self, req: Request, label: str) -> None:
        self._generate(req, label, api.parse_chat)

    def embeddings(self, req: Request, label: str) -> None:
        start_embeddings(self, req, label, self.ingress.core)

    def responses(self, req: Request, label: str) -> None:
        service = self.ingress.responses
        assert service is not None  # routed only when the server has one
        service.create(self, req, label)

    def answer_later(self, req: Request, pending: Awaitable[Answer], label: str) -> None:
        """A route whose answer needs I/O (a store lookup): later requests
        on this connection wait behind it, as behind a generation."""
        self.busy = True

        async def wait() -> None:
            try:
                answer = await pending
            except Exception:
                log.exception("handler for %s failed", label)
                answer = ErrorReply(error(Code.INTERNAL, "Internal error"))
            if isinstance(answer, Stream):
                await self.send_stream(req, answer, label)
            elif not self.closed:
                self.answer(req, answer, label)

        asyncio.get_running_loop().create_task(wait())

    def answer(self, req: Request, answer: Answer, label: str) -> None:
        """A route's answer (router.ingress.routes) as a whole response."""
        if isinstance(answer, ErrorReply):
            self.respond_error(req, answer.info, label, answer.extra)
        elif isinstance(answer, Stream):
            self.busy = True
            asyncio.get_running_loop().create_task(self.send_stream(req, answer, label))
        else:
            self.respond(req, answer.status, answer.content_type, answer.body, label, answer.extra)

    async def send_stream(self, req: Request, answer: Stream, label: str) -> None:
        """A body sent chunk by chunk, each written once the socket took the last
        (memory: a chunk and the transport's buffer).  A source that fails
        midway drops the connection: the client sees a short body, never a
        wrong one."""
        chunks = answer.chunks
        try:
            if self.closed:
                return
            req.body = b""
            self.transport.write(
                response_head(answer.status, answer.content_type, answer.length, req.keep_alive, extra=answer.extra)
            )
            sent = 0
            async for chunk in chunks:
                if self.gone():
                    return
                self.transport.write(chunk)
                sent += len(chunk)
                if self.write_paused:
                    self._drained = self.ingress.loop.create_future()
                    await self._drained
            if sent != answer.length:
                raise RuntimeError(f"{label}: sent {sent} of {answer.length} bytes")
        except Exception:
            log.exception("streaming the answer of %s failed", label)
            if not self.closed:
                self.ingress.metrics.observe_http(label, 500, time.perf_counter() - req.t0)
                self.closed = True
                self._clear_pending()
                self.transport.abort()
            return
        finally:
            await chunks.aclose()  # its source (a file) closes, however the loop ended
        if not self.closed:
            self.response_complete(req, answer.status, label, req.keep_alive)

    # ---------------------------------------------------------- responses

    def respond(
        self, req: Request, status: int, content_type: bytes, body: bytes, label: str, extra: bytes = b""
    ) -> None:
        """A whole response (head + body) in one write."""
        if self.closed:
            return
        req.body = b""  # answered: a keep-alive connection (an hour behind Envoy) must not hold it
        self.transport.write(response_head(status, content_type, len(body), req.keep_alive, extra=extra) + body)
        self.response_complete(req, status, label, req.keep_alive)

    def respond_error(self, req: Request, info: ErrorInfo, label: str, extra: bytes = b"") -> None:
        rid = req.rid
        if rid is not None:
            extra += b"x-request-id: %b\r\n" % rid.encode()
        self.respond(req, info.status, _JSON, api.error_body(info, rid), label, extra + error_headers(info))

    def response_complete(self, req: Request, status: int, label: str, keep_alive: bool) -> None:
        self.ingress.metrics.observe_http(label, status, time.perf_counter() - req.t0)
        self.current = None
        self.busy = False
        if not keep_alive:
            self._close()
        elif self.pending:
            # Not re-entrantly: we may be inside the core's delivery loop.
            asyncio.get_running_loop().call_soon(self._drain_pending)

    def _drain_pending(self) -> None:
        while self.pending and not self.busy and not self.closed:
            item = self.pending.popleft()
            if isinstance(item, ErrorInfo):  # malformed input behind a pipelined request
                self._reply_and_close(item)
            else:
                self._start(item)
        if self.reading_paused and not self.closed and len(self.pending) < MAX_PIPELINED // 2:
            self.reading_paused = False
            self._set_reading()

    def _input_error(self, code: Code, message: str) -> None:
        """Unusable input: answer (after any response in progress) and close."""
        self.dead_input = True
        info = error(code, message)
        if self.busy or self.pending:
            self.pending.append(info)
        else:
            self._reply_and_close(info)

    def _reply_and_close(self, info: ErrorInfo) -> None:
        """Error reply, then a lingering close: half-close and discard input
        for a moment, so a client still sending its (e.g. too large) body
        reads the reply instead of a connection reset."""
        if self.closed:
            return
        body = api.error_body(info)
        transport = self.transport
        transport.write(response_head(info.status, _JSON, len(body), keep_alive=False) + body)
        self.ingress.metrics.observe_http("other", info.status, 0.0)
        self.closed = True
        self.dead_input = True
        self._clear_pending()
        if transport.can_write_eof():
            transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def abort(self, ex: InFlight, status: int) -> None:
        """Give up on a generation mid-response: cancel it and drop the connection."""
        ex.done = True
        self.current = None
        ex.cancel_jobs()
        self.ingress.metrics.observe_http(ex.label, status, time.perf_counter() - ex.req.t0)
        self.closed = True
        self._clear_pending()
        self.transport.abort()

    def _close(self) -> None:
        self.closed = True
        self._clear_pending()
        self.transport.close()  # flushes what is buffered first


def _answering(handler: Handler) -> Callable[[HttpConnection, _Request, str], None]:
    """A route's handler (request -> answer, or an awaitable answer) as a connection writes it."""

    def run(conn: HttpConnection, req: Request, label: str) -> None:
        answer = handler(req)
        if isinstance(answer, (Reply, ErrorReply, Stream)):
            conn.answer(req, answer, label)
        else:
            conn.answer_later(req, answer, label)

    return run


async def start_http_server(
    core: Generation,
    views: Views,
    metrics: RouterMetrics,
    host: str,
    port: int,
    *,
    operator: Operator | None = None,
    max_body_bytes: int = 1 << 20,
    max_buffered_bytes: int = 4 << 20,
    connections: set[HttpConnection] | None = None,
    max_prompts: int = DEFAULT_MAX_PROMPTS,
    extra_routes: Routes | None = None,
    max_upload_bytes: int = 0,
    responses: ResponsesApi | None = None,
    admin_token: str | None = None,
    admin_plane: bool = False,
    session_headers: Sequence[str] = (),
) -> asyncio.AbstractServer:
    """Serve the OpenAI-compatible API (``core``), health, metrics and admin
    views (``views``) and, given an ``operator``, the admin actions.

    ``max_buffered_bytes``: a stream whose unsent output exceeds this while
    the client is not reading is cancelled and its connection dropped.
    ``connections``: a set this server keeps its open connections in (for ``written_out``).
    ``max_prompts``: a completion's most prompts (a longer list: 400).
    ``admin_token``: what /admin/* asks of a peer other than loopback (None: loopback only).
    ``admin_plane``: serve only /admin/*, /metrics and /health (router.admin_http's listener).
    ``session_headers``: more headers a session id comes in (scheduler.session_headers).
    """
    conns = connections if connections is not None else set()
    ingress = _Ingress(
        core,
        views,
        operator,
        metrics,
        max_body_bytes,
        max_buffered_bytes,
        conns,
        max_prompts,
        extra_routes,
        max_upload_bytes,
        responses,
        admin_token,
        admin_plane,
        session_headers,
    )
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: HttpConnection(ingress), host, port, reuse_address=True, backlog=2048)


async def written_out(connections: set[HttpConnection], timeout_s: float) -> bool:
    """Wait until no connection has a response in progress or bytes unsent
    (the last events a drain wrote), up to ``timeout_s``; True if so."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if all(c.closed or (not c.busy and c.transport.get_write_buffer_size() == 0) for c in connections):
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)
