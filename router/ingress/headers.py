"""Response heads of the HTTP ingress (router.ingress.http_server): the status line
and headers, formatted as bytes for a single socket write, and the headers
an error or a budgeted reply carries (retry-after, OpenAI's x-ratelimit-*)."""

from __future__ import annotations

import http
import time
from email.utils import formatdate

from router.api.dropped import dropped_header
from shared.errors import Code, retry_after_header
from shared.protocol import ErrorInfo, RateLimit

_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in http.HTTPStatus}

_date_second = 0
_date_header = b""


def _date() -> bytes:
    """RFC 9110 Date header value, formatted at most once per second."""
    global _date_second, _date_header
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_header = formatdate(now, usegmt=True).encode()
    return _date_header


def response_head(
    status: int, content_type: bytes, length: int | None, keep_alive: bool, chunked: bool = False, extra: bytes = b""
) -> bytes:
    """Status line + headers.  ``length`` None: chunked (HTTP/1.1) or, for
    HTTP/1.0 clients, a body delimited by closing the connection."""
    parts = [
        _STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status,
        b"date: ",
        _date(),
        b"\r\ncontent-type: ",
        content_type,
        b"\r\n",
    ]
    if length is not None:
        parts.append(b"content-length: %d\r\n" % length)
    elif chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(extra)
    parts.append(b"\r\n")
    return b"".join(parts)


# A draining router's refusal (router/lifecycle/drain.py): nothing was started, so Envoy
# retries it on another router (its retry policy matches x-weir-draining), and
# takes this router out of its load balancing at once rather than at its next
# health check (Envoy honours x-envoy-immediate-health-check-fail on any reply).
DRAINING_HEADERS = b"x-weir-draining: 1\r\nx-envoy-immediate-health-check-fail: true\r\n"


def error_headers(info: ErrorInfo) -> bytes:
    """An error reply's retry-after and, for a budget refusal, x-ratelimit-* lines."""
    seconds = retry_after_header(info)
    head = b"" if seconds is None else b"retry-after: %d\r\n" % seconds
    if info.code == Code.ROUTER_DRAINING.wire:
        head += DRAINING_HEADERS
    head += dropped_header(info.code)  # llm-d's vocabulary for a refusal of load
    return head if info.ratelimit is None else head + ratelimit_headers(info.ratelimit)


def reset_duration(s: float) -> bytes:
    """OpenAI's reset format: 20ms, 1.5s, 6m0s, 1h2m3s."""
    if s < 1.0:
        return b"%dms" % round(s * 1000)
    if s < 60.0:
        return (b"%.3f" % s).rstrip(b"0").rstrip(b".") + b"s"
    m, sec = divmod(round(s), 60)
    if m < 60:
        return b"%dm%ds" % (m, sec)
    h, m = divmod(m, 60)
    return b"%dh%dm%ds" % (h, m, sec)


def ratelimit_headers(rl: RateLimit) -> bytes:
    """OpenAI's x-ratelimit-* headers for a key's budgets (router/tenancy/budgets.py)."""
    out = b""
    if rl.limit_requests:
        out += (
            b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n"
            b"x-ratelimit-reset-requests: %b\r\n"
            % (rl.limit_requests, rl.remaining_requests, reset_duration(rl.reset_requests_s))
        )
    if rl.limit_tokens:
        out += (
            b"x-ratelimit-limit-tokens: %d\r\nx-ratelimit-remaining-tokens: %d\r\n"
            b"x-ratelimit-reset-tokens: %b\r\n"
            % (rl.limit_tokens, rl.remaining_tokens, reset_duration(rl.reset_tokens_s))
        )
    return out
