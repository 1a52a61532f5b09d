"""A small, fast HTTP/1.1 client for the load generator.

Why not aiohttp/httpx: at the rates the targets ask for (15k req/s, 100k
SSE events/s on one core) a general-purpose client spends more CPU per
request than the server under test, and its buffering blurs per-event
timestamps.  This one is an ``asyncio.Protocol`` on ``httptools`` (already a
weir dependency): keep-alive connections in a pool, chunked bodies decoded by
the parser, and every SSE event stamped with the time its bytes arrived
(one clock read per socket read).

Scope: loopback benchmarking of JSON POSTs with JSON or SSE answers -- no
TLS, no redirects, no compression.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

_clock = time.perf_counter


class HttpError(Exception):
    """Transport failure (connection refused/reset, malformed response)."""


class Response:
    """One exchange.  ``on_event(data, t)`` is called for each SSE ``data:``
    payload as it arrives; a non-SSE body is collected in ``body``."""

    __slots__ = ("status", "headers", "body", "sse", "on_event", "done", "_buf", "t_headers")

    def __init__(self, on_event: Callable[[bytes, float], None] | None):
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.sse = False
        self.on_event = on_event
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._buf = b""
        self.t_headers = 0.0

    def _feed_sse(self, chunk: bytes, t: float) -> None:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:  # the spec allows CRLF line ends; normalise once
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            for line in buf[start:end].split(b"\n"):
                if line.startswith(b"data:"):
                    self.on_event(line[5:].lstrip(b" "), t)
            start = end + 2
        self._buf = buf[start:]


class _Conn(asyncio.Protocol):
    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.t = 0.0
        self.closed = False
        self._hname = b""

    # asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.t = _clock()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(HttpError(f"bad response: {e}"))
            self.transport.close()

    def connection_lost(self, exc):
        self.closed = True
        self.pool._forget(self)
        if self.resp is not None:
            self._fail(HttpError(f"connection lost: {exc or 'closed by peer'}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes):
        self.resp.headers[name.lower()] = value

    def on_headers_complete(self):
        r = self.resp
        r.status = self.parser.get_status_code()
        r.t_headers = self.t
        r.sse = r.headers.get(b"content-type", b"").startswith(b"text/event-stream")

    def on_body(self, body: bytes):
        r = self.resp
        if r.sse and r.on_event is not None:
            r._feed_sse(body, self.t)
        else:
            r.body += body

    def on_message_complete(self):
        r, self.resp = self.resp, None
        keep = self.parser.should_keep_alive()
        if not r.done.done():
            r.done.set_result(None)
        if keep and not self.closed:
            self.pool._release(self)
        else:
            self.transport.close()

    def _fail(self, exc: Exception):
        r, self.resp = self.resp, None
        if r is not None and not r.done.done():
            r.done.set_exception(exc)


class Pool:
    """Keep-alive connections to one host:port; grows on demand up to
    ``limit`` (callers beyond it wait for a free connection)."""

    def __init__(self, url: str, limit: int = 4096):
        u = urlsplit(url)
        if u.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, got {url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.hostport = f"{self.host}:{self.port}".encode()
        self.limit = limit
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._waiters: list[asyncio.Future] = []
        self._opening = 0

    async def _open(self) -> _Conn:
        loop = asyncio.get_running_loop()
        self._opening += 1
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except OSError as e:
            raise HttpError(f"connect {self.host}:{self.port}: {e}") from None
        finally:
            self._opening -= 1
        self._all.add(conn)
        return conn

    async def warm(self, n: int) -> None:
        """Open up to ``n`` connections now so that the measured requests
        do not pay for connection set-up."""
        conns = await asyncio.gather(*(self._open() for _ in range(n - len(self._all))), return_exceptions=True)
        for c in conns:
            # A target that is down fails each request instead (and is
            # counted as such), not the whole run.
            if isinstance(c, _Conn):
                self._release(c)

    async def _acquire(self) -> _Conn:
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                return c
        if len(self._all) + self._opening < self.limit:
            return await self._open()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return await fut

    def _release(self, c: _Conn) -> None:
        while self._waiters:
            w = self._waiters.pop(0)
            if not w.done():
                w.set_result(c)
                return
        self._idle.append(c)

    def _forget(self, c: _Conn) -> None:
        self._all.discard(c)
        if c in self._idle:
            self._idle.remove(c)

    async def post(
        self,
        path: str,
        body: bytes,
        headers: bytes = b"",
        on_event: Callable[[bytes, float], None] | None = None,
    ) -> Response:
        """POST ``body`` (JSON) to ``path``; returns once the whole response
        is in.  ``headers``: extra pre-encoded ``Name: value\\r\\n`` lines."""
        req = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
            path.encode(),
            self.hostport,
            len(body),
            headers,
            body,
        )
        for attempt in (0, 1):
            reused = bool(self._idle)
            conn = await self._acquire()
            resp = Response(on_event)
            conn.resp = resp
            conn.transport.write(req)
            try:
                await resp.done
                return resp
            except asyncio.CancelledError:
                # The peer still owes us the rest of this response: the
                # connection cannot be reused.  Closing it also tells the server.
                conn.resp = None
                conn.transport.close()
                raise
            except HttpError:
                # A kept-alive connection the server had already closed:
                # nothing was processed, so sending again is safe.
                if attempt or not reused or resp.status:
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for c in list(self._all):
            c.transport.close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)
