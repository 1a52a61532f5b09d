"""Fairness ids (router/policy/fairness.py): inside one tenant's turn, its
end users (``x-llm-d-inference-fairness-id`` and the like) are served by
deficit round robin, and the tenant's share across tenants is what it is
without them.  Through the real policy (pure: time is passed in)."""

from __future__ import annotations

from collections import Counter

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.policy import DispatchJob, Job, Policy, WorkerSpec
from router.policy.fairness import EXACT_IDS, OVERFLOW_LINES, FairLines
from shared.config import ClassConfig, SchedulerConfig
from shared.protocol import Pool, TaskType

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUANTUM = 1024


def policy(quantum: int = QUANTUM, **kw) -> Policy:
    cfg = msgspec.structs.replace(
        SchedulerConfig(),
        short_threshold_tokens=quantum,
        max_queue_per_tenant=1_000_000,
        classes=[ClassConfig(name="normal", max_queue=1_000_000, queue_deadline_s=1e9)],
        **kw,
    )
    p = Policy(cfg)
    p.add_worker(WorkerSpec("w0", "m", Pool.ANY, 1 << 24, 16, 1, 1 << 16), 0.0)  # one job at a time
    return p


_n = 0


def job(tenant: str, fid: str = "", prompt: int = 100, t: float = 0.0, weight: float = 1.0) -> Job:
    global _n
    _n += 1
    return Job(f"j{_n}", "m", tenant, "normal", prompt, 28, TaskType.SHORT, t, weight, fairness_id=fid)


def serve_one(p: Policy, now: float) -> Job:
    (d,) = [a for a in p.schedule(now) if isinstance(a, DispatchJob)]
    j = p.entries[d.job_id].job
    p.finish(d.job_id, now)
    return j


def test_an_end_users_request_is_served_within_one_round_beside_a_flooding_user_of_its_tenant():
    p = policy()
    hog = [job("platform", "hog", t=0.001 * i) for i in range(100)]
    for j in hog:
        assert p.submit(j, j.arrival) is None
    quiet = job("platform", "quiet", t=1.0)  # arrives after all of the hog's
    assert p.submit(quiet, 1.0) is None
    order = [serve_one(p, 2.0 + 0.01 * i) for i in range(101)]
    # one round: the hog's quantum (1024 tokens = 8 of its 128-token jobs) at most, then the quiet user
    assert order.index(quiet) <= QUANTUM // 128
    assert [j for j in order if j is not quiet] == hog  # each user's own requests stay in arrival order


def test_without_a_fairness_id_a_tenants_requests_stay_in_arrival_order():
    p = policy()
    jobs = [job("platform", t=0.001 * i) for i in range(30)]
    for j in jobs:
        p.submit(j, j.arrival)
    assert [serve_one(p, 1.0 + 0.01 * i) for i in range(30)] == jobs


def test_requests_without_an_id_share_one_line_beside_the_ids():
    """What the tenant queued before its first fairness id, and whatever it
    sends without one, is the line of the empty id: served in its turn."""
    p = policy()
    plain = [job("platform", t=0.001 * i) for i in range(40)]
    for j in plain:
        p.submit(j, j.arrival)
    late = job("platform", "user-1", t=1.0)
    p.submit(late, 1.0)
    order = [serve_one(p, 2.0 + 0.01 * i) for i in range(41)]
    assert order.index(late) <= QUANTUM // 128
    assert [j for j in order if j is not late] == plain


@SETTINGS
@given(
    ids=st.lists(st.sampled_from(["", "a", "b", "c"]) | st.text("xyz", min_size=1, max_size=6), min_size=1),
    sizes=st.lists(st.integers(16, 900), min_size=1, max_size=6),
    w_platform=st.floats(0.25, 4.0),
    quantum=st.integers(64, 2048),
)
def test_fairness_ids_never_give_a_tenant_more_than_its_share(ids, sizes, w_platform, quantum):
    """The platform tenant's requests carry any fairness ids; the other's none.
    While both wait, the platform tenant gets at most its weighted share, as
    without ids (test_policy_properties' bound)."""
    p = policy(quantum)
    for i in range(600):
        p.submit(job("platform", ids[i % len(ids)], sizes[i % len(sizes)], weight=w_platform), 0.0)
        if i % 3 == 0:
            p.submit(job("other", "", sizes[(i + 1) % len(sizes)]), 0.0)
    served: Counter[str] = Counter()
    now = 0.0
    while p.tenant_count.get("platform", 0) and p.tenant_count.get("other", 0):
        now += 0.001
        j = serve_one(p, now)
        served[j.tenant] += max(1, j.prompt_tokens) + j.max_tokens
    total = served["platform"] + served["other"]
    share = w_platform / (w_platform + 1.0)
    slack = quantum * max(w_platform, 1.0) + max(sizes) + 28 + 1
    assert served["platform"] <= share * total + slack
    assert served["other"] >= (1 - share) * total - slack


@SETTINGS
@given(
    n_users=st.integers(2, 5),
    sizes=st.lists(st.integers(16, 900), min_size=1, max_size=6),
    quantum=st.integers(64, 2048),
    cancel_every=st.sampled_from([0, 2, 3, 5, 7]),
)
def test_users_of_a_tenant_share_its_turn_by_tokens(n_users, sizes, quantum, cancel_every):
    """User 0 floods (10x the others' requests), some requests are cancelled
    while queued; while every user still waits, each user's served tokens
    are within one quantum and one request of every other's (DRR)."""
    p = policy(quantum)
    queued: dict[str, int] = Counter()
    jobs = []
    for i in range(400):
        for u in range(n_users):
            if u == 0 or i % 10 == 0:
                j = job("platform", f"user-{u}", sizes[(i + u) % len(sizes)])
                p.submit(j, 0.0)
                jobs.append(j)
                queued[j.fairness_id] += 1
    if cancel_every:
        for j in jobs[::cancel_every]:
            if j.fairness_id != "user-1":  # (keep one light user backlogged to the end)
                p.finish(j.job_id, 0.0)
                queued[j.fairness_id] -= 1
    served: Counter[str] = Counter()
    now = 0.0
    while all(queued[f"user-{u}"] > 0 for u in range(n_users)):
        now += 0.001
        j = serve_one(p, now)
        served[j.fairness_id] += max(1, j.prompt_tokens) + j.max_tokens
        queued[j.fairness_id] -= 1
    slack = quantum + max(sizes) + 28 + 1
    assert max(served.values(), default=0) - min(served[f"user-{u}"] for u in range(n_users)) <= slack, served


def test_a_tenant_sending_endless_ids_holds_a_bounded_number_of_lines_and_loses_no_request():
    p = policy()
    jobs = [job("hostile", f"id-{i}", t=0.0001 * i) for i in range(5_000)]
    jobs += [job("hostile", t=1.0 + 0.0001 * i) for i in range(100)]  # and some without an id
    for j in jobs:
        assert p.submit(j, j.arrival) is None
    (q,) = [q for m in p.models.values() for q in m.queues.by_key.values()]
    lines = q.tenants["hostile"]
    assert isinstance(lines, FairLines)
    assert len(lines.lines) <= EXACT_IDS + OVERFLOW_LINES + 1
    assert len(lines.lines[""]) == 100  # those without an id keep their own line, even past the bound
    assert len(lines.active) == len(lines.deficit) == len(lines.lines)
    seen = [serve_one(p, 2.0 + 0.0001 * i) for i in range(len(jobs))]
    assert sorted(j.job_id for j in seen) == sorted(j.job_id for j in jobs)  # each once
    assert not p.has_queued() and "hostile" not in q.tenants  # nothing kept once it drained


def test_a_requeued_request_goes_back_into_its_users_line():
    """A lost worker's unstarted job is queued again by its arrival, inside its user's line."""
    p = policy()
    first = job("platform", "quiet", t=0.0)
    p.submit(first, 0.0)
    (d,) = [a for a in p.schedule(0.0) if isinstance(a, DispatchJob)]
    hog = [job("platform", "hog", t=0.001 * (i + 1)) for i in range(50)]
    for j in hog:
        p.submit(j, j.arrival)
    assert p.remove_worker("w0", 0.5) == [first.job_id]
    assert p.submit(first, 0.5, requeue=True) is None
    p.add_worker(WorkerSpec("w1", "m", Pool.ANY, 1 << 24, 16, 1, 1 << 16), 0.5)
    order = [serve_one(p, 1.0 + 0.01 * i) for i in range(51)]
    assert order.index(first) <= QUANTUM // 128
    assert [j for j in order if j is not first] == hog


def test_the_fifo_baseline_ignores_fairness_ids():
    fifo = policy(policy="fifo")
    jobs = [job("platform", "hog", t=0.001 * i) for i in range(20)] + [job("platform", "quiet", t=1.0)]
    for j in jobs:
        fifo.submit(j, j.arrival)
    assert [serve_one(fifo, 2.0 + 0.01 * i) for i in range(21)] == jobs


# ------------------------------------------------------------------ admission (the wait model)


def bounded_policy() -> Policy:
    """A 2 s wait bound on one 8-slot worker: a tenant alone is refused after ~180 jobs."""
    cfg = msgspec.structs.replace(
        SchedulerConfig(), classes=[ClassConfig(name="normal", max_predicted_wait_s=2.0, queue_deadline_s=60.0)]
    )
    p = Policy(cfg)
    p.add_worker(WorkerSpec("w0", "m", Pool.ANY, 1 << 20, 16, 8, 1 << 16), 0.0)
    return p


def fill(p: Policy, fids, tenant: str = "platform") -> int:
    """Submit jobs with the fairness ids ``fids`` yields until one is refused: how many were admitted."""
    for n, fid in enumerate(fids):
        refusal = p.submit(job(tenant, fid), 0.0)
        if refusal is not None:
            assert refusal.code in ("queue_wait_exceeded", "tenant_share_exceeded"), refusal
            return n
    raise AssertionError("never refused")


def forever(fid: str):
    while True:
        yield fid


def test_a_user_is_admitted_beside_another_user_who_filled_the_tenants_share():
    """One user fills what the wait bound admits of its tenant (as many as
    without ids: an id gains nothing); another user's requests are still
    admitted, predicted to wait at most a round, not behind the whole flood."""
    alone = fill(bounded_policy(), forever(""))
    p = bounded_policy()
    assert fill(p, forever("hog")) == alone
    quiet = job("platform", "quiet")
    assert p.submit(quiet, 0.0) is None
    assert p.entries[quiet.job_id].predicted < 0.1 * p.admission.waits.bound[0]


@SETTINGS
@given(users=st.lists(st.integers(1, 300), min_size=1, max_size=12), fresh=st.booleans())
def test_a_tenants_fairness_ids_hold_its_queue_to_twice_its_share_and_others_are_admitted(users, fresh):
    """Users fill the tenant's queue one after another (or each request a
    fresh id): the tenant never queues more than TENANT_ROOM times what it
    may without ids, and another tenant's request is admitted meanwhile."""
    from router.policy.fairness import TENANT_ROOM

    alone = fill(bounded_policy(), forever(""))
    p = bounded_policy()
    total = 0
    for u, most in enumerate(users):
        ids = (f"fresh-{u}-{i}" if fresh else f"user-{u}" for i in range(most))
        for fid in ids:
            if p.submit(job("platform", fid), 0.0) is not None:
                break
            total += 1
    assert total <= TENANT_ROOM * alone + 1
    assert p.submit(job("other"), 0.0) is None


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["submit", "serve", "cancel", "reprice", "lose"]), st.integers(0, 50)),
        max_size=120,
    )
)
def test_the_wait_models_tokens_by_fairness_id_match_what_is_queued(ops):
    """Whatever is submitted, served, cancelled, re-priced or requeued from a
    lost worker, the wait model's per-id totals are those of the queued
    entries, and are gone once nothing of a tenant is queued."""
    from router.policy.fairness import wait_bucket
    from router.policy.records import WAITING

    p = policy()
    p.add_worker(WorkerSpec("w1", "m", Pool.ANY, 1 << 24, 16, 2, 1 << 16), 0.0)
    jobs: list[Job] = []
    now = 0.0
    for op, k in ops:
        now += 0.01
        if op == "submit":
            j = job(f"t{k % 2}", ["", "a", "b", f"x{k}"][k % 4], 20 + 7 * k, t=now)
            if p.submit(j, now) is None:
                jobs.append(j)
        elif op == "serve":
            p.schedule(now)
        elif op == "cancel" and jobs:
            p.finish(jobs[k % len(jobs)].job_id, now)
        elif op == "reprice" and jobs:
            p.correct_prompt_tokens(jobs[k % len(jobs)].job_id, 1 + 11 * k)
        elif op == "lose":
            for jid in p.remove_worker("w1", now):
                p.submit(
                    p.entries[jid].job if jid in p.entries else next(j for j in jobs if j.job_id == jid),
                    now,
                    requeue=True,
                )
            p.add_worker(WorkerSpec("w1", "m", Pool.ANY, 1 << 24, 16, 2, 1 << 16), now)
        want: dict[tuple[str, int], int] = {}
        for e in p.entries.values():
            if e.state == WAITING and e.job.fairness_id:
                key = (e.job.tenant, wait_bucket(e.job.fairness_id))
                want[key] = want.get(key, 0) + e.tokens
        (m,) = p.models.values()
        got = {(t, b): n for t, buckets in m.totals.by_id[0].items() for b, n in buckets.items()}
        assert got == want
