"""Aliases in the lifecycle (router.lifecycle.core with router.api.aliases):
a request naming an alias runs on the target its key draws, the client is
told that model, an overloaded or absent target falls back in the alias's
order.  (/v1/models and the same through Envoy: tests/e2e/test_agent_routing_e2e.py.)
tests/inproc/test_lifecycle.py's
harness: fake workers, fake clock."""

from __future__ import annotations

import msgspec
from test_lifecycle import Harness

from router.api.aliases import pick
from shared import protocol as p
from shared.config import Config

ALIAS = {
    "name": "agent",
    "targets": [{"model": "sim-a", "weight": 1}, {"model": "sim-b", "weight": 1}],
    "fallbacks": ["sim-c"],
}


def _config() -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.25},
            "models": [{"name": n, "engine": "sim", "max_model_len": 4096} for n in ("sim-a", "sim-b", "sim-c")],
            "aliases": [ALIAS],
        },
        Config,
    )


def _key_for(model: str) -> str:
    cfg = _config().aliases[0]
    return next(f"trace-{k}" for k in range(1000) if pick(cfg, f"trace-{k}") == model)


def test_an_alias_runs_on_its_drawn_target_and_names_it() -> None:
    h = Harness(_config())
    try:
        for wid, m in (("a-0", "sim-a"), ("b-0", "sim-b"), ("c-0", "sim-c")):
            h.join(wid, model=m)
        for target, worker in (("sim-a", "a-0"), ("sim-b", "b-0")):
            handle, sink = h.ask(p.Submit("r", "agent", prompt="hi", max_tokens=2, trace_id=_key_for(target)))
            assert isinstance(handle, int) and h.workers.where("%x" % handle) == worker
            h.tokens(handle, 2, "length")
            assert sink.deltas[0].model == target  # the response names the model that served it
        # a session's requests: all to one target, whatever their request ids
        where = set()
        for k in range(6):
            r = p.Routing(session="s-1")
            handle, _ = h.ask(p.Submit("r", "agent", prompt="hi", max_tokens=2, trace_id=f"t{k}", routing=r))
            assert isinstance(handle, int)
            where.add(h.workers.where("%x" % handle))
            h.tokens(handle, 2, "length")
        assert len(where) == 1
        assert h.reserved() == 0 and not h.core.jobs
    finally:
        h.close()


def test_a_target_without_workers_falls_back_in_the_aliass_order() -> None:
    h = Harness(_config())
    try:
        h.join("c-0", model="sim-c")  # sim-a and sim-b have no worker
        handle, sink = h.ask(p.Submit("r", "agent", prompt="hi", max_tokens=2, trace_id=_key_for("sim-b")))
        assert isinstance(handle, int) and h.workers.where("%x" % handle) == "c-0"
        h.tokens(handle, 2, "length")
        assert sink.deltas[0].model == "sim-c"
        (final,) = sink.finals
        assert final.error is None
        # nothing behind it served at all: a clear 503
        h.core.registry.start_unloading("sim-c")
        h.core.registry.start_unloading("sim-a")
        h.core.registry.start_unloading("sim-b")
        r, _ = h.ask(p.Submit("r", "agent", prompt="hi", max_tokens=2))
        assert isinstance(r, p.ErrorInfo) and (r.status, r.code, r.param) == (503, "no_worker", "model")
        assert r.retry_after is not None
    finally:
        h.close()
