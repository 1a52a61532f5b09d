"""The latency-target simulation (simulation.targets_des) on a small fleet:
over capacity, weir with targets serves the target-bearing requests it
admits within their TTFT target far more often than FIFO, at least as
often as its own policy with the targets ignored, sheds only sheddable
work, and its TTFT and TPOT predictions are checked (a finite error)
against what the simulated engines did.  The measured fleet and load:
bench/results/2026-12-05-targets.md."""

from __future__ import annotations

import math

from simulation import targets_des as T


def test_targets_beat_fifo_and_the_policy_without_them_over_capacity():
    capacity, rate, out = T.compare(n_workers=2, load=2.0, duration_s=20.0, tpot_target_s=0.05)
    assert rate == 2.0 * capacity > 0
    weir, off, fifo = (out[k].target_stats() for k in ("weir", "targets_off", "fifo"))
    assert weir["sent"] == off["sent"] == fifo["sent"] > 100
    assert weir["attainment"] >= 0.9
    assert weir["attainment"] > fifo["attainment"] + 0.5
    assert weir["attainment"] > off["attainment"] + 0.1  # (2x: what the policy alone serves late, shed)
    assert weir["goodput_rps"] > fifo["goodput_rps"]
    # only the sheddable (interactive) half is ever shed, and only with targets on
    assert weir["shed"] == out["weir"].counters["ttft_target_shed"]
    assert off["shed"] == fifo["shed"] == 0
    assert all(r.outcome != "latency_target_unattainable" for r in out["weir"].records if r.kind == "batch")
    # predictions were made and checked against the engines' first tokens and ends
    assert weir["predictions"] > 100 and math.isfinite(weir["mape"]) and out["weir"].mape_gauge is not None
    assert out["weir"].tpot_mape_gauge is not None and out["weir"].tpot_mape_gauge < 0.5
    assert out["targets_off"].mape_gauge is None  # nothing carried a target there
