"""Who a request runs as (router.tenancy.identity.Keys): a client may lower the
priority its API key's tier gives it, never raise it."""

from __future__ import annotations

import msgspec
import pytest

from router.tenancy.identity import Identity, Keys
from shared import protocol as p
from shared.config import Config


@pytest.mark.parametrize("tier_key,lowered", [("sk-hi", "low")])
def test_priority_may_be_lowered_not_raised(tier_key: str, lowered: str) -> None:
    cfg = msgspec.convert({"api_keys": [{"key": tier_key, "tenant": "t", "tier": "normal"}]}, Config)
    keys = Keys(cfg)

    def ask(priority: str) -> Identity | p.ErrorInfo:
        return keys.identify(p.Submit("r", "m", prompt="hi", max_tokens=2, api_key=tier_key, priority=priority))

    served = [ask(lowered), ask("critical")]  # asked above its tier: served at its tier
    assert all(isinstance(who, Identity) for who in served)
    klasses = [who.klass for who in served if isinstance(who, Identity)]
    assert any(k == "low" for k in klasses)
    assert not any(k == "critical" for k in klasses)
    assert klasses == ["low", "normal"]
