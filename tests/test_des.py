"""Discrete-event simulation: weir's policy vs plain FIFO on the same seeded
arrivals, over simulated engines (router/des.py).  Each test runs in a few
seconds of CPU; the figures are printed by ``python -m router.des``.

The assertions keep a conservative margin under the measured figures (the
simulated engine's calibration may move them), but each would fail if the
policy lost its effect.
"""

from __future__ import annotations

from router.des import (SHORT, Workload, fifo_cfg, fleet, scenario_ledger, scenario_mixed,
                        scenario_overload, simulate, weir_cfg)


def test_short_requests_do_not_wait_behind_long_ones():
    """(a) 80 % short / 20 % long at 90 % of FIFO's saturation throughput."""
    rate, weir, fifo = scenario_mixed(duration_s=120.0)
    for res in (weir, fifo):
        assert res.preemptions == 0
        assert set(res.rejections()) == set()  # nothing refused: a stable load
    w99, f99 = weir.p(99, kind="short"), fifo.p(99, kind="short")
    print(f"short p99 e2e: weir {w99 * 1e3:.0f} ms, fifo {f99 * 1e3:.0f} ms ({f99 / w99:.1f}x)")
    assert f99 >= 3.0 * w99  # target 5x; measured ~4.9x on this seed
    # shorts are served almost at once; long requests pay little for it
    assert weir.p(99, "ttft", kind="short") < 0.1 * fifo.p(99, "ttft", kind="short")
    assert weir.p(99, kind="long") < 1.5 * fifo.p(99, kind="long")


def test_high_priority_keeps_its_latency_under_2x_overload():
    """(b) 2x overload, 10 % high priority: high p99 TTFT vs its unloaded value."""
    rate, unloaded, weir, fifo = scenario_overload(duration_s=20.0)
    base = unloaded.p(99, "ttft", kind="high")
    w, f = weir.p(99, "ttft", kind="high"), fifo.p(99, "ttft", kind="high")
    print(f"high p99 ttft: unloaded {base * 1e3:.1f} ms, weir {w * 1e3:.1f} ms ({w / base:.2f}x), "
          f"fifo {f * 1e3:.0f} ms")
    assert w <= 3.0 * base  # target 2x; measured ~2x
    assert f >= 20 * w
    # overload was shed by bounded queues, not by preempting engines
    assert weir.rejections() and weir.preemptions == 0
    # every high-priority request completed under weir
    assert len(weir.done(kind="high")) == sum(1 for r in weir.records if r.kind == "high")


def test_ledger_prevents_kv_preemptions():
    """(c) the same traffic with the ledger on (overcommit 1) and off (1000)."""
    on, off = scenario_ledger(duration_s=10.0)
    print(f"preemptions: ledger on {on.preemptions}, off {off.preemptions}")
    assert on.preemptions == 0
    assert off.preemptions > 0


def test_simulation_is_deterministic():
    workers = fleet()
    wl = Workload((SHORT,), 50.0, 3.0, seed=5)
    a, b = simulate(weir_cfg(), workers, wl), simulate(weir_cfg(), workers, wl)
    key = [(r.job_id, r.first_token, r.finished, r.outcome) for r in a.records]
    assert key == [(r.job_id, r.first_token, r.finished, r.outcome) for r in b.records]
    assert all(r.outcome == "ok" for r in a.records)
    c = simulate(fifo_cfg(), workers, Workload((SHORT,), 50.0, 3.0, seed=6))
    assert [r.arrival for r in c.records] != [r.arrival for r in a.records]
