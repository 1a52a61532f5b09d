"""The agent-replay simulation (simulation.agents_des): its workload is what
it says (sessions of 3-20 turns with growing context, sub-agents from their
parent's context), and on it weir's placement (sessions + prefix affinity)
beats the baselines in TTFT and KV hit rate at moderate load (a small fleet
here; the measured fleets: docs/benchmarks.md)."""

from __future__ import annotations

from simulation import agents_des as A


def test_the_workload_grows_each_sessions_context_and_fans_out_from_it():
    starts = A.sessions(A.AgentLoad(sessions_per_s=1.0, duration_s=40.0, seed=3))
    assert starts
    fanned = 0
    for _, first in starts:
        turns, t = [], first
        while t is not None:
            turns.append(t)
            for child in t.children:
                fanned += 1
                assert child.parent == t.session and child.blocks[: len(t.blocks)] == t.blocks
            t = t.next
        assert 3 <= len(turns) <= 20
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.blocks[: len(a.blocks)] == a.blocks and len(b.blocks) > len(a.blocks)
            assert 1.0 <= b.think_s <= 10.0
    assert fanned > 0


def test_weir_beats_the_baselines_on_agent_traffic():
    load = A.AgentLoad(sessions_per_s=1.0, duration_s=30.0)
    got = {name: A.run(name, 8, load) for name in A.PLACEMENTS}
    assert all(r["ok"] == r["requests"] for r in got.values())
    weir = got["weir"]
    assert weir["ttft_p90_s"] * 2 <= got["round_robin"]["ttft_p90_s"]
    assert weir["ttft_p90_s"] * 1.3 <= got["prefix_only"]["ttft_p90_s"]
    assert weir["hit_rate"] > max(r["hit_rate"] for n, r in got.items() if n != "weir")
