"""The fallback choice (router.lifecycle.core): a model's configured fallback answers
when the primary has no worker -- only for a request that asks for it -- and
the client learns which model answered with its first news.

The lifecycle in-process (tests/inproc/test_lifecycle.py's harness: fake
workers, fake clock).  The same request through Envoy, the body field, the
x-weir-allow-fallback header, the x-weir-model header and the ZeroMQ client:
tests/e2e/test_faults.py."""

from __future__ import annotations

import msgspec
from test_lifecycle import Harness

from shared import protocol as p
from shared.config import Config

PRIMARY, BACKUP = "sim-primary", "sim-backup"


def _config() -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.25},
            "models": [
                {"name": PRIMARY, "engine": "sim", "max_model_len": 4096, "fallbacks": [BACKUP]},
                {"name": BACKUP, "engine": "sim", "max_model_len": 4096},
            ],
        },
        Config,
    )


def _fallbacks(h: Harness, model: str, fallback: str) -> float:
    return (
        h.core.metrics.registry.get_sample_value("weir_fallbacks_total", {"model": model, "fallback": fallback}) or 0.0
    )


def test_a_fallback_model_answers_when_the_primary_has_no_worker_only_if_asked() -> None:
    h = Harness(_config())
    try:
        h.join("prim-0", model=PRIMARY)
        h.join("back-0", model=BACKUP)
        body = {"model": PRIMARY, "prompt": "hi", "max_tokens": 3}
        ok, sink = h.ask(p.Submit("c", **body))
        assert isinstance(ok, int) and h.workers.where("%x" % ok) == "prim-0"
        h.tokens(ok, 3, "length")
        assert sink.finals and not any(d.model for d in sink.deltas)  # the one asked for: not named
        h.leave("prim-0")
        # Not asked for: the primary's own refusal, as before.
        r, _ = h.ask(p.Submit("c", **body))
        assert isinstance(r, p.ErrorInfo) and r.status == 503 and r.code == "no_worker"
        # Asked for (a completion, a chat, a direct client's): the backup answers, and says so.
        asked = [
            p.Submit("c", **body, allow_fallback=True),
            p.Submit(
                "c",
                PRIMARY,
                kind=p.RequestKind.CHAT,
                messages=[p.ChatMessage("user", "hi")],
                max_tokens=3,
                allow_fallback=True,
            ),
            p.Submit("c", **body, allow_fallback=True),
        ]
        for sub in asked:
            handle, sink = h.ask(sub)
            assert isinstance(handle, int) and h.workers.where("%x" % handle) == "back-0"
            h.tokens(handle, 3, "length")
            assert sink.deltas[0].model == BACKUP
            (final,) = sink.finals
            assert final.error is None and final.completion_tokens == 3
        assert _fallbacks(h, PRIMARY, BACKUP) == 3
        assert h.reserved() == 0 and not h.core.jobs
    finally:
        h.close()
