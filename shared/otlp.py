"""Spans out of a weir process over OTLP, never in a request's way.

The router and the workers record a traced request's spans as plain tuples
(``Span``) once it ends, from timestamps they keep anyway; ``SpanExporter``
holds them in a bounded queue and a daemon thread turns them into OTLP
protobuf (``opentelemetry-proto``) and sends them to ``[tracing] endpoint``
over gRPC or HTTP.  A collector that is down or slow costs the queue
(``max_queued_spans``) and what it drops, counted (``dropped``): the loop
never waits for it and no request fails for it.

Also W3C trace context: ``traceparent`` parsing and rendering, and new ids.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import re
import struct
import threading
import time
from collections import deque
from typing import Any, NamedTuple, Protocol

from shared.config import TracingConfig, split_hostport
from shared.protocol import TraceContext

log = logging.getLogger("weir.tracing")

# Span kinds (OTLP's numbers)
INTERNAL, SERVER, CLIENT = 1, 2, 3

BATCH = 512  # spans per export request
INTERVAL_S = 0.5  # a partial batch waits at most this long
WARN_EVERY_S = 30.0  # failed exports are logged at most this often

_TRACEPARENT = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)


def parse_traceparent(value: bytes | None, state: bytes | None = None) -> TraceContext | None:
    """A W3C ``traceparent`` (version 00) as a TraceContext; None if absent or malformed (a new trace then)."""
    if value is None:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    trace_id, span_id = bytes.fromhex(m.group(1).decode()), bytes.fromhex(m.group(2).decode())
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    ctx = TraceContext(trace_id, span_id, bool(int(m.group(3), 16) & 1))
    if state and len(state) <= 512:
        ctx.state = state.decode("latin-1")
    return ctx


def traceparent(ctx: TraceContext) -> str:
    return f"00-{ctx.trace_id.hex()}-{ctx.span_id.hex()}-{'01' if ctx.sampled else '00'}"


_rand = random.Random(int.from_bytes(os.urandom(8), "little"))


def new_trace_id() -> bytes:
    return (_rand.getrandbits(128) or 1).to_bytes(16, "little")  # (all zeros is invalid)


def new_span_id() -> bytes:
    return (_rand.getrandbits(64) or 1).to_bytes(8, "little")


def sampled(ratio: float) -> bool:
    return ratio >= 1.0 or (ratio > 0.0 and _rand.random() < ratio)


class Span(NamedTuple):
    """One finished span, as recorded on the hot path (encoded later, off it)."""

    trace_id: bytes
    span_id: bytes
    parent_id: bytes  # b"": a root span
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[bytes, ...] = ()  # span ids in the same trace (a resumed attempt's earlier one)
    error: str = ""  # non-empty: the span's status is an error, with this message
    state: str = ""  # the trace's tracestate


class SpanSink(Protocol):
    """Where finished spans go: a ``SpanExporter``, or a list in tests."""

    def add(self, spans: list[Span]) -> None: ...


class WallClock:
    """Monotonic seconds (what the lifecycle stamps) -> Unix nanoseconds (what OTLP wants)."""

    def __init__(self) -> None:
        self.offset = time.time() - time.monotonic()

    def ns(self, mono: float) -> int:
        return int((mono + self.offset) * 1e9)


class SpanExporter:
    """A bounded queue of spans and the thread that exports them."""

    def __init__(self, cfg: TracingConfig, service: str, resource: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.max = cfg.max_queued_spans
        self.resource = {"service.name": service, **(resource or {})}
        self._q: deque[Span] = deque()
        self.dropped_full = 0  # the queue was full (written by the caller's thread only)
        self.dropped_failed = 0  # an export failed (written by the export thread only)
        self.exported = 0
        self._wake = threading.Event()
        self._closed = False
        self._last_warning = 0.0
        self._send = self._grpc_sender() if cfg.protocol == "grpc" else self._http_sender()
        self._thread = threading.Thread(target=self._run, name="weir-otlp", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self.dropped_full + self.dropped_failed

    def add(self, spans: list[Span]) -> None:
        """Queue a request's spans; what does not fit is dropped and counted."""
        q = self._q
        room = self.max - len(q)
        if room < len(spans):
            self.dropped_full += len(spans) - max(room, 0)
            spans = spans[: max(room, 0)]
        q.extend(spans)
        if len(q) >= BATCH:
            self._wake.set()

    def close(self, timeout_s: float = 2.0) -> None:
        """Export what is queued (within ``timeout_s``) and stop."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)

    # -- the export thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(INTERVAL_S)
            self._wake.clear()
            q = self._q
            while q:
                batch = [q.popleft() for _ in range(min(BATCH, len(q)))]
                try:
                    self._send(self._encode(batch))
                    self.exported += len(batch)
                except Exception as e:  # the collector is down, slow or refuses: drop, count, go on
                    self.dropped_failed += len(batch)
                    now = time.monotonic()
                    if now - self._last_warning >= WARN_EVERY_S:
                        self._last_warning = now
                        log.warning(
                            "exporting spans to %s failed (%s): %d dropped so far",
                            self.cfg.endpoint,
                            str(e).splitlines()[0][:200] if str(e) else type(e).__name__,
                            self.dropped,
                        )
            if self._closed:
                return

    def _encode(self, spans: list[Span]) -> bytes:
        parts = []
        for i in range(0, len(spans), 32):
            parts.append(encode_spans(spans[i : i + 32]))
            time.sleep(0)  # the event loop's thread may take the GIL between slices
        return export_request(b"".join(parts), self.resource)

    def _grpc_sender(self) -> Any:
        timeout = self.cfg.export_timeout_s
        export: list[Any] = []

        def send(body: bytes) -> None:
            # The channel (and gRPC's threads) from the first export on, not
            # before: a worker's engine forks its processes at start, before any.
            if not export:
                import grpc  # type: ignore[import-untyped]

                channel = grpc.insecure_channel(self.cfg.endpoint)
                export.append(
                    channel.unary_unary(
                        "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                        request_serializer=None,  # bytes as they are
                        response_deserializer=None,
                    )
                )
            export[0](body, timeout=timeout)

        return send

    def _http_sender(self) -> Any:
        host, port = split_hostport(self.cfg.endpoint)
        timeout = self.cfg.export_timeout_s
        conn: list[http.client.HTTPConnection] = []

        def send(body: bytes) -> None:
            if not conn:
                conn.append(http.client.HTTPConnection(host, port, timeout=timeout))
            c = conn[0]
            try:
                c.request("POST", "/v1/traces", body, {"content-type": "application/x-protobuf"})
                resp = c.getresponse()
                resp.read()
            except Exception:
                conn.clear()
                c.close()
                raise
            if resp.status >= 300:
                raise RuntimeError(f"collector answered HTTP {resp.status}")

        return send


# -- protobuf wire format (opentelemetry/proto/trace/v1/trace.proto) ------------------------
#
# Written here: building opentelemetry-proto's message objects cost ~90 us a
# request (six spans), this ~10; the tests' receivers parse it with them.


def encode_spans(spans: list[Span]) -> bytes:
    """Spans as repeated ScopeSpans.spans (field 2)."""
    return b"".join([_field(2, _span(s)) for s in spans])


def export_request(encoded_spans: bytes, resource: dict[str, Any]) -> bytes:
    """An ExportTraceServiceRequest of one resource and one scope ("weir")."""
    scope = _field(1, _field(1, b"weir")) + encoded_spans  # ScopeSpans: scope (InstrumentationScope.name), spans
    return _field(1, _field(1, _attributes(resource)) + _field(2, scope))  # resource_spans: resource, scope_spans


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]
_TAGS = {f: bytes(((f << 3) | 2,)) for f in range(1, 16)}  # length-delimited fields 1..15


def _field(number: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 0x80:
        return bytes(((number << 3) | 2, n)) + payload
    return _TAGS[number] + _varint(n) + payload


_KIND_TIMES = struct.Struct("<BBBQBQ")  # kind (6, varint < 128), start (7) and end (8), fixed64


# KeyValue bytes by key and value: span names' attributes, models, outcomes and
# small counts repeat; a key with many values (request ids) stops being cached.
_KV_CACHE: dict[str, dict[tuple[type, Any], bytes]] = {}
_KV_VALUES_PER_KEY = 256


def _kv(key: str, v: Any) -> bytes:
    """A KeyValue as field 1 (a Span's attributes, field 9: its one tag byte swapped)."""
    values = _KV_CACHE.get(key)
    if values is None:
        values = _KV_CACHE[key] = {}
    k = (type(v), v)
    got = values.get(k)
    if got is not None:
        return got
    if isinstance(v, bool):
        val = b"\x10" + (b"\x01" if v else b"\x00")
    elif isinstance(v, int):
        val = b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)
    elif isinstance(v, float):
        val = b"\x21" + struct.pack("<d", v)
    else:
        val = _field(1, str(v).encode())
    enc = _field(1, _field(1, key.encode()) + _field(2, val))
    if len(values) < _KV_VALUES_PER_KEY:
        values[k] = enc
    return enc


def _attributes(attrs: dict[str, Any], number: int = 1) -> bytes:
    """Repeated KeyValue as field ``number`` (Resource.attributes: 1; Span.attributes: 9)."""
    if number == 1:
        return b"".join([_kv(k, v) for k, v in attrs.items()])
    tag = b"%c" % ((number << 3) | 2)
    return tag + tag.join([_kv(k, v)[1:] for k, v in attrs.items()]) if attrs else b""


def _span(s: Span) -> bytes:
    parts = [
        b"\x0a\x10",
        s.trace_id,
        b"\x12\x08",
        s.span_id,
    ]
    if s.state:
        parts.append(_field(3, s.state.encode()))
    if s.parent_id:
        parts += (b"\x22\x08", s.parent_id)
    parts += (
        _field(5, s.name.encode()),
        _KIND_TIMES.pack(0x30, s.kind, 0x39, s.start_ns, 0x41, max(s.end_ns, s.start_ns)),
        _attributes(s.attributes, 9),
    )
    for link in s.links:
        parts.append(_field(13, b"\x0a\x10" + s.trace_id + b"\x12\x08" + link))
    if s.error:
        parts.append(_field(15, _field(2, s.error.encode()) + b"\x18\x02"))  # Status: message, STATUS_CODE_ERROR
    return b"".join(parts)
