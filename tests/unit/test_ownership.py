"""router.tenancy.ownership: who may see a stored response, file or batch; and
router.api.metadata: OpenAI's limits on ``metadata``."""

from __future__ import annotations

import pytest

from router.api import responses as rs
from router.api.errors import RequestError
from router.api.metadata import metadata_problem
from router.tenancy.ownership import ANONYMOUS_TENANT, Caller, caller_of, key_live, may_see
from shared.config import ApiKey
from shared.keys import digest
from shared.protocol import ErrorInfo

A1, A2, B = "sk-a-one", "sk-a-two", "sk-b"
KEYS = {digest(k): ApiKey(key=k, tenant=t) for k, t in ((A1, "a"), (A2, "a"), (B, "b"))}


def test_no_key_or_an_unknown_key_is_401_when_keys_are_configured():
    for presented in (None, "", "sk-nope", A1 + " "):
        got = caller_of(KEYS, presented)
        assert isinstance(got, ErrorInfo) and got.status == 401 and got.code == "invalid_api_key"
    assert caller_of(KEYS, A1) == Caller("a", digest(A1))
    assert caller_of({}, None) == caller_of({}, "anything") == Caller(ANONYMOUS_TENANT, "")


def test_only_the_owning_tenant_sees_an_object():
    assert may_see("a", "a") and not may_see("a", "b") and not may_see("a", "")
    # an object made by one key is seen by the tenant's other keys too, while its key lives
    assert may_see("a", caller_of(KEYS, A2).tenant, digest(A1), KEYS)  # type: ignore[union-attr]
    assert not may_see("a", "b", digest(A1), KEYS)


def test_a_removed_or_moved_key_takes_its_objects_with_it():
    removed = {h: k for h, k in KEYS.items() if h != digest(A1)}
    assert not key_live("a", digest(A1), removed) and not may_see("a", "a", digest(A1), removed)
    assert may_see("a", "a", digest(A2), removed)
    moved = {**KEYS, digest(A1): ApiKey(key=A1, tenant="c")}
    assert not may_see("a", "a", digest(A1), moved)
    # keys configured later: what the anonymous tenant stored is nobody's; keys all removed: a key's is nobody's
    assert not key_live(ANONYMOUS_TENANT, "", KEYS)
    assert key_live(ANONYMOUS_TENANT, "", {}) and not key_live("a", digest(A1), {})


@pytest.mark.parametrize(
    "metadata, bad",
    [
        (None, False),
        ({}, False),
        ({f"k{i}": "v" for i in range(16)}, False),
        ({f"k{i}": "v" for i in range(17)}, True),
        ({"k" * 64: "v" * 512}, False),
        ({"k" * 65: "v"}, True),
        ({"k": "v" * 513}, True),
    ],
)
def test_metadata_is_held_to_openais_limits(metadata, bad):
    assert (metadata_problem(metadata) is not None) == bad


@pytest.mark.parametrize(
    "metadata", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, ["k"]]
)
def test_responses_refuse_bad_metadata_with_param_metadata(metadata):
    import msgspec

    body = msgspec.json.encode({"model": "m", "input": "hi", "metadata": metadata})
    with pytest.raises(RequestError) as e:
        rs.decode_responses(body)
    assert e.value.info.status == 400 and e.value.info.param == "metadata"
