"""Latency targets through the real lifecycle (fake workers, a fake clock):
a request with a TPOT target is placed on the worker whose registered step
time meets it, its end is judged against the target by the TPOT the router
measured (first token to last), and a sheddable one no worker can serve in
time is refused before anything is held."""

from __future__ import annotations

import msgspec
from test_lifecycle import Harness, config, register

from shared import protocol as p


def _join(h: Harness, worker_id: str, step_time_s: float) -> None:
    h.workers.linked.add(worker_id)
    h.core.worker_joined(msgspec.structs.replace(register(worker_id, seqs=4), step_time_s=step_time_s))


def _ask(h: Harness, rid: str, tpot_ms: float, sheddable: bool = False) -> int | p.ErrorInfo:
    routing = p.Routing(tpot_target_ms=tpot_ms, sheddable=sheddable)
    handle, _ = h.ask(p.Submit(rid, "sim-m", prompt="hello there", max_tokens=8, routing=routing))
    return handle


def test_a_tpot_target_places_on_the_worker_that_meets_it_and_is_judged_at_the_end() -> None:
    h = Harness(config())
    try:
        _join(h, "w0", 0.4)  # slow: 100 ms a step at its 4 sequences
        _join(h, "w1", 0.02)  # fast: 5 ms
        plain = _ask(h, "plain", 0.0)
        assert isinstance(plain, int) and h.workers.where("%x" % plain) == "w0"  # no target: the tie, w0
        fast = _ask(h, "fast", 20.0, sheddable=True)
        assert isinstance(fast, int) and h.workers.where("%x" % fast) == "w1"
        # its tokens come 10 ms apart, within its 20 ms target: met, and counted in goodput
        h.tokens(fast, 1)
        for _ in range(7):
            h.clock.t += 0.010
            h.tokens(fast, 1)
        h.tokens(fast, 0, "length")
        h.settle()
        policy = h.core.policy
        assert policy.counters["tpot_target_met"] == 1 and policy.counters["tpot_target_missed"] == 0
        [row] = policy.snapshot(h.clock.t)["targets"]
        assert (row["model"], row["tpot_met"], row["goodput"]) == ("sim-m", 1, 1)
        assert not policy.targets.decoding  # nothing left behind
        # none can decode at 0.1 ms a token: a sheddable request is refused, nothing reserved for it
        held = h.reserved()
        refused = _ask(h, "never", 0.1, sheddable=True)
        assert isinstance(refused, p.ErrorInfo) and refused.code == "latency_target_unattainable"
        assert refused.retry_after is not None and refused.retry_after >= 1.0
        assert h.reserved() == held and policy.counters["tpot_target_shed"] == 1
    finally:
        h.close()
