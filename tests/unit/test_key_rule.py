"""One API key rule at Envoy and at the router: the Lua text Envoy runs
(deploy.envoy_config.KEY_LUA, under LuaJIT as in Envoy) and the router's
parser (shared.keys, as router/ingress/http_server.py feeds it) accept exactly the
same header values, refuse the same ones, and agree on the key."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deploy.envoy_config import KEY_HEADER, KEY_LUA
from router.api import meta_from_headers
from router.tenancy.identity import Keys
from shared import protocol as p
from shared.config import ConfigError, loads
from shared.keys import well_formed

lupa = pytest.importorskip("lupa.luajit21")

_HARNESS = """
return function(values)
  local added, status, removed = nil, nil, false
  local hs = {}
  function hs:getNumValues(n) local v = values[n]; if v == nil then return 0 end; return #v end
  function hs:get(n) local v = values[n]; if v == nil then return nil end; return v[1] end
  function hs:getAtIndex(n, i) return values[n][i + 1] end
  function hs:remove(n) if n == "%s" then removed = true end; values[n] = nil end
  function hs:add(n, v) if n == "%s" then added = v end end
  local h = {}
  function h:headers() return hs end
  function h:respond(headers, body) status = headers[":status"] end
  envoy_on_request(h)
  return status, added, removed
end
""" % (KEY_HEADER, KEY_HEADER)


@pytest.fixture(scope="module")
def envoy_lua():
    lua = lupa.LuaRuntime(encoding=None)
    lua.execute(KEY_LUA.encode())
    run = lua.execute(_HARNESS.encode())

    def decide(headers: dict[bytes, list[bytes]]) -> tuple[str, bytes | None]:
        table = lua.table_from({name: lua.table_from(vals) for name, vals in headers.items()})
        status, added, removed = run(table)
        assert removed, "a client's own rate-limit key header is always dropped"
        if status is not None:
            assert status == b"401" and added is None
            return "refused", None
        return ("key", added) if added is not None else ("none", None)

    return decide


def router_decides(headers: dict[bytes, list[bytes]]) -> tuple[str, bytes | None]:
    """As router/ingress/http_server.py reads headers (a repeated one ", "-joined,
    latin-1 text), then meta_from_headers and admission's rule."""
    joined = {name: b", ".join(vals) for name, vals in headers.items() if vals}

    def header(name: bytes) -> str | None:
        v = joined.get(name)
        return None if v is None else v.decode("latin-1")

    key = meta_from_headers(header(b"authorization"), header(b"x-api-key")).api_key
    if key is None:
        return "none", None
    if not well_formed(key):
        return "refused", None
    return "key", key.encode("latin-1")


# Header values built from the pieces that matter: blanks of every kind
# (ASCII and not), the bearer scheme in any case, commas, high bytes.
_PIECES = st.sampled_from(
    [
        b" ",
        b"\t",
        b"\xa0",
        b"\xc2\xa0",
        b"\x0b",
        b"\x0c",
        b"\r",
        b"\x85",
        b"\x00",
        b",",
        b"Bearer",
        b"bEaReR",
        b"Basic",
        b"sk-limited",
        b"k",
        b"\xff",
        b"~",
        b"!",
        b"\x7f",
        b"\x20\x20",
    ]
)
_VALUE = st.one_of(st.lists(_PIECES, max_size=6).map(b"".join), st.binary(max_size=12))
_HEADERS = st.fixed_dictionaries(
    {},
    optional={
        b"x-api-key": st.lists(_VALUE, min_size=1, max_size=2),
        b"authorization": st.lists(_VALUE, min_size=1, max_size=2),
        KEY_HEADER.encode(): st.lists(_VALUE, min_size=1, max_size=1),
    },
)


@settings(max_examples=3000, deadline=None)
@given(_HEADERS)
@example({b"x-api-key": [b"sk-limited\xa0"]})
@example({b"x-api-key": [b"sk-limited" + b"\xa0" * 3]})
@example({b"authorization": [b"Bearer sk-limited\xc2\xa0"]})
@example({b"x-api-key": [b" \t"], b"authorization": [b"bearer\t sk-limited "]})
@example({b"x-api-key": [b"sk-limited", b"sk-other"]})
@example({b"x-api-key": [b"", b""]})
@example({b"authorization": [b"Bearer"]})
def test_envoy_and_router_agree_on_every_header_value(envoy_lua, headers):
    assert envoy_lua(headers) == router_decides(headers)


def test_the_rule_on_examples(envoy_lua):
    for headers, want in [
        ({b"x-api-key": [b"  sk-limited\t"]}, ("key", b"sk-limited")),
        ({b"authorization": [b"Bearer   sk-limited"]}, ("key", b"sk-limited")),
        ({b"x-api-key": [b"sk-limited\xa0"]}, ("refused", None)),  # the bucket dodge
        ({b"x-api-key": [b"sk-limited\xa0\xa0"]}, ("refused", None)),
        ({b"x-api-key": [b"sk limited"]}, ("refused", None)),
        ({b"x-api-key": [b"sk-limited", b"sk-limited"]}, ("refused", None)),  # sent twice
        ({b"authorization": [b"Basic abc"]}, ("none", None)),
        ({}, ("none", None)),
    ]:
        assert envoy_lua(headers) == want, headers
        assert router_decides(headers) == want, headers


def test_trimming_is_linear_on_a_long_run_of_blanks(envoy_lua):
    """A 60 KiB run of blanks inside a value (a quadratic pattern would take minutes)."""
    value = b"a" + b" " * (60 << 10) + b"b"
    assert envoy_lua({b"x-api-key": [value]}) == ("refused", None)


def _keys(api_keys: str = "") -> Keys:
    return Keys(loads('[[models]]\nname = "sim-m"\nengine = "sim"\n' + api_keys))


_ONE_KEY = '[[api_keys]]\nkey = "sk-beta"\ntenant = "beta"\n'


@pytest.mark.parametrize("api_keys", ["", _ONE_KEY], ids=["no-keys", "keys"])
@pytest.mark.parametrize("key", ["sk-beta\xa0", "sk-beta\u00a0\u00a0", "sk beta", "sk-beta\x7f", "é"])
def test_router_refuses_a_malformed_key_with_or_without_keys(api_keys, key):
    """What direct ZeroMQ clients send arrives here as it is (no header trimming)."""
    who = _keys(api_keys).identify(p.Submit(request_id="r", model="sim-m", api_key=key))
    assert isinstance(who, p.ErrorInfo)
    assert (who.status, who.code) == (401, "invalid_api_key")
    assert "Malformed API key" in who.message


def test_router_accepts_the_canonical_key():
    who = _keys(_ONE_KEY).identify(p.Submit(request_id="r", model="sim-m", api_key="sk-beta"))
    assert not isinstance(who, p.ErrorInfo) and who.tenant == "beta"


@pytest.mark.parametrize("key", ["sk beta", "sk-beta\xa0", "ключ"])
def test_a_configured_plain_key_must_be_well_formed(key):
    with pytest.raises(ConfigError, match="printable ASCII"):
        _keys(f'[[api_keys]]\nkey = "{key}"\ntenant = "beta"\n')
