"""Discrete-event simulation: weir's policy vs plain FIFO on the same seeded
arrivals, over simulated engines (simulation/des.py).  Each test runs in a few
seconds of CPU; the figures are printed by ``python -m simulation.des``.

The assertions keep a conservative margin under the measured figures (the
simulated engine's calibration may move them), but each would fail if the
policy lost its effect.
"""

from __future__ import annotations

from simulation.des import (
    BURST,
    SHORT,
    SimWorker,
    Workload,
    burst_arrivals,
    deadline_classes,
    fifo_cfg,
    fleet,
    retry_stats,
    scenario_burst,
    scenario_ledger,
    scenario_mixed,
    scenario_overload,
    simulate,
    wait_errors,
    weir_cfg,
)


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
    print(
        f"high p99 ttft: unloaded {base * 1e3:.1f} ms, weir {w * 1e3:.1f} ms ({w / base:.2f}x), fifo {f * 1e3:.0f} ms"
    )
    assert w <= 3.0 * base  # target 2x; measured ~2x
    assert f >= 20 * w
    # overload was shed at the door by the predicted-wait bound (429 at once),
    # hardly ever after waiting out the deadline (503), and not by preempting engines
    refused = weir.rejections()
    assert refused["queue_wait_exceeded"] + refused["tenant_share_exceeded"] > 1000
    assert refused["queue_deadline"] <= 0.01 * sum(refused.values())  # measured: 8 of ~3,700
    assert weir.preemptions == 0
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


def test_a_burst_the_fleet_absorbs_within_the_deadline_is_all_served():
    """2,000 x 64-token requests at once on one 256-slot worker (the issue's
    sim case: 512 served, 1,488 refused under a count bound)."""
    workers = [SimWorker("w0", max_num_seqs=256)]
    res = simulate(weir_cfg(), workers, Workload((BURST,), 1.0, 1.0), burst=burst_arrivals(2000))
    assert len(res.done()) == 2000, res.rejections()


def test_a_20x_burst_is_refused_at_once_and_retries_are_spread():
    """20x what one worker serves within a 10 s deadline, all at once; the
    refused honour Retry-After once."""
    n, within, res = scenario_burst(multiple=20.0, queue_deadline_s=10.0)
    refused = res.rejections()
    stats = retry_stats(res)
    print(f"burst {n} (fleet serves {within} in the deadline): {stats}, left refused {dict(refused)}")
    first_admitted = n - stats["refused_first"]
    # the cold-start prediction admits about what fits (measured 1.06x)
    assert 0.7 * within <= first_admitted <= 1.5 * within
    # refused at once, rarely after waiting (measured: 19 of 27,640)
    assert refused["queue_deadline"] <= 0.05 * n
    # most refused requests are served on their first retry (measured: all)
    assert stats["fraction"] >= 0.8
    err = wait_errors(res)
    assert err["abs_p50_s"] <= 0.1 * 10.0  # predicted vs actual wait (measured 0.14 s)


def test_a_quiet_tenant_beside_a_flooder_is_never_refused():
    flood = burst_arrivals(20_000, tenants=("flood",), spread_s=20.0, seed=1)
    quiet = [(t, k, "quiet", p, m) for (t, k, _, p, m) in burst_arrivals(200, spread_s=20.0, seed=2)]
    workers = [SimWorker("w0", max_num_seqs=64)]
    res = simulate(
        weir_cfg(classes=deadline_classes(5.0)),
        workers,
        Workload((BURST,), 1.0, 1.0),
        burst=sorted(flood + quiet, key=lambda a: a[0]),
    )
    by = {t: [r for r in res.records if r.tenant == t] for t in ("flood", "quiet")}
    assert all(r.outcome == "ok" for r in by["quiet"])
    assert sum(r.outcome != "ok" for r in by["flood"]) > 10_000
    assert max(r.first_token - r.arrival for r in by["quiet"]) < 1.0  # it does not wait behind the flood
