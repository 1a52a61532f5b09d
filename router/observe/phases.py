"""Where one request's time went, without a collector: the phases the
lifecycle records on each job (tokenize, queue, prefill, decode), as the
``Timing`` its client gets on its first and last news (shared.protocol), the
``server-timing`` header the HTTP ingress renders from it, and the fields of
the request log line.  Pure arithmetic on timestamps the lifecycle already
reads: a few hundred nanoseconds a request."""

from __future__ import annotations

from shared.protocol import Timing


def timing(arrival: float, tokenized: float, dispatched: float, first_token: float, end: float = 0.0) -> Timing:
    """The phases from a job's timestamps (0: that moment has not come).
    ``end`` 0: the phases so far (a stream's first news)."""
    tokenized = tokenized or end or arrival
    t = Timing(tokenize=tokenized - arrival)
    if dispatched:
        t.queue = dispatched - tokenized
        if first_token:
            t.prefill = first_token - dispatched
    elif end:  # never dispatched: it ended while queued
        t.queue = end - tokenized
    if end:
        t.total = end - arrival
        if first_token:
            t.decode = end - first_token
    return t


def server_timing(t: Timing) -> bytes:
    """The ``server-timing`` header line (W3C Server Timing, milliseconds)."""
    head = b"server-timing: tokenize;dur=%.3f, queue;dur=%.3f, prefill;dur=%.3f" % (
        t.tokenize * 1e3,
        t.queue * 1e3,
        t.prefill * 1e3,
    )
    if t.total:
        head += b", decode;dur=%.3f, total;dur=%.3f" % (t.decode * 1e3, t.total * 1e3)
    return head + b"\r\n"


def total_only(seconds: float) -> bytes:
    """A response refused before its job existed: its whole time, in one entry."""
    return b"server-timing: total;dur=%.3f\r\n" % (seconds * 1e3)


def log_fields(t: Timing) -> dict[str, float]:
    """The request log line's phase fields, in milliseconds."""
    return {
        "tokenize_ms": round(t.tokenize * 1e3, 3),
        "queue_ms": round(t.queue * 1e3, 3),
        "prefill_ms": round(t.prefill * 1e3, 3),
        "decode_ms": round(t.decode * 1e3, 3),
    }


def ended(
    so_far: Timing | None, arrival: float, tokenized: float, dispatched: float, first_token: float, end: float
) -> Timing:
    """A job's phases at its end; ``so_far``: those frozen at its first token
    (a later resume re-dispatches it, but its prefill was the first attempt's)."""
    if so_far is None:
        return timing(arrival, tokenized, dispatched, 0.0, end)
    return Timing(so_far.tokenize, so_far.queue, so_far.prefill, end - first_token, end - arrival)
