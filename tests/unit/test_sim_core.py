"""SimCore: the pure model of a continuous-batching engine (no clock, no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_worker.sim_model import SimCore
from shared.config import SimEngineConfig


def make(capacity=4096, block=16, max_num_seqs=8, max_model_len=1024, prefill=512, **kw) -> SimCore:
    cfg = SimEngineConfig(kv_capacity_tokens=capacity, block_size=block, max_prefill_tokens=prefill, **kw)
    return SimCore(cfg, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def run(core: SimCore, max_steps=100_000):
    """Steps until idle; returns (per-request tokens, finish reasons, step results)."""
    tokens: dict[str, int] = {}
    finish: dict[str, str] = {}
    steps = []
    for _ in range(max_steps):
        if not core.has_work:
            break
        r = core.step()
        steps.append(r)
        used = core.total_blocks - core.free_blocks
        assert 0 <= used <= core.total_blocks
        assert 0.0 <= core.kv_usage <= 1.0
        for rid, n, reason in r.outputs:
            assert rid not in finish, "output after the final one"
            tokens[rid] = tokens.get(rid, 0) + n
            if reason is not None:
                finish[rid] = reason
    else:
        pytest.fail("engine never drained")
    return tokens, finish, steps


def test_single_request_timeline_and_cost():
    core = make(prefill=100, step_fixed_ms=2.0, prefill_token_us=10.0, decode_token_us=50.0, admit_request_us=300.0)
    core.add("a", prompt_tokens=250, max_tokens=3)
    # prefill in chunks of 100: no token until the chunk that completes the prompt
    r1, r2 = core.step(), core.step()
    assert r1.outputs == [] and r2.outputs == []
    assert r1.duration_s == pytest.approx((2000 + 10 * 100 + 300) / 1e6)  # admission costs once
    assert r2.duration_s == pytest.approx((2000 + 10 * 100) / 1e6)
    r3 = core.step()
    assert r3.outputs == [("a", 1, None)]
    assert r3.duration_s == pytest.approx((2000 + 10 * 50) / 1e6)
    r4 = core.step()
    assert r4.outputs == [("a", 1, None)]
    assert r4.duration_s == pytest.approx((2000 + 50) / 1e6)
    assert core.step().outputs == [("a", 1, "length")]
    assert not core.has_work and core.kv_usage == 0.0
    assert core.step().duration_s == 0.0


def test_zero_cost_steps_take_no_time():
    core = make(zero_cost=True)
    core.add("a", 10, 5)
    _, finish, steps = run(core)
    assert finish == {"a": "length"} and all(s.duration_s == 0.0 for s in steps)


def test_deterministic():
    def trace():
        core = make(capacity=1024, max_num_seqs=6)
        for i in range(20):
            core.add(f"r{i}", prompt_tokens=30 + 17 * i % 90, max_tokens=5 + 13 * i % 70, priority=i % 3)
        _, _, steps = run(core)
        return [(s.duration_s, s.outputs, s.preempted) for s in steps], core.preemptions_total

    assert trace() == trace()


def test_max_num_seqs_bounds_running():
    core = make(max_num_seqs=3)
    for i in range(10):
        core.add(f"r{i}", 20, 10)
    core.step()
    assert core.num_running == 3 and core.num_waiting == 7


def test_priority_orders_admission():
    core = make(max_num_seqs=1)
    core.add("low", 10, 2, priority=5)
    core.add("high", 10, 2, priority=-1)
    core.add("normal-1", 10, 2, priority=0)
    core.add("normal-2", 10, 2, priority=0)
    order = []
    while core.has_work:
        for rid, _, reason in core.step().outputs:
            if reason:
                order.append(rid)
    assert order == ["high", "normal-1", "normal-2", "low"]


def test_oversubscription_preempts_and_everyone_finishes():
    # 4 sequences that each grow to ~256 tokens share 512 tokens of KV.
    core = make(capacity=512, block=16, max_num_seqs=4, max_model_len=512)
    for i in range(4):
        core.add(f"r{i}", prompt_tokens=16, max_tokens=240)
    tokens, finish, steps = run(core)
    assert core.preemptions_total > 0
    assert any(s.preempted for s in steps)
    assert finish == {f"r{i}": "length" for i in range(4)}
    assert tokens == {f"r{i}": 240 for i in range(4)}  # preemption never re-emits tokens
    assert core.free_blocks == core.total_blocks


def test_preemption_victim_is_lowest_priority_then_newest():
    core = make(capacity=256, block=16, max_num_seqs=4, max_model_len=256)
    core.add("old", 16, 200, priority=0)
    core.add("new", 16, 200, priority=0)
    victims = []
    while core.has_work and not victims:
        victims = core.step().preempted
    assert victims[0] == "new"


def test_abort_frees_blocks():
    core = make(capacity=1024)
    core.add("a", 100, 50)
    core.add("b", 100, 50)
    core.step()
    assert core.kv_usage > 0
    assert core.abort("a") and core.abort("b")
    assert core.kv_usage == 0.0 and core.free_blocks == core.total_blocks
    assert not core.has_work
    assert not core.abort("a")  # no longer known
    core.add("w", 10, 1)
    assert core.abort("w") and core.num_waiting == 0 and not core.has_work
    assert core.step().outputs == []


def test_bad_requests_are_rejected():
    core = make(max_model_len=100)
    with pytest.raises(ValueError, match="maximum context length"):
        core.add("long", 100, 1)
    with pytest.raises(ValueError):
        core.add("zero", 10, 0)
    core.add("dup", 10, 1)
    with pytest.raises(ValueError):
        core.add("dup", 10, 1)
    with pytest.raises(ValueError):  # capacity below one full-length sequence
        make(capacity=64, max_model_len=100)


def test_max_tokens_capped_to_context():
    core = make(max_model_len=64)
    core.add("a", 60, 1000)
    tokens, finish, _ = run(core)
    assert tokens == {"a": 4} and finish == {"a": "length"}


requests_st = st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 200), st.integers(-2, 2), st.booleans()),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=requests_st,
    capacity_blocks=st.integers(32, 96),
    max_num_seqs=st.integers(1, 8),
    prefill=st.integers(16, 600),
    abort_after=st.integers(0, 20),
)
def test_property_kv_bounded_and_all_finish(reqs, capacity_blocks, max_num_seqs, prefill, abort_after):
    core = make(capacity=capacity_blocks * 16, block=16, max_num_seqs=max_num_seqs, max_model_len=512, prefill=prefill)
    for i, (prompt, max_tokens, prio, _) in enumerate(reqs):
        core.add(f"r{i}", prompt, max_tokens, prio)
    to_abort = {f"r{i}" for i, r in enumerate(reqs) if r[3]}
    tokens: dict[str, int] = {}
    finish: dict[str, str] = {}
    aborted = set()
    steps = 0
    while core.has_work:
        if steps == abort_after:
            for rid in to_abort:
                if core.abort(rid):
                    aborted.add(rid)
                else:
                    assert rid in finish  # only finished requests are unknown
        r = core.step()
        steps += 1
        assert steps < 100_000
        assert 0 <= core.total_blocks - core.free_blocks <= core.total_blocks
        assert core.num_running <= max_num_seqs
        for rid, n, reason in r.outputs:
            assert rid not in finish and rid not in aborted
            tokens[rid] = tokens.get(rid, 0) + n
            if reason:
                finish[rid] = reason
    for i, (prompt, max_tokens, _, _) in enumerate(reqs):
        rid = f"r{i}"
        if rid not in aborted:
            assert finish[rid] == "length" and tokens[rid] == min(max_tokens, 512 - prompt)
    assert core.free_blocks == core.total_blocks and core.num_running == 0 and core.num_waiting == 0
