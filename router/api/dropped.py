"""llm-d's ``x-llm-d-request-dropped-reason`` for weir's refusals of load:
a gateway or client that speaks llm-d's vocabulary reads why a request was
not served without parsing the body.  Only the refusals that llm-d's flow
control would also make carry one (docs/api.md#agent-and-gateway-headers)."""

from __future__ import annotations

from shared.errors import Code

HEADER = b"x-llm-d-request-dropped-reason"

REASONS: dict[str | None, bytes] = {
    Code.TARGET_UNATTAINABLE.wire: b"rejected-saturated",
    Code.QUEUE_WAIT_EXCEEDED.wire: b"rejected-saturated",
    Code.TENANT_SHARE_EXCEEDED.wire: b"rejected-saturated",
    Code.QUEUE_FULL.wire: b"rejected-saturated",
    Code.TENANT_QUEUE_FULL.wire: b"rejected-saturated",
    Code.QUEUE_DEADLINE.wire: b"rejected-ttl-expired",
}


def dropped_header(code: str | None) -> bytes:
    """The header line for an error's wire ``code`` (b"": none)."""
    reason = REASONS.get(code)
    return b"" if reason is None else HEADER + b": " + reason + b"\r\n"
