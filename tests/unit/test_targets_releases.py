"""A full fleet's wait for a slot (router.policy.targets): each running job's
expected end on its worker's step clock, the (q+1)-th soonest of them for a
job with q served before it, the jobs the queues serve first, and the
calibration of job lengths against their max_tokens bound."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from router.policy import DispatchJob, Job, Policy, WorkerSpec
from router.policy.records import Entry, WorkerState
from router.policy.targets import FULL, Targets, expected_end, kth_release, miss_line
from router.policy.types import LONG, SHORT
from shared.config import SchedulerConfig
from shared.protocol import TaskType
from tests.fakes import worker_spec


def spec(i: int, seqs: int = 2) -> WorkerSpec:
    return worker_spec(i, seqs=seqs, max_len=8192)


def job(jid: str, max_tokens: int = 500, target_ms: float = 0.0, tenant: str = "t", now: float = 0.0) -> Job:
    return Job(jid, "m", tenant, "normal", 100, max_tokens, TaskType.SHORT, now, ttft_target_s=target_ms / 1000.0)


def test_kth_release_is_the_q_plus_first_soonest_end_interpolated_and_extrapolated():
    ends = [5.0, 1.0, 3.0]
    assert kth_release(ends, 0.0, 0.0, 2.0) == 1.0
    assert kth_release(ends, 1.0, 0.0, 2.0) == 3.0
    assert kth_release(ends, 1.5, 0.0, 2.0) == 4.0  # half way between the 2nd and the 3rd
    assert kth_release(ends, 2.0, 0.0, 2.0) == 5.0
    assert kth_release(ends, 4.0, 0.0, 2.0) == 9.0  # past the last: a mean gap per release more
    assert kth_release(ends, 0.0, 2.0, 1.0) == 2.0  # an overdue end: now


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=50), st.floats(0.0, 80.0), st.floats(0.0, 10.0))
def test_kth_release_grows_with_q_and_matches_the_sorted_ends(ends, q, gap):
    srt = sorted(ends)
    k = int(q)
    if k < len(ends):
        assert kth_release(ends, float(k), 0.0, gap) == srt[k]
    assert kth_release(ends, q, 0.0, gap) <= kth_release(ends, q + 0.5, 0.0, gap)
    assert kth_release(ends, q, 0.0, gap) >= srt[0]


def test_a_job_is_expected_to_end_after_a_step_per_output_token_on_its_workers_clock():
    w = WorkerState(spec(0), SchedulerConfig())
    w.steps, w.stepped_at, w.step_gap = 25, 10.0, 0.01
    assert abs(expected_end(10, 20, 1.0, w) - (10.0 + 5 * 0.01)) < 1e-9  # 20 tokens from step 10: 5 left
    assert abs(expected_end(10, 20, 0.5, w) - (10.0 + 0.01)) < 1e-9  # overdue (EOS): the next step
    assert abs(expected_end(0, 20, 1.0, w) - (10.0 + 0.01)) < 1e-9


def test_the_step_clock_learns_the_time_between_steps_and_bounds_idle_gaps():
    w = WorkerState(spec(0), SchedulerConfig())
    assert w.step_gap < 0.005  # registered: the sim calibration's full batch; this engine steps 20 ms
    t = 0.0
    for _ in range(200):
        t += 0.02
        Targets.stepped(w, t)
    assert w.steps == 200 and w.stepped_at == t
    assert abs(w.step_gap - 0.02) < 1e-3
    Targets.stepped(w, t + 60.0)  # idle a minute: counted as a few steps' length at most
    assert w.step_gap < 0.03 and w.steps == 201


def test_the_end_ratio_converges_to_how_long_jobs_run_against_their_bound():
    cfg = SchedulerConfig()
    p = Policy(cfg)
    t = p.targets
    w = WorkerState(spec(0), cfg)
    assert t.end_ratio("m") == 1.0  # nothing seen: the bound
    for k in range(2000):
        e = Entry(job(f"j{k}", max_tokens=100), 0, SHORT, k)
        e.placed_step = w.steps
        w.steps += 40  # it stopped (EOS) after 40 of its 100 tokens
        t.released(e, w)
    assert abs(t.end_ratio("m") - 0.4) < 0.01


def full_policy() -> Policy:
    """Two workers of two slots each, every slot taken by jobs placed at step 0
    with 100, 200, 300 and 400 tokens to go."""
    p = Policy(SchedulerConfig())
    for i in range(2):
        p.add_worker(spec(i), 0.0)
    for k, mt in enumerate((100, 200, 300, 400)):
        assert p.submit(job(f"bg{k}", max_tokens=mt), 0.0) is None
    assert len([a for a in p.schedule(0.0) if isinstance(a, DispatchJob)]) == 4
    return p


def step_all(p: Policy, n: int, t0: float, gap: float) -> float:
    t = t0
    for _ in range(n):
        t += gap
        for wid in ("w0", "w1"):
            p.stepped(wid, t)
    return t


def test_a_full_fleet_predicts_the_wait_for_the_soonest_release_on_the_step_clock():
    p = full_policy()
    now = step_all(p, 90, 0.0, 0.01)  # 90 steps of 10 ms: the shortest job has 10 left
    assert p.submit(job("a", target_ms=1000), now) is None
    _, raw, regime, *_ = p.targets.pending["a"]
    assert regime == FULL
    floor = p.targets._floor(p.models["m"], job("x"))
    gap = p.workers["w0"].step_gap  # (learnt: 10 ms, within 1 %)
    assert abs(gap - 0.01) < 1e-4
    assert abs(raw - floor - 10 * gap) < 1e-6  # its wait: the 10 steps the shortest job has left
    # a job behind it (one of its tenant queued ahead) waits for the second release, 100 steps later
    assert p.submit(job("b", target_ms=1000), now) is None
    _, raw_b, *_ = p.targets.pending["b"]
    assert abs(raw_b - floor - 110 * gap) < 1e-6


def test_the_prediction_follows_the_running_jobs_progress_not_only_the_mean_release_gap():
    early, late = full_policy(), full_policy()
    t_early = step_all(early, 5, 0.0, 0.01)
    t_late = step_all(late, 95, 0.0, 0.01)
    assert early.submit(job("a", target_ms=1000), t_early) is None
    assert late.submit(job("a", target_ms=1000), t_late) is None
    assert late.targets.pending["a"][1] < early.targets.pending["a"][1] / 5  # 5 steps to go against 95


def test_jobs_ahead_counts_its_tenants_queued_jobs_and_what_round_robin_serves_the_others_first():
    p = full_policy()
    for k in range(3):
        assert p.submit(job(f"own{k}", max_tokens=100), 0.0) is None
    m = p.models["m"]
    own = p.entries["own0"]
    e = Entry(job("x", max_tokens=100), own.rank, own.size, 99)  # (not queued yet: as at admission)
    assert p.targets.jobs_ahead(m, e) == 3.0  # its tenant's three, nobody else's
    for k in range(3):  # another tenant of equal weight, the same jobs: round robin serves as many of its
        assert p.submit(job(f"other{k}", max_tokens=100, tenant="u"), 0.0) is None
    got = p.targets.jobs_ahead(m, e)
    assert got is not None and 5.5 <= got <= 6.0


def test_requests_without_a_target_record_no_step_sample_of_job_lengths():
    p = full_policy()
    step_all(p, 100, 0.0, 0.01)
    assert p.finish("bg0", 1.0)
    assert p.targets.end_ratio("m") == 1.0 and not p.targets.ends


def test_what_the_count_of_jobs_ahead_misses_on_average_is_learnt_from_the_dispatches_before_each():
    p = full_policy()
    t = p.targets
    now = step_all(p, 90, 0.0, 0.01)
    for k in range(300):  # each counted one job ahead, and two were dispatched before it
        t.ahead_at[f"j{k}"] = (t.model_dispatched.get("m", 0), 1.0, "m", SHORT, -1.0)
        t.model_dispatched["m"] = t.model_dispatched.get("m", 0) + 2
        t.dispatching(f"j{k}")
    sums = t.ahead_err[("m", SHORT)]
    assert abs(sums[0] / sums[1] - 1.0) < 1e-9 and not t.ahead_at
    assert p.submit(job("a", target_ms=1000), now) is None  # nothing ahead: nothing to correct
    assert p.submit(job("b", target_ms=1000), now) is None  # one ahead, counted as two: the third release
    floor = t._floor(p.models["m"], job("x"))
    gap = p.workers["w0"].step_gap
    assert abs(t.pending["a"][1] - floor - 10 * gap) < 1e-6
    assert abs(t.pending["b"][1] - floor - 210 * gap) < 1e-6
    assert "b" in t.ahead_at and "a" not in t.ahead_at  # b's count is checked at its dispatch
    p.finish("b", now)
    assert "b" not in t.ahead_at  # (cancelled while queued: nothing left behind)


def test_only_its_own_models_dispatches_count_as_gone_before_a_job():
    p = full_policy()
    t = p.targets
    t.ahead_at["j"] = (t.model_dispatched.get("m", 0), 1.0, "m", SHORT, -1.0)  # counted one ahead on model m
    p.add_worker(worker_spec(9, seqs=64, model="n"), 0.0)
    for k in range(50):  # another model's jobs, dispatched meanwhile
        assert p.submit(replace(job(f"n{k}"), model="n"), 0.0) is None
    assert len([a for a in p.schedule(0.0) if isinstance(a, DispatchJob)]) == 50
    t.dispatching("j")
    sums = t.ahead_err[("m", SHORT)]
    assert sums[0] / sums[1] == -1.0  # none of m's went before it (not 49: n's are not ahead of it)


def test_jobs_ahead_by_fairness_id_counts_its_own_line_and_a_round_of_the_others_not_the_whole_tenant():
    p = full_policy()
    for k in range(50):  # one end user of tenant t floods its queue
        assert p.submit(replace(job(f"f{k}", max_tokens=100), fairness_id="flood"), 0.0) is None
    m = p.models["m"]
    f0 = p.entries["f0"]
    quiet = Entry(replace(job("x", max_tokens=100), fairness_id="quiet"), f0.rank, f0.size, 99)
    got = p.targets.jobs_ahead(m, quiet)
    assert got is not None and got <= 1.0  # a round of the flood's line: one job, not its fifty
    flood = Entry(replace(job("y", max_tokens=100), fairness_id="flood"), f0.rank, f0.size, 99)
    got = p.targets.jobs_ahead(m, flood)
    assert got is not None and got >= 50.0  # the flooder's next waits behind its own line


def test_jobs_ahead_counts_nothing_of_its_own_tenant_where_it_has_none_in_that_queue():
    p = full_policy()
    for k in range(3):  # another tenant's three short jobs
        assert p.submit(job(f"u{k}", max_tokens=100, tenant="u"), 0.0) is None
    assert p.submit(replace(job("long", max_tokens=5000), task_type=TaskType.LONG), 0.0) is None  # its own: a long one
    m = p.models["m"]
    u0 = p.entries["u0"]
    assert p.entries["long"].size != u0.size
    e = Entry(job("x", max_tokens=100), u0.rank, u0.size, 99)
    got = p.targets.jobs_ahead(m, e)
    # u's next (round robin, equal weights) and the long queue's share meanwhile: not its tenant's
    # long job's tokens counted as three short jobs of its own ahead of it
    assert got is not None and got < 2.5


def test_jobs_ahead_counts_whole_jobs_of_the_other_size_as_round_robin_serves_them():
    """Short : long round robin by tokens serves the long queue as soon as the
    short one's credit is ahead, a whole long job at a time: a short job with
    three of its tenant's ahead waits for one long job too, not a fraction of one."""
    p = full_policy()
    for k in range(3):
        assert p.submit(job(f"own{k}", max_tokens=100), 0.0) is None
    assert p.submit(replace(job("long", max_tokens=5000, tenant="u"), task_type=TaskType.LONG), 0.0) is None
    m = p.models["m"]
    own = p.entries["own0"]
    assert p.entries["long"].size == LONG and own.size == SHORT
    e = Entry(job("x", max_tokens=100), own.rank, own.size, 99)
    assert p.targets.jobs_ahead(m, e) == 4.0
    # what the queues then do: room for everyone at once, dispatched in their order
    assert p.submit(job("x", max_tokens=100), 0.0) is None
    p.add_worker(replace(spec(5, seqs=8), worker_id="big"), 0.0)
    order = [a.job_id for a in p.schedule(0.0) if isinstance(a, DispatchJob)]
    assert order.index("x") == 4 and order.index("long") < 4, order


def test_a_long_jobs_miss_is_learnt_as_a_line_in_its_wait_and_corrects_the_next_by_its_own_wait():
    """Short jobs that arrive while a long one waits are served first (round
    robin): what its count misses grows with how long it waits.  Learnt as a
    line in the wait predicted from the count (least squares); a short job's
    miss (round-robin granularity) stays a constant."""
    learnt, fresh = full_policy(), full_policy()
    t = learnt.targets
    for k in range(300):  # counted two ahead with waits of 0.25-1 s; 1 + 4 x wait more went before each
        w = 0.25 * (1 + k % 4)
        t.ahead_at[f"j{k}"] = (t.model_dispatched.get("m", 0), 2.0, "m", LONG, w)
        t.model_dispatched["m"] = t.model_dispatched.get("m", 0) + 2 + int(1 + 4 * w)
        t.dispatching(f"j{k}")
    a, b = miss_line(t.ahead_err[("m", LONG)]) or (0.0, 0.0)
    assert abs(a - 1.0) < 1e-6 and abs(b - 4.0) < 1e-6
    now = 0.0
    for p in (learnt, fresh):
        now = step_all(p, 50, 0.0, 0.01)
        for k in range(2):
            assert p.submit(replace(job(f"l{k}", max_tokens=5000), task_type=TaskType.LONG), now) is None
        assert p.submit(replace(job("a", max_tokens=5000, target_ms=60_000), task_type=TaskType.LONG), now) is None
    w0 = t.ahead_at["a"][4]  # its wait from its count alone, recorded to learn from at its dispatch
    assert w0 > 0.0 and fresh.targets.ahead_at["a"][4] == w0
    assert learnt.targets.pending["a"][1] > fresh.targets.pending["a"][1]  # q + 1 + 4 x w0 releases away
    # and learnt from what happens, not only from the rows above: fresh dispatches it
    for k in range(4):
        fresh.finish(f"bg{k}", now)
    fresh.schedule(now)
    row = fresh.targets.ahead_err[("m", LONG)]
    assert "a" not in fresh.targets.ahead_at and row[2] == 1.0 and row[3] == w0


def test_the_miss_line_waits_for_enough_jobs_with_spread_waits_and_never_slopes_down():
    """A single long job with a tiny wait (or many with the same wait) would
    give a slope of noise scaled up: the constant miss is used until 16 jobs
    with waits spread over 10 ms have been seen."""

    def row(samples):
        r = [0.0] * 7
        for w, m in samples:
            r[0] += m
            r[1] += 1
            r[2:] = [r[2] + 1, r[3] + w, r[4] + w * w, r[5] + m, r[6] + w * m]
        return r

    assert miss_line(row([(0.001, 1.0)])) is None  # one job, 1 ms: not 1,000 jobs a second
    assert miss_line(row([(0.5, 3.0)] * 100)) is None  # no spread: no slope to learn
    assert miss_line(row([(0.1 * (k % 5), 2.0) for k in range(15)])) is None  # too few
    got = miss_line(row([(0.1 * (k % 5), 2.0 + 3.0 * 0.1 * (k % 5)) for k in range(40)]))
    assert got is not None and abs(got[0] - 2.0) < 1e-9 and abs(got[1] - 3.0) < 1e-9
    got = miss_line(row([(0.1 * (k % 5), 5.0 - 0.1 * (k % 5)) for k in range(40)]))
    assert got is not None and got[1] == 0.0 and abs(got[0] - 4.8) < 1e-9  # (no fewer arrivals for a longer wait)
