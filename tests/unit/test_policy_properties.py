"""Property tests (hypothesis) of the scheduling policy's invariants:

* the ledger never goes negative nor above a worker's budget
  (capacity x (1 - margin) x overcommit <= capacity x (1 + overcommit)), and
  never runs more than max_num_seqs on a worker;
* every admitted job is released exactly once, under any interleaving of
  finish / cancel / queue deadline / generation deadline / worker loss /
  re-registration;
* FIFO within (class, tenant, size) -- and globally in ``policy="fifo"``;
* no class waits past the aging bound behind a stream of higher-class work;
* a flooding tenant gets no more than its weighted share of its class;
* admission by predicted wait: an admitted job's predicted wait is within
  its class's bound, a refused one's is not, and a tenant within its
  weighted share of the bound is never refused for its wait (top class);
* the admission totals (queued tokens per class and tenant, their weights)
  always equal what is queued.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import msgspec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from router.policy import AbortJob, DispatchJob, Job, Policy, RejectJob, WorkerSpec
from router.policy.records import Entry
from shared.config import ClassConfig, SchedulerConfig
from shared.protocol import Pool, TaskType

CLASSES = ["critical", "high", "normal", "low", "batch"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def spec(i: int, pool: Pool, cap: int, seqs: int, block: int = 16, max_len: int = 4096) -> WorkerSpec:
    return WorkerSpec(
        worker_id=f"w{i}",
        model="m",
        pool=pool,
        capacity_tokens=cap,
        block_size=block,
        max_num_seqs=seqs,
        max_model_len=max_len,
    )


# ------------------------------------------------------------------ ledger / exactly once

submit_op = st.tuples(
    st.just("submit"),
    st.integers(0, 4),
    st.integers(0, 2),
    st.integers(1, 3000),
    st.integers(1, 1200),
    st.sampled_from(list(TaskType)),
)
op = st.one_of(
    submit_op,
    submit_op,
    submit_op,
    submit_op,
    submit_op,
    submit_op,
    submit_op,
    st.tuples(st.just("schedule")),
    st.tuples(st.just("finish"), st.integers(0, 10_000)),
    st.tuples(st.just("advance"), st.floats(0.0, 20.0)),
    st.tuples(st.just("remove"), st.integers(0, 2)),
    st.tuples(st.just("add"), st.integers(0, 2)),
    st.tuples(st.just("health"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("correct"), st.integers(0, 10_000), st.floats(0.1, 1.0)),
)

worker_strategy = st.tuples(
    st.sampled_from([Pool.ANY, Pool.SHORT, Pool.LONG]),
    st.integers(2048, 16384),
    st.integers(1, 8),
    st.sampled_from([1, 16, 128]),
)


@settings(SETTINGS, max_examples=200)
@given(
    policy=st.sampled_from(["weir", "fifo"]),
    overcommit=st.floats(1.0, 2.0),
    margin=st.floats(0.0, 0.3),
    backfill=st.booleans(),
    headroom=st.floats(0.0, 0.5),
    workers=st.lists(worker_strategy, min_size=3, max_size=3),
    ops=st.lists(op, min_size=30, max_size=200),
)
def test_ledger_bounds_and_exactly_once_release(policy, overcommit, margin, backfill, headroom, workers, ops):
    classes = [ClassConfig(name=n, max_queue=20, queue_deadline_s=15.0 + 5 * i) for i, n in enumerate(CLASSES)]
    cfg = msgspec.structs.replace(
        SchedulerConfig(),
        policy=policy,
        classes=classes,
        overcommit=overcommit,
        kv_safety_margin=margin,
        backfill=backfill,
        priority_headroom=headroom,
        aging_bound_s=20.0,
        generation_deadline_s=40.0,
        max_queue_per_tenant=30,
        short_threshold_tokens=1024,
    )
    p = Policy(cfg)
    specs = [spec(i, *w) for i, w in enumerate(workers)]
    registered = set()
    for s in specs[:2]:
        p.add_worker(s, 0.0)
        registered.add(s.worker_id)
    now = 0.0
    admitted: list[str] = []
    released: Counter = Counter()
    running_on: dict[str, str] = {}
    order = defaultdict(list)  # FIFO check: (rank, tenant, size) -> dispatched submission indexes
    global_order: list[int] = []
    seqno: dict[str, int] = {}

    def check():
        for w in p.workers.values():
            assert w.reserved == sum(w.running.values())
            assert 0 <= w.reserved <= w.budget
            assert w.budget <= w.spec.capacity_tokens * (1 + cfg.overcommit)
            assert len(w.running) <= w.spec.max_num_seqs
        assert all(n == 1 for n in released.values())
        check_totals(p)

    def take(actions):
        for a in actions:
            assert a.job_id in seqno and released[a.job_id] == 0
            if isinstance(a, DispatchJob):
                assert a.worker_id in registered
                assert a.job_id not in running_on
                running_on[a.job_id] = a.worker_id
                e = p.entries[a.job_id]
                order[(e.rank, e.job.tenant, e.size)].append(seqno[a.job_id])
                global_order.append(seqno[a.job_id])
            else:
                assert isinstance(a, (RejectJob, AbortJob))
                if isinstance(a, AbortJob):
                    assert running_on.pop(a.job_id) == a.worker_id
                else:
                    assert a.job_id not in running_on
                released[a.job_id] += 1

    for o in ops:
        kind = o[0]
        if kind == "submit":
            _, c, t, prompt, max_tokens, task = o
            jid = f"j{len(seqno)}"
            seqno[jid] = len(seqno)
            err = p.submit(Job(jid, "m", f"t{t}", CLASSES[c], prompt, max_tokens, task, now), now)
            if err is None:
                admitted.append(jid)
            else:
                assert err.status in (400, 429, 503)
                if err.status in (429, 503):
                    assert err.retry_after and err.retry_after > 0
        elif kind == "schedule":
            take(p.schedule(now))
        elif kind == "finish" and admitted:
            jid = admitted[o[1] % len(admitted)]
            if p.finish(jid, now):
                released[jid] += 1
                running_on.pop(jid, None)
            assert p.finish(jid, now) is False
        elif kind == "advance":
            now += o[1]
        elif kind == "remove":
            wid = f"w{o[1]}"
            for jid in p.remove_worker(wid, now):
                assert running_on.pop(jid) == wid
                released[jid] += 1
            registered.discard(wid)
        elif kind == "add":
            s = specs[o[1]]
            for jid in p.add_worker(s, now):
                assert running_on.pop(jid) == s.worker_id
                released[jid] += 1
            registered.add(s.worker_id)
        elif kind == "health":
            p.update_worker(f"w{o[1]}", now, healthy=o[2])
        elif kind == "correct" and admitted:
            jid = admitted[o[1] % len(admitted)]
            e = p.entries.get(jid)
            if e is not None:  # downward only: upward corrections may exceed the budget (documented)
                p.correct_prompt_tokens(jid, max(1, int(e.job.prompt_tokens * o[2])))
        check()
        if kind != "submit":  # as the router does after every event; submits may pile up first
            take(p.schedule(now))
            check()

    # FIFO: within (class, tenant, size) always; in fifo mode globally
    for seq in order.values():
        assert seq == sorted(seq)
    if policy == "fifo":
        assert global_order == sorted(global_order)

    # the end: every admitted job ends exactly once, and the ledger is empty
    take(p.schedule(now))
    for jid in admitted:
        if p.finish(jid, now):
            released[jid] += 1
    assert sorted(released) == sorted(admitted)
    assert all(n == 1 for n in released.values())
    assert all(w.reserved == 0 and not w.running for w in p.workers.values())
    assert not p.entries and not p.tenant_count
    for m in p.models.values():
        assert all(n == 0 for n in m.queues.class_count)
        assert all(q.count == 0 and q.tokens == 0 for q in m.queues.by_key.values())
    assert p.next_wakeup(now) is None


def check_start_floor(p: Policy) -> None:
    """No queue with work starts before ``start_floor`` (ClassOrder.pick skips
    the aging check while now is less than the aging delay past it)."""
    if p.cfg.policy == "fifo":
        return  # (one queue, never due)
    for m in p.models.values():
        mq = m.queues
        for (rank, size), q in mq.by_key.items():
            if q.count:
                assert mq.start_floor <= max(q.last_dispatch, mq.oldest(rank, size).job.arrival)


def check_totals(p: Policy) -> None:
    """The O(1) admission totals equal a recount of the queued entries."""
    check_start_floor(p)
    queued = [e for e in p.entries.values() if e.state == 0]
    for name, m in p.models.items():
        mine = [e for e in queued if e.job.model == name]
        assert m.totals.queued == len(mine) == sum(m.queues.class_count)
        for r in range(p.n_classes):
            of = [e for e in mine if e.rank == r]
            assert m.totals.tokens[r] == sum(e.tokens for e in of)
            assert m.totals.decode[r] == sum(max(0, e.job.max_tokens) for e in of)
            assert set(m.totals.tenants[r]) == {e.job.tenant for e in of}
            for t, (tok, n, _w) in m.totals.tenants[r].items():
                assert tok == sum(e.tokens for e in of if e.job.tenant == t)
                assert n == sum(1 for e in of if e.job.tenant == t)
            assert abs(m.totals.wsum[r] - sum(w for _, _, w in m.totals.tenants[r].values())) < 1e-6


# ------------------------------------------------------------------ admission by predicted wait

WAIT_CODES = ("queue_wait_exceeded", "tenant_share_exceeded")


@settings(SETTINGS, max_examples=150)
@given(
    bounds=st.tuples(st.floats(0.5, 20.0), st.floats(0.5, 20.0)),
    weights=st.lists(st.floats(0.25, 4.0), min_size=3, max_size=3),
    seqs=st.integers(1, 16),
    step=st.one_of(st.none(), st.floats(0.001, 0.5)),
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("submit"), st.integers(0, 1), st.integers(0, 2), st.integers(1, 2000), st.integers(0, 500)
            ),
            st.tuples(
                st.just("submit"), st.integers(0, 1), st.integers(0, 2), st.integers(1, 2000), st.integers(0, 500)
            ),
            st.tuples(st.just("finish"), st.integers(0, 10_000)),
            st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
            st.tuples(st.just("schedule")),
        ),
        min_size=20,
        max_size=250,
    ),
)
def test_admission_by_predicted_wait(bounds, weights, seqs, step, ops):
    classes = [
        ClassConfig(name="high", queue_deadline_s=bounds[0]),
        ClassConfig(name="normal", max_predicted_wait_s=bounds[1], queue_deadline_s=1e9),
    ]
    p = Policy(msgspec.structs.replace(SchedulerConfig(), classes=classes, aging_bound_s=1e9))
    p.add_worker(
        WorkerSpec(
            worker_id="w0",
            model="m",
            pool=Pool.ANY,
            capacity_tokens=1 << 16,
            block_size=16,
            max_num_seqs=seqs,
            max_model_len=4096,
            step_time_s=step,
        ),
        0.0,
    )
    m = p.models["m"]
    now = 0.0
    live: list[str] = []
    n = 0
    for o in ops:
        if o[0] == "submit":
            _, c, t, prompt, max_tokens = o
            n += 1
            job = Job(f"j{n}", "m", f"t{t}", classes[c].name, prompt, max_tokens, TaskType.AUTO, now, weights[t])
            probe = Entry(job, c, 0, 0)
            ahead, mine, w_others = p.waits.ahead(m, probe)
            rate = p.waits.drain_rate(m, c, probe.tokens, max_tokens, now)
            if c > 0:
                rate = max(0.05 * rate, rate - sum(f.rate(now) for f in m.totals.inflow[:c]))
            share = job.weight / (job.weight + w_others)
            err = p.submit(job, now)
            event(err.code if err is not None else "admitted")
            bound = bounds[c]
            if err is None:
                live.append(job.job_id)
                assert p.entries[job.job_id].predicted <= bound + 1e-9
                assert abs(p.entries[job.job_id].predicted - ahead / rate) < 1e-6 * (1 + ahead / rate)
            else:
                assert err.status == 429 and err.code in WAIT_CODES
                assert ahead / rate > bound
                assert err.retry_after >= bound / 2 - 0.1  # come back once the line is half a bound away
                if err.code == "tenant_share_exceeded":
                    assert w_others > 0 and mine > share * bound * rate
            # fairness: in the top class, a tenant within its weighted share of the bound fits
            if c == 0 and mine <= share * bound * rate * (1 - 1e-9):
                assert err is None
        elif o[0] == "finish" and live:
            p.finish(live.pop(o[1] % len(live)), now)
        elif o[0] == "advance":
            now += o[1]
        else:
            p.schedule(now)
        check_totals(p)


# ------------------------------------------------------------------ aging bound


@SETTINGS
@given(
    bound=st.floats(8.0, 60.0),
    seqs=st.integers(1, 4),
    n_workers=st.integers(1, 2),
    lower=st.lists(st.tuples(st.integers(1, 4), st.floats(0.0, 30.0), st.integers(16, 1500)), min_size=1, max_size=12),
    job_frac=st.floats(0.05, 1.0),
    crit_tokens=st.integers(16, 2000),
)
def test_no_class_waits_past_the_aging_bound(bound, seqs, n_workers, lower, job_frac, crit_tokens):
    """Critical work arrives faster than the fleet serves it, forever; jobs of
    lower classes arrive now and then.  Every queue that holds work must make
    progress within the bound.  Jobs run for at most bound/(2 x classes), the
    condition under which the policy promises the bound."""
    dt = 0.25
    duration = max(dt, job_frac * bound / (2 * len(CLASSES)) - dt)
    cfg = msgspec.structs.replace(
        SchedulerConfig(),
        aging_bound_s=bound,
        classes=[ClassConfig(name=n, max_queue=100_000, queue_deadline_s=1e9) for n in CLASSES],
        max_queue_per_tenant=100_000,
        generation_deadline_s=1e9,
        short_threshold_tokens=1024,
    )
    p = Policy(cfg)
    for i in range(n_workers):
        p.add_worker(spec(i, Pool.ANY, cap=4096, seqs=seqs), 0.0)
    arrivals = sorted((t, c, tok) for c, t, tok in lower)
    ends: dict[str, float] = {}
    last_progress: dict[tuple[int, int], float] = {}
    n = 0
    now = 0.0
    horizon = 40.0 + 3 * bound
    while now < horizon:
        # keep the critical queue over-full: a stream of higher work
        for _ in range(n_workers * seqs + 1):
            n += 1
            p.submit(
                Job(
                    f"c{n}",
                    "m",
                    "crit",
                    "critical",
                    crit_tokens // 2,
                    crit_tokens - crit_tokens // 2,
                    TaskType.AUTO,
                    now,
                ),
                now,
            )
        while arrivals and arrivals[0][0] <= now:
            _, c, tok = arrivals.pop(0)
            n += 1
            p.submit(Job(f"l{n}", "m", f"t{c}", CLASSES[c], tok // 2, tok - tok // 2, TaskType.AUTO, now), now)
        for jid, end in list(ends.items()):
            if end <= now:
                p.finish(jid, now)
                del ends[jid]
        for a in p.schedule(now):
            assert isinstance(a, DispatchJob)
            ends[a.job_id] = now + duration
            e = p.entries[a.job_id]
            last_progress[(e.rank, e.size)] = now
        check_start_floor(p)
        # every queue of a lower class that holds work has progressed within the bound
        for m in p.models.values():
            for (rank, size), q in m.queues.by_key.items():
                if rank == 0 or q.count == 0:
                    continue
                oldest = m.queues.oldest(rank, size).job.arrival
                since = max(last_progress.get((rank, size), -1e18), oldest)
                assert now - since <= bound + dt, (rank, size, now, since)
        now += dt


# ------------------------------------------------------------------ tenant fairness


@SETTINGS
@given(
    w_flood=st.floats(0.25, 4.0),
    w_other=st.floats(0.25, 4.0),
    flood_sizes=st.lists(st.integers(16, 1000), min_size=1, max_size=8),
    other_sizes=st.lists(st.integers(16, 1000), min_size=1, max_size=8),
    quantum=st.integers(64, 2048),
)
def test_a_flooding_tenant_gets_at_most_its_weighted_share(w_flood, w_other, flood_sizes, other_sizes, quantum):
    cfg = msgspec.structs.replace(
        SchedulerConfig(),
        short_threshold_tokens=quantum,
        max_queue_per_tenant=100_000,
        classes=[ClassConfig(name="normal", max_queue=100_000, queue_deadline_s=1e9)],
    )
    p = Policy(cfg)
    p.add_worker(spec(0, Pool.ANY, cap=1 << 20, seqs=1, max_len=1 << 16), 0.0)
    n = 0
    # the flooder queues 10x as many jobs; both stay backlogged throughout
    for i in range(1000):
        n += 1
        p.submit(
            Job(f"f{n}", "m", "flood", "normal", flood_sizes[i % len(flood_sizes)], 0, TaskType.SHORT, 0.0, w_flood),
            0.0,
        )
        if i % 10 == 0:
            n += 1
            p.submit(
                Job(
                    f"o{n}", "m", "other", "normal", other_sizes[i % len(other_sizes)], 0, TaskType.SHORT, 0.0, w_other
                ),
                0.0,
            )
    served = Counter()
    now = 0.0
    while p.tenant_count.get("other", 0) > 0 and p.tenant_count.get("flood", 0) > 0:
        now += 0.001
        (d,) = p.schedule(now)
        e = p.entries[d.job_id]
        served[e.job.tenant] += e.tokens
        p.finish(d.job_id, now)
    total = served["flood"] + served["other"]
    share = w_flood / (w_flood + w_other)
    # DRR: within one quantum (times weight) plus one job of the fair share
    slack = quantum * max(w_flood, w_other) + max(flood_sizes + other_sizes) + 1
    assert served["flood"] <= share * total + slack
    assert served["other"] >= (1 - share) * total - slack


# ------------------------------------------------------------------ requeue order


@SETTINGS
@given(arrivals=st.lists(st.integers(0, 20), max_size=60))
def test_a_requeued_entry_goes_back_to_its_place_by_arrival(arrivals):
    """``insert_by_arrival`` (by bisection: a requeue into 100,000 queued is
    O(log n) probes, not a scan) puts each entry after every one that arrived
    no later -- as a scan from the end does -- so FIFO by arrival holds and
    ties keep the order they came in."""
    from collections import deque

    from router.policy.queues import insert_by_arrival

    index: deque[Entry] = deque()
    want: list[tuple[float, int]] = []
    for i, a in enumerate(arrivals):
        e = Entry(Job(f"j{i}", "m", "t", "normal", 8, 8, TaskType.AUTO, float(a)), 0, 0, i)
        insert_by_arrival(index, e)
        k = len(want)
        while k > 0 and want[k - 1][0] > a:
            k -= 1
        want.insert(k, (float(a), i))
    assert [(e.job.arrival, e.seq) for e in index] == want
