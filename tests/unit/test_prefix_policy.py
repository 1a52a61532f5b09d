"""The prefix index (router/fleet/prefix_index.py) and prefix affinity in placement
(router/policy/placement/: the prefix affinity scorer and the picker): pure, in-process.

Properties (hypothesis): affinity never changes *whether* a job is placed,
never over-commits the ledger, and only picks a worker whose load score is
within ``prefix_load_margin`` of the least loaded one's; where it departs
from least-loaded it is for a worker holding more of the prompt.  And the
index: gaps blind a worker until its snapshot, a lost worker's entries go,
the cap holds, speculation expires (a block speculated again keeps every
speculating worker's bit until its latest expiry), retired bits never count,
and match agrees with a reference model of all that.
"""

from __future__ import annotations

from unittest import mock

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.fleet import prefix_index
from router.fleet.prefix_index import PrefixIndex
from router.policy import DispatchJob, Job, Policy, WorkerSpec
from shared.config import SchedulerConfig
from shared.protocol import Pool, TaskType

CHAIN = list(range(101, 121))  # a prompt of 20 blocks (16 tokens each)


def spec(i: int, cap: int = 4096, seqs: int = 8) -> WorkerSpec:
    return WorkerSpec(
        worker_id=f"w{i}",
        model="m",
        pool=Pool.ANY,
        capacity_tokens=cap,
        block_size=16,
        max_num_seqs=seqs,
        max_model_len=4096,
        prefix_hash="sim",
    )


def job(jid: str, prompt: int = 320, max_tokens: int = 16, hashes=CHAIN, now: float = 0.0) -> Job:
    return Job(jid, "m", "t", "normal", prompt, max_tokens, TaskType.SHORT, now, block_hashes=hashes)


def placed(p: Policy, now: float = 0.0) -> dict[str, str]:
    return {a.job_id: a.worker_id for a in p.schedule(now) if isinstance(a, DispatchJob)}


# ------------------------------------------------------------------ the index


def test_index_events_gap_snapshot_and_loss():
    ix = PrefixIndex(max_blocks=100)
    assert ix.add_worker("a", "m", "sim", 16) and ix.add_worker("b", "m", "sim", 16)
    assert ix.match("m", CHAIN, 0.0) == {}  # blind until their snapshots
    ix.snapshot("a", 0, CHAIN[:5])
    ix.snapshot("b", 0, [])
    assert ix.match("m", CHAIN, 0.0) == {"a": 5}
    assert ix.events("b", 1, CHAIN[:3], [])
    assert ix.events("a", 1, [], [CHAIN[2]])  # a middle block left: a's prefix ends before it
    assert ix.match("m", CHAIN, 0.0) == {"a": 2, "b": 3}
    assert not ix.events("a", 3, CHAIN, [])  # seq 2 missing: a is blind, its entries stop counting
    assert ix.match("m", CHAIN, 0.0) == {"b": 3} and not ix.trusted("a")
    assert ix.events("a", 4, CHAIN, [])  # stale (before its snapshot): ignored
    assert ix.match("m", CHAIN, 0.0) == {"b": 3}
    ix.snapshot("a", 5, CHAIN[:4])
    assert ix.match("m", CHAIN, 0.0) == {"a": 4, "b": 3} and ix.view()["recoveries"] == 1
    assert ix.heard_seq("a", 5) is False and ix.heard_seq("a", 6) is True  # a heartbeat saw a message we lost
    assert not ix.trusted("a")
    ix.snapshot("a", 7, CHAIN[:4])
    assert ix.events("b", 2, [], [], cleared=True)  # b's cache cleared
    assert ix.match("m", CHAIN, 0.0) == {"a": 4}
    ix.remove_worker("a")  # lost: its entries go with it
    assert ix.match("m", CHAIN, 0.0) == {} and ix.size("m") == 0


def test_a_models_last_worker_leaving_frees_its_index():
    ix = PrefixIndex()
    ix.add_worker("a", "m", "sim", 16)
    ix.snapshot("a", 0, range(20_000))  # above the size where retired entries are swept lazily
    ix.remove_worker("a")
    assert "m" not in ix.models and ix.size("m") == 0
    assert ix.add_worker("b", "m", "sim", 16) and ix.match("m", [1], 0.0) == {}  # afresh


def test_index_cap_evicts_least_recent_and_counts_stay_exact():
    ix = PrefixIndex(max_blocks=10)
    ix.add_worker("a", "m", "sim", 16)
    ix.snapshot("a", 0, range(1, 11))
    assert ix.match("m", [1, 2, 3], 0.0) == {"a": 3}  # touches 1..3
    ix.events("a", 1, range(100, 105), [])
    assert ix.size("m") == 10 and ix.view()["workers"]["a"]["blocks"] == 10
    assert ix.match("m", [1, 2, 3], 0.0) == {"a": 3}  # recently used: kept
    assert ix.match("m", [4], 0.0) == {}  # the least recent went
    assert ix.view()["models"]["m"]["evicted"] == 5
    big = PrefixIndex(max_blocks=6400)
    big.add_worker("a", "m", "sim", 16)
    big.snapshot("a", 0, range(7000))
    assert 6400 - 100 <= big.size("m") <= 6400  # evicted in batches of cap / 64
    assert big.match("m", [6999], 0.0) == {"a": 1} and big.match("m", [0], 0.0) == {}


def test_index_speculation_expires_and_blind_workers_get_none():
    ix = PrefixIndex(speculative_ttl_s=2.0)
    ix.add_worker("a", "m", "sim", 16)
    ix.add_worker("b", "m", "sim", 16)
    ix.snapshot("a", 0, [])
    ix.speculate("a", CHAIN, 10.0)
    ix.speculate("b", CHAIN, 10.0)  # b is blind: nothing
    assert ix.match("m", CHAIN, 11.0) == {"a": 20}
    assert ix.match("m", CHAIN, 12.5) == {}


def test_a_block_speculated_again_lives_until_its_last_expiry_with_every_bit_then_leaves_nothing():
    ix = PrefixIndex(speculative_ttl_s=2.0)
    for w in ("a", "b"):
        ix.add_worker(w, "m", "sim", 16)
        ix.snapshot(w, 0, [])
    ix.speculate("a", CHAIN, 10.0)
    ix.speculate("b", CHAIN[:5], 10.5)
    ix.speculate("a", CHAIN[:8], 11.0)  # its first 8 blocks again, later
    assert ix.match("m", CHAIN, 12.2) == {"a": 8, "b": 5}  # the first expired, not the second
    # b's own speculation expired at 12.5, but its 5 blocks were speculated again (by a) until 13.0
    assert ix.match("m", CHAIN, 12.7) == {"a": 8, "b": 5}
    assert ix.match("m", CHAIN, 13.0) == {}
    mi = ix.models["m"]
    assert not mi.spec and not mi.spec_queue  # every entry went with its expiry


def test_another_workers_speculation_keeps_a_block_and_an_expired_one_is_not_revived():
    ix = PrefixIndex(speculative_ttl_s=2.0)
    for w in ("a", "b", "c"):
        ix.add_worker(w, "m", "sim", 16)
        ix.snapshot(w, 0, [])
    ix.speculate("a", CHAIN, 10.0)
    assert ix.match("m", CHAIN, 11.99) == {"a": 20} and ix.match("m", CHAIN, 12.0) == {}  # its TTL, exactly
    ix.speculate("a", CHAIN, 20.0)
    ix.speculate("b", CHAIN[:10], 21.0)  # while a's is fresh: a's bit on those blocks lives on with it
    assert ix.match("m", CHAIN, 22.5) == {"a": 10, "b": 10}
    assert ix.match("m", CHAIN, 23.0) == {}
    ix.speculate("a", CHAIN, 30.0)
    ix.speculate("c", CHAIN, 32.5)  # after a's expired, with nothing in between to expire it: a's is not revived
    assert ix.match("m", CHAIN, 33.0) == {"c": 20}


def settle(ix: PrefixIndex, by: str) -> None:
    """PrefixEvents from ``by`` until the retired bits are swept (and free)."""
    mi = ix.models["m"]
    while mi.sweeping is not None or mi.retired:
        assert ix.events(by, ix.workers[by].seq + 1, [], [])


def bit_of(ix: PrefixIndex, worker: str) -> int:
    return ix.workers[worker].bit


def test_a_retired_workers_speculation_never_counts_also_when_its_bit_is_reused():
    for confirmed in (0, 20_000):  # the retired bits stripped at once, or by sweeps a slice per PrefixEvents
        ix = PrefixIndex(speculative_ttl_s=2.0)
        for w in ("a", "x", "b"):
            ix.add_worker(w, "m", "sim", 16)
            ix.snapshot(w, 0, range(1_000_000, 1_000_000 + confirmed) if w == "b" else [])
        ix.speculate("a", CHAIN, 10.0)
        ix.speculate("x", CHAIN[:8], 10.2)
        ix.speculate("b", CHAIN[:5], 10.5)  # keeps the first 5 blocks, a's and x's bits on them included
        retired = {bit_of(ix, "a"), bit_of(ix, "x")}
        ix.remove_worker("a")
        ix.remove_worker("x")
        assert ix.match("m", CHAIN, 11.0) == {"b": 5}
        settle(ix, "b")
        ix.add_worker("c", "m", "sim", 16)
        ix.snapshot("c", 0, [])
        assert bit_of(ix, "c") in retired  # reused
        assert ix.match("m", CHAIN, 11.0) == {"b": 5}
        ix.speculate("c", CHAIN[:2], 11.0)
        assert ix.match("m", CHAIN, 11.0) == {"b": 5, "c": 2}


def test_a_bit_retired_while_its_blocks_are_only_speculative_is_reused_after_the_sweep_of_them():
    ix = PrefixIndex(speculative_ttl_s=2.0)
    for w in ("a", "b"):
        ix.add_worker(w, "m", "sim", 16)
        ix.snapshot(w, 0, [])
    big = range(30_000)  # a burst's speculative blocks: more than are swept at once, none confirmed
    ix.speculate("a", big, 10.0)
    ix.speculate("b", big, 10.5)
    a_bit = bit_of(ix, "a")
    ix.remove_worker("a")
    ix.add_worker("c", "m", "sim", 16)
    ix.snapshot("c", 0, [])
    assert bit_of(ix, "c") != a_bit  # not reused before the sweep visited the speculative blocks
    assert ix.match("m", big, 11.0) == {"b": 30_000}
    c_bit = bit_of(ix, "c")
    ix.remove_worker("c")
    settle(ix, "b")
    ix.add_worker("d", "m", "sim", 16)
    ix.snapshot("d", 0, [])
    assert bit_of(ix, "d") in (a_bit, c_bit)
    assert ix.match("m", big, 11.0) == {"b": 30_000}


def test_speculation_of_many_prompts_expires_in_order_and_leaves_nothing():
    ix = PrefixIndex(speculative_ttl_s=2.0)
    for w in ("a", "b", "c"):
        ix.add_worker(w, "m", "sim", 16)
        ix.snapshot(w, 0, [])
    shared = list(range(10))  # every prompt's first 10 blocks; then 50 of its own
    prompts = [shared + list(range(1000 * (i + 1), 1000 * (i + 1) + 50)) for i in range(300)]
    for i, hs in enumerate(prompts):  # one every 1/64 s (exact in binary) over ~4.7 s: 128 live at a time
        ix.speculate("abc"[i % 3], hs, 10.0 + i / 64)
    now = 10.0 + 299 / 64  # prompts 0..171 have expired
    for i in (0, 171, 172, 299):
        # the shared blocks live on with every bit; a prompt's own, for its TTL
        assert ix.match("m", prompts[i], now) == {"a": 10, "b": 10, "c": 10, **({"abc"[i % 3]: 60} if i > 171 else {})}
    mi = ix.models["m"]
    assert len(mi.spec_queue) == 128 and len(mi.spec) == 10 + 128 * 50
    assert ix.match("m", shared, now + 2.0) == {}
    assert not mi.spec and not mi.spec_queue


def test_index_refuses_other_schemes_and_reuses_bits():
    ix = PrefixIndex()
    assert ix.add_worker("a", "m", "sha256", 128)
    assert not ix.add_worker("b", "m", "sha256", 16)  # another block size: cache-blind
    assert not ix.add_worker("c", "m", "xxhash", 128)
    for i in range(100):  # re-registrations retire bits; sweeps let them be reused
        ix.add_worker("a", "m", "sha256", 128)
        ix.snapshot("a", 0, [i, i + 1])
    assert ix.match("m", [99, 100], 0.0) == {"a": 2} and ix.size("m") == 2
    assert ix.models["m"].next_bit < 40


class RefIndex:
    """The index's meaning, spelt out: a worker holds a block if it said so (since its last
    snapshot) or speculated it (since then too) and the block has been speculated, by any
    worker, within each TTL since (a block whose latest speculation expired starts afresh)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.trusted: dict[str, bool] = {}
        self.epoch: dict[str, int] = {}  # a worker's bit changes: its older speculation never counts
        self.confirmed: dict[str, set[int]] = {}
        self.spec: dict[int, tuple[set[tuple[str, int]], float]] = {}  # hash -> ({(worker, epoch)}, expiry)

    def reset(self, w: str, trusted: bool, confirmed: set[int]) -> None:
        self.trusted[w], self.confirmed[w] = trusted, confirmed
        self.epoch[w] = self.epoch.get(w, 0) + 1

    def speculate(self, w: str, hashes: list[int], now: float) -> None:
        if self.trusted[w]:
            for h in hashes:
                who, exp = self.spec.get(h, (set(), now))
                self.spec[h] = ((who if exp > now else set()) | {(w, self.epoch[w])}, now + self.ttl)

    def match(self, hashes: list[int], now: float) -> dict[str, int]:
        got = {}
        for w in (w for w, t in self.trusted.items() if t):
            n = 0
            for h in hashes:
                who, exp = self.spec.get(h, (set(), now))
                if h not in self.confirmed[w] and not (exp > now and (w, self.epoch[w]) in who):
                    break
                n += 1
            if n:
                got[w] = n
        return got


WORKERS = ("a", "b", "c")
POOL = list(range(1, 13))  # block hashes; a prompt is a slice of them
_slice = st.tuples(st.integers(0, 8), st.integers(1, 6)).map(lambda t: POOL[t[0] : t[0] + t[1]])
_speculate = st.tuples(st.just("speculate"), st.sampled_from(WORKERS), _slice)
_op = st.one_of(
    _speculate,
    _speculate,
    st.tuples(st.just("snapshot"), st.sampled_from(WORKERS), st.sets(st.sampled_from(POOL), max_size=4)),
    st.tuples(st.just("events"), st.sampled_from(WORKERS), _slice, st.sets(st.sampled_from(POOL), max_size=3)),
    st.tuples(st.just("blind"), st.sampled_from(WORKERS)),
    st.tuples(st.just("re-register"), st.sampled_from(WORKERS)),
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.tuples(_op, st.sampled_from([0.0, 0.25, 1.0, 1.5, 2.0, 2.5])), min_size=5, max_size=40),
    lazy=st.booleans(),
)
def test_match_agrees_with_the_reference_under_speculation_snapshots_and_retired_bits(ops, lazy):
    # lazy: every retired bit is swept a few entries per PrefixEvents, so bits are retired mid-sweep
    with (
        mock.patch.object(prefix_index, "_EAGER_SWEEP_MAX", 0 if lazy else 10_000),
        mock.patch.object(prefix_index, "_SWEEP_STEP", 3 if lazy else 1024),
    ):
        ix, ref = PrefixIndex(speculative_ttl_s=2.0), RefIndex(2.0)
        for w in WORKERS:
            ix.add_worker(w, "m", "sim", 16)
            ix.snapshot(w, 0, [])
            ref.reset(w, True, set())
        now = 10.0
        for op, dt in ops:
            now += dt
            kind, w = op[0], op[1]
            if kind == "speculate":
                ix.speculate(w, op[2], now)
                ref.speculate(w, op[2], now)
            elif kind == "snapshot":
                ix.snapshot(w, ix.workers[w].seq + 1, op[2])
                ref.reset(w, True, set(op[2]))
            elif kind == "events" and ref.trusted[w]:
                assert ix.events(w, ix.workers[w].seq + 1, op[2], sorted(op[3]))
                ref.confirmed[w] = (ref.confirmed[w] - op[3]) | set(op[2])
            elif kind == "blind" and ref.trusted[w]:
                assert ix.heard_seq(w, ix.workers[w].seq + 1)
                ref.reset(w, False, set())
            elif kind == "re-register":
                ix.add_worker(w, "m", "sim", 16)
                ref.reset(w, False, set())
            for i in range(0, len(POOL), 2):  # prompts starting anywhere
                assert ix.match("m", POOL[i:], now) == ref.match(POOL[i:], now)


# ------------------------------------------------------------------ placement


def test_affinity_follows_cache_then_spreads_when_the_worker_fills():
    p = Policy(SchedulerConfig())
    for i in range(2):
        p.add_worker(spec(i, seqs=4), 0.0)
        p.prefix.snapshot(f"w{i}", 0, [])
    p.prefix.snapshot("w1", 1, CHAIN)  # w1 holds the whole prompt
    for k in range(8):
        assert p.submit(job(f"j{k}"), 0.0) is None
    where = placed(p)
    # the first goes to the cache (not the lowest id, as least-loaded would); w1 fills
    # only up to the margin ahead of w0, then the hot prefix spreads to w0
    assert where["j0"] == "w1"
    assert sorted(where.values()).count("w1") == 4 and sorted(where.values()).count("w0") == 4
    assert len(p.workers["w1"].running) <= p.workers["w1"].slots


def test_speculation_keeps_a_burst_together_before_the_engine_confirms():
    p = Policy(SchedulerConfig())
    for i in range(2):
        p.add_worker(spec(i, seqs=16), 0.0)
        p.prefix.snapshot(f"w{i}", 0, [])
    p.submit(job("first"), 0.0)
    first = placed(p)["first"]
    p.submit(job("second"), 0.1)
    assert placed(p, 0.1)["second"] == first  # speculative entry: follows, though the other is idle
    p2 = Policy(msgspec.structs.replace(SchedulerConfig(), prefix_affinity=False))
    for i in range(2):
        p2.add_worker(spec(i, seqs=16), 0.0)
    p2.submit(job("first"), 0.0)
    placed(p2)
    p2.submit(job("second"), 0.1)
    assert placed(p2, 0.1)["second"] != first  # least-loaded alone: the idle one


def _score(p: Policy, wid: str, cost: int) -> float:
    w = p.workers[wid]
    return (w.budget - (w.reserved + cost)) / w.budget + (w.slots - len(w.running) - 1) / w.slots


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    loads=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3000)), min_size=2, max_size=4),
    cached=st.lists(st.integers(0, 20), min_size=4, max_size=4),
    prompt=st.integers(16, 320),
    max_tokens=st.integers(1, 1500),
    margin=st.floats(0.0, 1.0),
    weight=st.floats(0.0, 4.0),
)
def test_affinity_is_bounded_by_load_and_never_overcommits(loads, cached, prompt, max_tokens, margin, weight):
    hashes = CHAIN[: prompt // 16]
    results = []
    for affinity in (True, False):
        cfg = msgspec.structs.replace(
            SchedulerConfig(),
            prefix_affinity=affinity,
            prefix_load_margin=margin,
            prefix_affinity_weight=weight,
            priority_headroom=0.0,
        )
        p = Policy(cfg)
        for i, (running, reserved) in enumerate(loads):
            p.add_worker(spec(i, cap=4096, seqs=8), 0.0)
            p.prefix.snapshot(f"w{i}", 0, CHAIN[: cached[i]])
            w = p.workers[f"w{i}"]
            for r in range(running):  # load it as dispatches would
                w.running[f"x{i}-{r}"] = 0
            w.reserved = min(reserved, w.budget)
        p.submit(job("j", prompt, max_tokens, hashes), 0.0)
        results.append((p, placed(p).get("j")))
    (pa, got), (pb, base) = results
    assert (got is None) == (base is None)  # affinity never makes a job (un)placeable
    if got is None:
        return
    wa = pa.workers[got]
    assert wa.reserved <= wa.budget and len(wa.running) <= wa.slots  # the ledger holds
    cost = wa.running["j"]
    before = {wid: _score(pb, wid, cost) for wid in pb.workers}  # loads as they were (pb without j on base)
    before[base] = (pb.workers[base].budget - pb.workers[base].reserved) / pb.workers[base].budget + (
        pb.workers[base].slots - len(pb.workers[base].running)
    ) / pb.workers[base].slots
    assert before[got] >= before[base] - margin - 1e-9  # within the margin of the least loaded
    if got != base:  # it moved for more of the prompt
        assert min(cached[int(got[1:])], len(hashes)) > min(cached[int(base[1:])], len(hashes))
