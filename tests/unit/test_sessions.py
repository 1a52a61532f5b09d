"""Session affinity (router.policy.sessions) through the real Policy: a
session's turns go back to its worker, sticky until that worker is over the
load bound (then the session moves), a sub-agent starts on its parent's
worker, a final turn or the TTL ends a session, the table is bounded (LRU),
and sessions are per tenant.  Placement is otherwise least loaded, or round
robin, so every sticky placement here is one the session alone explains."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy import DispatchJob, Job, Policy, WorkerSpec
from router.policy.sessions import SessionTable
from shared.config import SchedulerConfig
from shared.protocol import TaskType
from tests.fakes import worker_spec


def spec(i: int, seqs: int = 8) -> WorkerSpec:
    return worker_spec(i, seqs=seqs, max_len=4096)


def job(jid: str, session: str = "", parent: str = "", final: bool = False, tenant: str = "t", now: float = 0.0) -> Job:
    return Job(
        jid,
        "m",
        tenant,
        "normal",
        64,
        8,
        TaskType.SHORT,
        now,
        session=session,
        parent_session=parent,
        session_final=final,
    )


def policy(workers: int = 2, seqs: int = 8, **cfg) -> Policy:
    p = Policy(msgspec.structs.replace(SchedulerConfig(), **cfg))
    for i in range(workers):
        p.add_worker(spec(i, seqs), 0.0)
    return p


def run(p: Policy, j: Job, now: float = 0.0) -> str:
    assert p.submit(j, now) is None
    got = [a.worker_id for a in p.schedule(now) if isinstance(a, DispatchJob) and a.job_id == j.job_id]
    assert len(got) == 1
    return got[0]


def test_turns_stay_on_their_worker_where_round_robin_would_move_them():
    p = policy(4, placement="round_robin")
    first = run(p, job("a0", "S"))
    for k in range(1, 6):
        assert run(p, job(f"a{k}", "S"), k) == first
        p.finish(f"a{k}", k)
    assert p.counters["session_sticky"] == 5 and p.counters["session_new"] == 1
    # the same without a session: round robin moves on
    assert len({run(p, job(f"x{k}"), 10) for k in range(4)}) == 4


def test_sticky_until_saturated_then_moved_and_sticky_there():
    p = policy(2, seqs=4, session_load_bound=0.5)
    home = run(p, job("t0", "S"))  # holds 1 of 4
    assert run(p, job("t1", "S")) == home  # 2 of 4: at the bound
    moved = run(p, job("t2", "S"))  # a third would pass it: placed elsewhere, the session follows
    assert moved != home and p.counters["session_moved"] == 1
    for jid in ("t0", "t1"):
        p.finish(jid, 1.0)
    assert run(p, job("t3", "S"), 1.0) == moved  # stays where it moved, though home is idle now


def test_a_sub_agent_starts_on_its_parents_worker_then_is_a_session_of_its_own():
    p = policy(3, placement="round_robin")
    parent = run(p, job("p", "root"))
    assert run(p, job("c1", "child-1", parent="root")) == parent
    assert run(p, job("c2", "child-2", parent="root")) == parent
    assert p.counters["session_from_parent"] == 2
    assert run(p, job("c1b", "child-1")) == parent  # child-1 is now known by itself


def test_a_final_turn_ends_the_session():
    p = policy(3, placement="round_robin")
    home = run(p, job("a", "S"))
    assert run(p, job("b", "S", final=True)) == home
    assert len(p.sessions) == 0 and p.counters["session_ended"] == 1
    assert run(p, job("c", "S")) != home  # a new session: round robin's next worker
    assert p.counters["session_new"] == 2


def test_ttl_forgets_a_session():
    p = policy(3, placement="round_robin", session_ttl_s=10.0)
    home = run(p, job("a", "S"))
    assert run(p, job("b", "S", now=5.0), 5.0) == home
    assert run(p, job("c", "S", now=16.0), 16.0) != home  # 11 s after its last turn


def test_sessions_are_per_tenant():
    p = policy(3, placement="round_robin")
    home = run(p, job("a", "S", tenant="alice"))
    assert run(p, job("b", "S", tenant="mallory")) != home  # another tenant's "S" is another session
    assert run(p, job("c", "S", parent="S", tenant="mallory")) != home


def test_sessions_off():
    p = policy(3, placement="round_robin", sessions=False)
    assert len({run(p, job(f"a{k}", "S"), k) for k in range(3)}) == 3


def test_a_lost_worker_sends_the_session_elsewhere():
    p = policy(2)
    home = run(p, job("a", "S"))
    p.remove_worker(home, 1.0)
    assert run(p, job("b", "S"), 1.0) != home
    assert p.counters["session_moved"] == 1


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("abcdefgh"), st.sampled_from(["w0", "w1", "w2"]), st.booleans(), st.floats(0.0, 3.0)),
        max_size=60,
    ),
    cap=st.integers(1, 5),
)
def test_table_bounded_lru_and_ttl(ops, cap):
    """Property: never more than ``cap`` sessions; a lookup answers the
    worker of the session's last turn or nothing (evicted, ended, past the
    TTL), never another; the session just placed (not final) is found; one
    past the TTL or ended is not; a session is evicted only for a more
    recently placed one."""
    counters: dict[str, int] = {}
    t = SessionTable(cap, ttl_s=5.0, load_bound=1.0, counters=counters)
    now = 0.0
    last: dict[str, tuple[str, float, bool]] = {}  # session -> (worker, when, final)
    for sess, worker, final, dt in ops:
        now += dt
        t.placed(job("j", sess, final=final, now=now), worker, now)
        last[sess] = (worker, now, final)
        assert len(t) <= cap
        assert t.home(job("q", sess), now) == (None if final else worker)
        for s, (w, when, fin) in last.items():
            got = t.home(job("q", s), now)
            assert got in (None, w)
            if fin or now - when > 5.0:
                assert got is None
    assert sum(counters[k] for k in ("session_new", "session_sticky", "session_moved", "session_from_parent")) == len(
        ops
    )


def test_new_sessions_spread_over_the_fleet():
    """Least loaded alone puts every first turn of an idle fleet on the lowest
    id (ties); new sessions go where the fewest sessions are instead, so no
    worker's cache holds more of their contexts than the others'."""
    p = policy(4)
    where = []
    for k in range(8):
        where.append(run(p, job(f"s{k}", f"S{k}", now=float(k)), float(k)))
        p.finish(f"s{k}", float(k))
    assert sorted(where.count(f"w{i}") for i in range(4)) == [2, 2, 2, 2]
    plain = policy(4)
    for k in range(4):
        assert run(plain, job(f"x{k}", now=float(k)), float(k)) == "w0"
        plain.finish(f"x{k}", float(k))


def test_a_tenant_with_many_sessions_evicts_only_its_own():
    """Hostile tenant: session ids are free to invent, so a tenant's flood of
    them pushes out its own oldest sessions, never another tenant's (and the
    whole table stays bounded, the tenant holding the most giving one up)."""
    counters: dict[str, int] = {}
    t = SessionTable(50, ttl_s=600.0, load_bound=1.0, counters=counters, max_per_tenant=10)
    t.placed(job("a", "alice-1", tenant="alice"), "w0", 0.0)
    for k in range(1000):
        t.placed(job("m", f"m{k}", tenant="mallory"), "w1", 1.0)
    assert t.home(job("q", "alice-1", tenant="alice"), 2.0) == "w0"
    assert len(t) == 11 and t.home(job("q", "m999", tenant="mallory"), 2.0) == "w1"
    assert t.home(job("q", "m0", tenant="mallory"), 2.0) is None
    big = SessionTable(5, ttl_s=600.0, load_bound=1.0, counters={}, max_per_tenant=5)
    big.placed(job("a", "alice-1", tenant="alice"), "w0", 0.0)
    for k in range(5):
        big.placed(job("b", f"b{k}", tenant="bob"), "w1", 1.0)
    assert len(big) == 5 and big.home(job("q", "alice-1", tenant="alice"), 2.0) == "w0"
    assert big.per_worker == {"w0": 1, "w1": 4}
