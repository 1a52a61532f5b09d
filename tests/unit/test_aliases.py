"""Model aliases (router.api.aliases, shared.config [[aliases]]): a weighted
split drawn by a stable hash (a session's requests to one target), ordered
fallbacks skipping what is not served, and the config's checks."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.aliases import AliasTable, pick
from shared.config import AliasConfig, AliasTarget, Config, ConfigError, _validate

A = AliasConfig("agent", [AliasTarget("sim-a", 9.0), AliasTarget("sim-b", 1.0)], fallbacks=["sim-c", "sim-a"])


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.floats(0.5, 10.0), min_size=1, max_size=4))
def test_each_target_gets_its_weights_share(weights):
    a = AliasConfig("x", [AliasTarget(f"sim-{i}", w) for i, w in enumerate(weights)])
    n = 8000
    counts: dict[str, int] = {}
    for k in range(n):
        m = pick(a, f"req-{k:08x}")
        counts[m] = counts.get(m, 0) + 1
    total = sum(weights)
    for i, w in enumerate(weights):
        assert abs(counts.get(f"sim-{i}", 0) / n - w / total) < 0.04


def test_the_draw_is_stable_per_key():
    assert all(pick(A, f"session-{k}") == pick(A, f"session-{k}") for k in range(100))
    assert {pick(A, f"session-{k}") for k in range(200)} == {"sim-a", "sim-b"}


def test_resolve_gives_the_drawn_target_then_fallbacks_in_order_skipping_what_is_not_served():
    t = AliasTable([A])
    key = next(f"k{k}" for k in range(1000) if pick(A, f"k{k}") == "sim-b")
    assert t.resolve("agent", key, lambda m: True) == ["sim-b", "sim-c", "sim-a"]
    assert t.resolve("agent", key, lambda m: m != "sim-b") == ["sim-c", "sim-a"]
    assert t.resolve("agent", key, lambda m: False) == []
    assert t.resolve("sim-a", key, lambda m: True) is None  # a model, not an alias
    key_a = next(f"k{k}" for k in range(1000) if pick(A, f"k{k}") == "sim-a")
    assert t.resolve("agent", key_a, lambda m: True) == ["sim-a", "sim-c"]  # the drawn one not twice


def _cfg(aliases: list[dict]) -> Config:
    models = [{"name": n, "engine": "sim"} for n in ("sim-a", "sim-b", "sim-c")]
    return msgspec.convert({"models": models, "aliases": aliases}, Config)


@pytest.mark.parametrize(
    "aliases,why",
    [
        ([{"name": "sim-a", "targets": [{"model": "sim-b"}]}], "model's name"),
        ([{"name": "x", "targets": [{"model": "sim-b"}]}, {"name": "x", "targets": [{"model": "sim-a"}]}], "twice"),
        ([{"name": "x", "targets": []}], "needs targets"),
        ([{"name": "x", "targets": [{"model": "sim-b", "weight": 0}]}], "weight above 0"),
        ([{"name": "x", "targets": [{"model": "nope"}]}], "not a configured model"),
        ([{"name": "x", "targets": [{"model": "sim-a"}], "fallbacks": ["nope"]}], "not a configured model"),
    ],
)
def test_bad_aliases_are_refused(aliases, why):
    with pytest.raises(ConfigError, match=why):
        _validate(_cfg(aliases))


def test_a_good_alias_loads():
    _validate(
        _cfg(
            [
                {
                    "name": "agent",
                    "targets": [{"model": "sim-a", "weight": 3}, {"model": "sim-b"}],
                    "fallbacks": ["sim-c"],
                }
            ]
        )
    )
