"""A client may lower the class its API key's tier gives it, never raise it:
through the real lifecycle, the class shows in the router's request metric and
in the engine priority each dispatch carries (lower runs first in vLLM)."""

from __future__ import annotations

import msgspec
from prometheus_client import generate_latest
from test_lifecycle import Harness, Sink

from shared import protocol as p
from shared.config import Config

KEY = "sk-hi"


def _config() -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "api_keys": [{"key": KEY, "tenant": "t", "tier": "normal"}],
            "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}],
        },
        Config,
    )


def test_priority_may_be_lowered_not_raised() -> None:
    h = Harness(_config())
    try:
        h.join("w0")
        handles = {}
        for asked in ("low", "critical"):  # critical is above the key's tier: served at its tier
            handle = h.core.submit(
                p.Submit(f"r-{asked}", "sim-m", prompt="hi", max_tokens=2, api_key=KEY, priority=asked), Sink()
            )
            assert isinstance(handle, int), handle
            handles[asked] = handle
        h.settle()
        sent = {r.request_id: r.priority for r in h.workers.dispatched["w0"]}
        low, capped = sent["%x" % handles["low"]], sent["%x" % handles["critical"]]
        assert low > capped  # the lowered request runs after the one capped at its tier
        for handle in handles.values():
            h.tokens(handle, 2, "stop")
        served = [
            line
            for line in generate_latest(h.core.metrics.registry).decode().splitlines()
            if line.startswith("weir_requests_total{")
        ]
        assert any('klass="low"' in line for line in served)
        assert any('klass="normal"' in line for line in served)
        assert not any('klass="critical"' in line for line in served)
    finally:
        h.close()
