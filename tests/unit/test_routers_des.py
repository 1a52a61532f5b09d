"""The N-router discrete-event simulation (simulation/routers_des.py): one
router reproduces simulation.des exactly; several never over-commit an
engine (the workers' ledgers), never preempt, lose nothing, and serve the
same arrivals."""

from __future__ import annotations

from simulation import des, routers_des


def test_n_routers_over_one_fleet():
    workers = des.fleet(kv_tokens=16384)
    rate, out = routers_des.compare(ns=(1, 2, 4), duration_s=15.0, workers=workers)
    _, one, _ = des.scenario_mixed(duration_s=15.0)
    single = out[1][0]
    assert [(r.job_id, r.first_token, r.finished) for r in single.records] == [
        (r.job_id, r.first_token, r.finished) for r in one.records
    ]
    for n, (res, counts) in out.items():
        assert counts["max_overcommit_tokens"] <= 0 and res.preemptions == 0
        assert len(res.done()) == len(single.done()) == len(res.records), (n, res.rejections())
    assert out[2][1]["refused_by_worker"] > 0  # the routers' views did collide, and were arbitrated
