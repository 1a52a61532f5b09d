"""The headers agents and other gateways send, in weir's terms (``Routing``).

One table per concern, in order of precedence (the first header present
wins; a deployment may add session headers, read after the built-in ones:
``AgentHeaders``); docs/api.md#agent-and-gateway-headers lists them.  Pure: the ingress
hands over the request's headers, a bad value is a 400 naming its header.

Priorities run in opposite directions by vendor; each becomes a
``PriorityHint`` (classes below an anchor class) that router.tenancy.
priority_hints resolves against the configured classes.  Every priority a
request states can only lower its key's class: the least urgent one wins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from router.api.errors import invalid
from shared.protocol import MAX_SESSION_ID, PriorityHint, Routing

TOP, DEFAULT, BOTTOM = 0, 1, 2  # PriorityHint anchors

SESSION_HEADERS = (
    b"x-session-id",  # vLLM's router, OpenCode
    b"x-session-token",  # llm-d
    b"x-dynamo-session-id",
    b"x-claude-code-session-id",
    b"session-id",  # Codex
    b"x-litellm-session-id",
    b"x-aibrix-session-key",
)
PARENT_HEADERS = (b"x-dynamo-parent-session-id", b"x-parent-session-id")
FINAL_HEADERS = (b"x-dynamo-session-final", b"x-weir-session-final")
TTFT_HEADERS = (b"x-llm-d-slo-ttft-ms", b"x-slo-ttft-ms")
TPOT_HEADERS = (b"x-llm-d-slo-tpot-ms", b"x-slo-tpot-ms")
FAIRNESS_HEADERS = (b"x-llm-d-inference-fairness-id", b"x-smg-tenant-id", b"x-smg-routing-key")
OBJECTIVE = b"x-llm-d-inference-objective"
DYNAMO_PRIORITY = b"x-dynamo-request-priority"  # an integer, higher first
SMG_PRIORITY = b"x-smg-priority"
SHEDDABLE = b"x-weir-sheddable"

# SGLang Model Gateway's levels, most urgent last
SMG_LEVELS = {
    "system": PriorityHint(TOP, 0),
    "interactive": PriorityHint(DEFAULT, -1),
    "default": PriorityHint(DEFAULT, 0),
    "bulk": PriorityHint(BOTTOM, 0),
}

HEADERS = frozenset(
    (
        *SESSION_HEADERS,
        *PARENT_HEADERS,
        *FINAL_HEADERS,
        *TTFT_HEADERS,
        *TPOT_HEADERS,
        *FAIRNESS_HEADERS,
        OBJECTIVE,
        DYNAMO_PRIORITY,
        SMG_PRIORITY,
        SHEDDABLE,
    )
)

_TRUE = ("1", "true", "yes")
_FALSE = ("", "0", "false", "no")
MAX_TARGET_MS = 86_400_000.0  # a day: the wire's bound (shared.protocol.TargetMs)


def _text(headers: Mapping[bytes, bytes], names: tuple[bytes, ...]) -> tuple[str, str] | None:
    """The first of ``names`` present: (its name, its value, stripped)."""
    for name in names:
        v = headers.get(name)
        if v is not None:
            return name.decode(), v.decode("latin-1").strip()
    return None


def _id(headers: Mapping[bytes, bytes], names: tuple[bytes, ...]) -> str:
    got = _text(headers, names)
    if got is None:
        return ""
    name, value = got
    if len(value) > MAX_SESSION_ID or not value.isprintable() or not value.isascii():
        raise invalid(f"{name} must be at most {MAX_SESSION_ID} printable ASCII characters", param=name)
    return value


def _flag(headers: Mapping[bytes, bytes], names: tuple[bytes, ...]) -> bool:
    got = _text(headers, names)
    if got is None:
        return False
    name, value = got
    value = value.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise invalid(f"{name} must be true or false", param=name)


def _ms(headers: Mapping[bytes, bytes], names: tuple[bytes, ...]) -> float:
    got = _text(headers, names)
    if got is None:
        return 0.0
    name, value = got
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not (math.isfinite(ms) and 0.0 < ms <= MAX_TARGET_MS):
        raise invalid(f"{name} must be a number of milliseconds, above 0 and at most a day", param=name)
    return ms


def _dynamo(value: str) -> PriorityHint:
    try:
        n = int(value)
    except ValueError:
        raise invalid(f"{DYNAMO_PRIORITY.decode()} must be an integer", param=DYNAMO_PRIORITY.decode()) from None
    return PriorityHint(DEFAULT, max(-64, min(64, -n)))  # higher first: 1 is one class above the default


def vllm_priority(n: int) -> PriorityHint:
    """vLLM's and LiteLLM's body ``priority`` (lower first, 0 the default):
    the class at that rank (0: the first class)."""
    return PriorityHint(TOP, max(-64, min(64, n)))


class AgentHeaders:
    """The headers read, a deployment's own session headers
    (``scheduler.session_headers``) after the built-in ones."""

    __slots__ = ("session", "names")

    def __init__(self, extra_session: Sequence[str] = ()) -> None:
        extra = tuple(dict.fromkeys(b for n in extra_session if (b := n.encode("ascii")) not in SESSION_HEADERS))
        self.session = SESSION_HEADERS + extra
        self.names = HEADERS | frozenset(extra)  # what the ingress keeps of a request's headers

    def routing(self, headers: Mapping[bytes, bytes]) -> Routing | None:
        return routing_from_headers(headers, self)


BUILT_IN = AgentHeaders()


def routing_from_headers(headers: Mapping[bytes, bytes], agent: AgentHeaders = BUILT_IN) -> Routing | None:
    """The request's ``Routing`` from its (lower-case) headers; None without any."""
    if agent.names.isdisjoint(headers):
        return None  # the common case: one set lookup per header the request has
    hints: list[PriorityHint] = []
    dyn = headers.get(DYNAMO_PRIORITY)
    if dyn is not None:
        hints.append(_dynamo(dyn.decode("latin-1").strip()))
    smg = headers.get(SMG_PRIORITY)
    if smg is not None:
        level = SMG_LEVELS.get(smg.decode("latin-1").strip().lower())
        if level is None:
            raise invalid(
                f"{SMG_PRIORITY.decode()} must be one of {', '.join(SMG_LEVELS)}", param=SMG_PRIORITY.decode()
            )
        hints.append(level)
    return Routing(
        session=_id(headers, agent.session),
        parent_session=_id(headers, PARENT_HEADERS),
        session_final=_flag(headers, FINAL_HEADERS),
        hints=hints,
        objective=_id(headers, (OBJECTIVE,)),
        fairness_id=_id(headers, FAIRNESS_HEADERS),
        ttft_target_ms=_ms(headers, TTFT_HEADERS),
        tpot_target_ms=_ms(headers, TPOT_HEADERS),
        sheddable=_flag(headers, (SHEDDABLE,)),
    )


def with_hint(routing: Routing | None, hint: PriorityHint) -> Routing:
    """``routing`` with one more priority hint (a body's ``priority``)."""
    if routing is None:
        return Routing(hints=[hint])
    return msgspec.structs.replace(routing, hints=[*routing.hints, hint])
