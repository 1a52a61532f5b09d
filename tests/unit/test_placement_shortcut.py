"""Placement's shortcut for a sample held back by class headroom
(router/policy/placement.py ``ScoredPlacement.all_capped``).

Checked: under any interleaving of submits of every class, finishes, health
changes, other routers' shares, losses and registrations, a policy with the
shortcut decides exactly as one without it (same actions, same workers, same
sampler draws), in fleets scored whole and sampled, with one slot count or
several; and the shortcut does answer for a head of a capped class behind a
full fleet, and steps aside where a worker drawn is below the cap.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.policy import PLACE_SCAN_ALL, DispatchJob, Job, Policy, WorkerSpec
from shared.config import SchedulerConfig
from shared.protocol import Pool, TaskType

CLASSES = ("critical", "normal", "batch")


def spec(i: int, pool: Pool, seqs: int, block: int) -> WorkerSpec:
    return WorkerSpec(f"w{i:03d}", "m", pool, 4096, block, seqs, 2048)


op = st.one_of(
    st.tuples(
        st.just("submit"),
        st.sampled_from(CLASSES),
        st.integers(1, 1500),
        st.integers(0, 600),
        st.integers(1, 3),
        st.integers(0, 3),
    ),
    st.tuples(
        st.just("submit"),
        st.sampled_from(CLASSES),
        st.integers(1, 100),
        st.integers(1, 64),
        st.just(1),
        st.integers(0, 3),
    ),
    st.tuples(st.just("finish"), st.integers(0, 10_000)),
    st.tuples(st.just("finish"), st.integers(0, 10_000)),
    st.tuples(st.just("health"), st.integers(0, 63), st.booleans()),
    st.tuples(st.just("others"), st.integers(0, 63), st.integers(0, 3000), st.integers(0, 3)),
    st.tuples(st.just("remove"), st.integers(0, 63)),
    st.tuples(st.just("add"), st.integers(0, 63)),
    st.tuples(st.just("wait"), st.floats(0.0, 40.0)),
)


class Pair:
    """Two policies fed the same events, one with the shortcut and one without."""

    def __init__(
        self, n: int, pools: list[Pool], mixed_slots: bool, blocks: tuple[int, ...], borrow: bool, headroom: float
    ) -> None:
        cfg = SchedulerConfig(
            generation_deadline_s=0.0, priority_headroom=headroom, borrow_idle_long=borrow, short_threshold_tokens=512
        )
        self.both = [Policy(cfg), Policy(cfg)]
        self.both[1].placement.shortcut = False
        self.n, self.pools, self.mixed_slots, self.blocks = n, pools, mixed_slots, blocks
        self.now, self.seq, self.running = 0.0, 0, []
        self.capped = 0  # times the shortcut answered
        answer = self.both[0].placement.all_capped

        def counted(*a):  # type: ignore[no-untyped-def]
            r = answer(*a)
            self.capped += r
            return r

        self.both[0].placement.all_capped = counted  # type: ignore[method-assign]
        for i in range(n):
            self.add(i)
        for _ in range(3 * n):  # start from a busy fleet with a queue behind it
            self.apply(("submit", "critical", 64, 64, 1, 0))
            self.apply(("submit", "batch", 64, 64, 1, 1))

    def add(self, i: int) -> None:
        seqs = 4 + (i % 3 if self.mixed_slots else 0)
        lost = [
            p.add_worker(spec(i, self.pools[i], seqs, self.blocks[i % len(self.blocks)]), self.now) for p in self.both
        ]
        assert lost[0] == lost[1]
        self.running = [j for j in self.running if j not in set(lost[0])]

    def apply(self, o: tuple) -> None:  # type: ignore[type-arg]
        both, n = self.both, self.n
        self.now += 0.01
        now = self.now
        if o[0] == "submit":
            self.seq += 1
            job = Job(f"j{self.seq}", "m", f"t{o[5]}", o[1], o[2], o[3], TaskType.AUTO, now, n=o[4])
            got = [p.submit(job, now) for p in both]
            assert got[0] == got[1]
        elif o[0] == "finish" and self.running:
            job_id = self.running.pop(o[1] % len(self.running))
            assert both[0].finish(job_id, now) == both[1].finish(job_id, now)
        elif o[0] == "health":
            for p in both:
                p.update_worker(f"w{o[1] % n:03d}", now, healthy=o[2])
        elif o[0] == "others":
            for p in both:
                p.update_worker(f"w{o[1] % n:03d}", now, other_tokens=o[2], other_seqs=o[3])
        elif o[0] == "remove":
            lost = [p.remove_worker(f"w{o[1] % n:03d}", now) for p in both]
            assert lost[0] == lost[1]
            self.running = [j for j in self.running if j not in set(lost[0])]
        elif o[0] == "add":
            self.add(o[1] % n)
        elif o[0] == "wait":
            self.now += o[1]
        actions = [p.schedule(self.now) for p in both]
        assert actions[0] == actions[1]
        self.running += [a.job_id for a in actions[0] if isinstance(a, DispatchJob)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([3, PLACE_SCAN_ALL, PLACE_SCAN_ALL + 4, 40]),
    pools=st.lists(st.sampled_from([Pool.ANY, Pool.ANY, Pool.SHORT, Pool.LONG]), min_size=64, max_size=64),
    mixed_slots=st.booleans(),
    blocks=st.sampled_from([(16,), (16, 32), (1, 128)]),
    borrow=st.booleans(),
    headroom=st.sampled_from([0.2, 0.5]),
    ops=st.lists(op, max_size=150),
)
def test_the_shortcut_decides_exactly_as_placement(n, pools, mixed_slots, blocks, borrow, headroom, ops):
    pair = Pair(n, pools, mixed_slots, blocks, borrow, headroom)
    for o in ops:
        pair.apply(o)
    assert pair.both[0].counters == pair.both[1].counters


def test_the_shortcut_answers_often_and_decides_alike_in_a_long_run():
    """Seeded: a fleet scored whole and two sampled ones, 3,000 events each."""
    import random

    for n, slots in ((12, False), (40, False), (40, True)):
        rng = random.Random(n)
        pools = [rng.choice([Pool.ANY, Pool.ANY, Pool.SHORT, Pool.LONG]) for _ in range(64)]
        pair = Pair(n, pools, slots, (16, 32), True, 0.2)
        for _ in range(3000):
            k = rng.random()
            if k < 0.45:
                o: tuple = (
                    "submit",
                    rng.choice(CLASSES),
                    rng.randint(1, 700),
                    rng.randint(0, 300),
                    1,  # type: ignore[type-arg]
                    rng.randrange(4),
                )
            elif k < 0.9:
                o = ("finish", rng.randrange(10_000))
            elif k < 0.95:
                o = ("others", rng.randrange(64), rng.randrange(2000), rng.randrange(3))
            else:
                o = ("health", rng.randrange(64), rng.random() < 0.8)
            pair.apply(o)
        assert pair.both[0].counters == pair.both[1].counters
        if n > PLACE_SCAN_ALL:  # (a fleet scored whole draws no sample)
            assert pair.capped > 100, (n, slots, pair.capped)


def test_a_capped_head_behind_a_full_fleet_fails_its_sample_without_scoring():
    cfg = SchedulerConfig(generation_deadline_s=0.0, priority_headroom=0.5)
    p = Policy(cfg)
    n = PLACE_SCAN_ALL * 4  # a sampled fleet
    for i in range(n):
        p.add_worker(WorkerSpec(f"w{i:03d}", "m", Pool.ANY, 65536, 16, 8, 4096), 0.0)
    for i in range(n):  # six of eight slots taken everywhere: batch's cap is 4, critical's 8
        p.update_worker(f"w{i:03d}", 0.0, other_seqs=6)
    p.submit(Job("c", "m", "t", "critical", 64, 64, TaskType.AUTO, 0.0), 0.0)  # (critical is active)
    assert [a.job_id for a in p.schedule(0.0)] == ["c"]
    m = p.models["m"]
    p.submit(Job("b", "m", "t", "batch", 64, 64, TaskType.AUTO, 0.1), 0.1)
    e = p.entries["b"]
    limit = p.placement.limit(m, e.rank, 0.1)
    assert limit < 1.0
    drawn, complete = p.placement.candidates(m, e.size, False)
    assert not complete and p.placement.all_capped(e, limit, drawn)
    assert p.schedule(0.1) == []
    # one worker below the cap: a sample holding it is not capped, and placement finds it
    p.update_worker("w007", 0.2, other_seqs=3)
    assert not p.placement.all_capped(e, limit, [m.workers["w007"], *drawn])
    placed = []
    for _ in range(200):  # (a sample of four of 64 workers: a few passes)
        placed += [(a.job_id, a.worker_id) for a in p.schedule(0.2)]
    assert placed == [("b", "w007")]
    # too little KV left on a worker drawn: the shortcut steps aside (scoring would draw again)
    p.submit(Job("b2", "m", "t", "batch", 64, 64, TaskType.AUTO, 0.3), 0.3)
    w = m.workers["w001"]
    p.update_worker("w001", 0.3, other_seqs=6, other_tokens=w.budget - 100)
    assert not p.placement.all_capped(p.entries["b2"], limit, [w])
