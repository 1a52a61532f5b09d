"""What agents and other gateways send (router.api.agent_headers), read into
weir's own fields, and their priorities resolved against the configured
classes (router.tenancy.priority_hints via Keys.identify): a stated priority
can only lower a key's class, never raise it, whichever vendor's direction."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router import api
from router.api.agent_headers import HEADERS, SESSION_HEADERS, routing_from_headers
from router.tenancy.identity import Identity, Keys
from shared import protocol as p
from shared.config import Config

CLASSES = ["critical", "high", "normal", "low", "batch"]


def _keys(tier: str = "normal") -> Keys:
    return Keys(msgspec.convert({"api_keys": [{"key": "sk-a", "tenant": "t", "tier": tier}]}, Config))


def _klass(headers: dict[bytes, bytes], tier: str = "normal", body_priority: int | str | None = None) -> str:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if body_priority is not None:
        body["priority"] = body_priority
    meta = api.meta_from_headers(None, "sk-a")
    meta.routing = routing_from_headers(headers)
    sub, _ = api.parse_chat(json.dumps(body).encode(), meta, "r")
    who = _keys(tier).identify(sub)
    assert isinstance(who, Identity), who
    return who.klass


def test_no_agent_header_no_routing():
    assert routing_from_headers({b"x-api-key": b"k", b"content-type": b"application/json"}) is None


@pytest.mark.parametrize("name", SESSION_HEADERS)
def test_every_session_header_names_the_session(name):
    r = routing_from_headers({name: b" sess-1 "})
    assert r is not None and r.session == "sess-1"


def test_first_session_header_of_the_table_wins_and_parent_and_final_are_read():
    r = routing_from_headers(
        {
            b"x-claude-code-session-id": b"agent",
            b"x-session-id": b"vllm",
            b"x-parent-session-id": b"root",
            b"x-dynamo-session-final": b"true",
        }
    )
    assert r is not None
    assert (r.session, r.parent_session, r.session_final) == ("vllm", "root", True)


def test_targets_fairness_and_objective():
    r = routing_from_headers(
        {
            b"x-slo-ttft-ms": b"900",  # the older name loses to llm-d's
            b"x-llm-d-slo-ttft-ms": b"200",
            b"x-slo-tpot-ms": b"50.5",
            b"x-smg-tenant-id": b"team-b",
            b"x-llm-d-inference-objective": b"low",
            b"x-weir-sheddable": b"1",
        }
    )
    assert r is not None
    assert (r.ttft_target_ms, r.tpot_target_ms, r.fairness_id, r.objective, r.sheddable) == (
        200.0,
        50.5,
        "team-b",
        "low",
        True,
    )


@pytest.mark.parametrize(
    "name,value",
    [
        (b"x-llm-d-slo-ttft-ms", b"soon"),
        (b"x-llm-d-slo-ttft-ms", b"0"),
        (b"x-slo-tpot-ms", b"-5"),
        (b"x-llm-d-slo-ttft-ms", b"nan"),
        (b"x-llm-d-slo-ttft-ms", b"1e12"),
        (b"x-dynamo-request-priority", b"high"),
        (b"x-smg-priority", b"urgent"),
        (b"x-dynamo-session-final", b"maybe"),
        (b"x-session-id", b"s" * 257),
        (b"x-session-id", "s\u00e9".encode()),
        (b"x-session-id", b"a\x01b"),
    ],
)
def test_bad_values_are_a_400_naming_the_header(name, value):
    with pytest.raises(api.RequestError) as got:
        routing_from_headers({name: value})
    assert got.value.info.status == 400 and got.value.info.param == name.decode()


@pytest.mark.parametrize(
    "headers,body,tier,klass",
    [
        ({b"x-smg-priority": b"bulk"}, None, "normal", "batch"),
        ({b"x-smg-priority": b"interactive"}, None, "normal", "normal"),  # above the tier: not raised
        ({b"x-smg-priority": b"interactive"}, None, "critical", "high"),
        ({b"x-smg-priority": b"system"}, None, "low", "low"),
        ({b"x-dynamo-request-priority": b"-1"}, None, "normal", "low"),  # higher first: below 0 lowers
        ({b"x-dynamo-request-priority": b"-9"}, None, "normal", "batch"),  # clamped to the last class
        ({b"x-dynamo-request-priority": b"2"}, None, "critical", "critical"),
        ({}, 3, "normal", "low"),  # vLLM's body priority: lower first, the class at that rank
        ({}, 0, "normal", "normal"),  # vLLM's default
        ({}, -5, "high", "high"),
        ({b"x-llm-d-inference-objective": b"low"}, None, "normal", "low"),
        ({b"x-llm-d-inference-objective": b"premium"}, None, "normal", "normal"),  # names no class: left alone
        # several at once: the least urgent wins
        ({b"x-smg-priority": b"default", b"x-dynamo-request-priority": b"-1"}, 1, "critical", "low"),
        ({}, "low", "normal", "low"),  # weir's own class name still works
    ],
)
def test_the_priority_table(headers, body, tier, klass):
    assert _klass(headers, tier, body) == klass


_HINT_HEADERS = st.fixed_dictionaries(
    {},
    optional={
        b"x-smg-priority": st.sampled_from([b"bulk", b"default", b"interactive", b"system"]),
        b"x-dynamo-request-priority": st.integers(-100, 100).map(lambda n: str(n).encode()),
        b"x-llm-d-inference-objective": st.sampled_from([c.encode() for c in CLASSES] + [b"other"]),
    },
)


@given(headers=_HINT_HEADERS, body=st.none() | st.integers(-(2**40), 2**40), tier=st.sampled_from(CLASSES))
def test_a_stated_priority_never_raises_the_key_class(headers, body, tier):
    """Property: whatever is stated, in whatever direction, the class is the
    key's tier or below it -- and is exactly the least urgent one stated."""
    klass = _klass(headers, tier, body)
    assert CLASSES.index(klass) >= CLASSES.index(tier)
    alone = [CLASSES.index(_klass({k: v}, "critical")) for k, v in headers.items()]
    if body is not None:
        alone.append(CLASSES.index(_klass({}, "critical", body)))
    assert CLASSES.index(klass) == max([CLASSES.index(tier), *alone])


@given(st.dictionaries(st.sampled_from(sorted(HEADERS)), st.binary(max_size=300), max_size=len(HEADERS)))
def test_any_header_values_give_routing_or_a_400_never_a_crash(headers):
    try:
        r = routing_from_headers(headers)
    except api.RequestError as e:
        assert e.info.status == 400 and e.info.param is not None
        return
    assert (r is None) == (not headers)
    # what was read survives the wire (a direct client's Submit carries the same struct)
    sub = p.Submit("r", "m", prompt="x", routing=r)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sub), type=p.Submit).routing == r


def test_direct_client_routing_is_bounded_by_the_wire():
    raw = msgspec.msgpack.encode(p.Submit("r", "m", prompt="x", routing=p.Routing(session="s")))
    assert msgspec.msgpack.decode(raw, type=p.Submit).routing == p.Routing(session="s")
    with pytest.raises(msgspec.ValidationError):
        bad = p.Submit("r", "m", prompt="x", routing=p.Routing(session="s" * 300))
        msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=p.Submit)


def test_a_direct_client_sends_routing():
    from shared.client import _submit

    r = p.Routing(session="s", parent_session="root", ttft_target_ms=200.0)
    sub = _submit("id", "m", "hi", None, 4, None, None, None, routing=r)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sub), type=p.Submit).routing == r


# ------------------------------------------------------------------ a deployment's own session headers


def test_configured_session_headers_are_read_after_the_built_in_ones():
    from router.api.agent_headers import AgentHeaders

    agent = AgentHeaders(["x-my-agent-session", "x-session-id", "x-other"])  # a built-in one listed again: kept once
    assert agent.session == (*SESSION_HEADERS, b"x-my-agent-session", b"x-other")
    assert {b"x-my-agent-session", b"x-other"} <= agent.names and HEADERS <= agent.names
    r = agent.routing({b"x-my-agent-session": b"s-1"})
    assert r is not None and r.session == "s-1"
    r = agent.routing({b"x-other": b"s-2", b"x-my-agent-session": b"s-1"})  # in the configured order
    assert r is not None and r.session == "s-1"
    r = agent.routing({b"x-my-agent-session": b"s-1", b"x-claude-code-session-id": b"cc"})  # a built-in wins
    assert r is not None and r.session == "cc"
    assert routing_from_headers({b"x-my-agent-session": b"s-1"}) is None  # not configured: not read
    with pytest.raises(api.RequestError) as e:  # held to the same rules as the built-in ones
        agent.routing({b"x-my-agent-session": b"x" * 300})
    assert e.value.info.param == "x-my-agent-session"


@pytest.mark.parametrize("name", ["X-Session", "x session", "x-api-key", "authorization", "cookie", ""])
def test_a_configured_session_header_must_be_a_lower_case_name_and_no_credential(name):
    from shared.config import ConfigError, loads

    assert loads('[scheduler]\nsession_headers = ["x-my-agent-session"]\n').scheduler.session_headers == [
        "x-my-agent-session"
    ]
    with pytest.raises(ConfigError, match="session_headers"):
        loads(f"[scheduler]\nsession_headers = [{json.dumps(name)}]\n")
