"""The simulated engine's prefix cache (engine_worker/sim_model.py, ``prefix_caching``)."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_worker.sim_model import SimCore
from shared.config import SimEngineConfig

CFG = msgspec.structs.replace(SimEngineConfig(), kv_capacity_tokens=64 * 16, block_size=16, prefix_caching=True)


def run_all(core: SimCore, events: list):
    cached, steps = {}, []
    while core.has_work:
        r = core.step()
        events.append((r.stored, r.removed))
        cached.update(r.cached)
        steps.append(r)
    return cached, steps


def test_shared_prefix_skips_prefill_and_reports_cached_tokens():
    core = SimCore(CFG, max_num_seqs=4, max_model_len=1024)
    events = []
    prefix = list(range(1, 9))  # 8 blocks = 128 tokens
    core.add("a", 136, 2, block_hashes=prefix)
    _, first = run_all(core, events)
    assert sorted(h for s, _ in events for h in s) == prefix
    core.add("b", 200, 2, block_hashes=prefix + [50, 51, 52])  # shares the 8 blocks
    cached, second = run_all(core, events)
    assert cached == {"b": 128}
    assert second[0].duration_s < first[0].duration_s + CFG.prefill_token_us * 64 / 1e6  # 128 tokens not redone
    core.add("c", 128, 1, block_hashes=prefix)  # fully cached: its last block is computed again (vLLM)
    cached, _ = run_all(core, events)
    assert cached == {"c": 112}
    assert core.free_blocks == core.total_blocks  # cached but free


def test_eviction_reports_removed_blocks_lru():
    core = SimCore(CFG, max_num_seqs=4, max_model_len=1024)
    events = []
    core.add("a", 32 * 16, 1, block_hashes=list(range(100, 132)))
    run_all(core, events)
    core.add("b", 40 * 16, 1, block_hashes=list(range(200, 240)))  # needs 40 of 64 blocks: 8 of a's go
    run_all(core, events)
    removed = [h for _, r in events for h in r]
    assert removed == list(range(131, 123, -1))  # a's tail first (vLLM frees a request's blocks in reverse)
    assert set(core._cache) == set(range(100, 124)) | set(range(200, 240))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(1, 20), st.booleans()), min_size=1, max_size=30
    )
)
def test_cache_events_replay_to_its_contents_and_blocks_balance(reqs):
    core = SimCore(CFG, max_num_seqs=3, max_model_len=1000)
    events = []
    for i, (family, prompt, max_tokens, abort) in enumerate(reqs):
        hashes = [family * 1000 + b for b in range(prompt // 16)]
        core.add(f"r{i}", prompt, max_tokens, block_hashes=hashes)
        r = core.step()
        events.append((r.stored, r.removed))
        if abort:
            core.abort(f"r{i}")
    run_all(core, events)
    held = set()
    for stored, removed in events:  # removals of a step come before its stores
        held -= set(removed)
        held |= set(stored)
    assert held == set(core._cache)
    assert core.free_blocks == core.total_blocks and len(core._evictable) == len(core._cache)
