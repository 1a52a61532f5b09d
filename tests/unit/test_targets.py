"""Per-request latency targets (router.policy.targets) through the real
Policy: a sheddable request predicted to miss its TTFT target is refused at
once (429 latency_target_unattainable, Retry-After, llm-d's dropped reason),
one that is not sheddable is served anyway, a class's default target and
sheddability apply, and the prediction is calibrated by what is observed
(its error reported)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.dropped import dropped_header
from router.policy import DispatchJob, Job, Policy, WorkerSpec
from router.policy.targets import FREE
from router.policy.types import SHORT
from shared.config import ClassConfig, SchedulerConfig
from shared.errors import Code, Refusal
from shared.protocol import Pool, TaskType
from tests.fakes import worker_spec


def spec(i: int, seqs: int = 2) -> WorkerSpec:
    return worker_spec(i, seqs=seqs, max_len=8192)


def job(
    jid: str,
    prompt: int = 100,
    max_tokens: int = 500,
    target_ms: float = 0.0,
    sheddable: bool = False,
    klass: str = "normal",
    now: float = 0.0,
) -> Job:
    return Job(
        jid,
        "m",
        "t",
        klass,
        prompt,
        max_tokens,
        TaskType.SHORT,
        now,
        ttft_target_s=target_ms / 1000.0,
        sheddable=sheddable,
    )


def policy(workers: int = 2, **cfg) -> Policy:
    p = Policy(msgspec.structs.replace(SchedulerConfig(), **cfg))
    for i in range(workers):
        p.add_worker(spec(i), 0.0)
    return p


def busy(p: Policy, queued: int) -> None:
    """Every slot taken, ``queued`` more waiting (none with a target)."""
    for k in range(4 + queued):
        assert p.submit(job(f"bg{k}", max_tokens=2000), 0.0) is None
    p.schedule(0.0)


def test_an_idle_fleet_meets_a_target_and_the_prediction_is_recorded():
    p = policy()
    assert p.submit(job("a", target_ms=200, sheddable=True), 0.0) is None
    predicted = p.targets.pending["a"][0]
    assert 0.0 < predicted < 0.2  # a free slot: request work + prefill + one step (a few ms)


def test_a_sheddable_request_predicted_late_is_refused_at_once():
    p = policy()
    busy(p, queued=20)
    got = p.submit(job("late", target_ms=200, sheddable=True), 0.0)
    assert isinstance(got, Refusal) and got.kind is Code.TARGET_UNATTAINABLE
    info = got.render()
    assert (info.status, info.code) == (429, "latency_target_unattainable")
    assert info.retry_after is not None and info.retry_after >= 1.0
    assert "200 ms" in info.message and "predicted" in info.message
    assert dropped_header(info.code) == b"x-llm-d-request-dropped-reason: rejected-saturated\r\n"
    assert p.counters["ttft_target_shed"] == 1
    assert "late" not in p.entries  # nothing held


def test_a_request_that_is_not_sheddable_is_served_anyway():
    p = policy()
    busy(p, queued=20)
    assert p.submit(job("must", target_ms=200), 0.0) is None
    assert p.counters["ttft_target_shed"] == 0


def test_no_target_no_prediction():
    p = policy()
    busy(p, queued=20)
    assert p.submit(job("plain", sheddable=True), 0.0) is None
    assert not p.targets.pending


def test_class_default_target_and_sheddability():
    classes = [
        ClassConfig(name="interactive"),
        ClassConfig(name="bulk", ttft_target_ms=100.0, sheddable=True, max_predicted_wait_s=0.0),
    ]
    p = policy(classes=classes)
    for k in range(24):
        assert p.submit(job(f"bg{k}", max_tokens=2000, klass="interactive"), 0.0) is None
    p.schedule(0.0)
    got = p.submit(job("b", klass="bulk"), 0.0)
    assert isinstance(got, Refusal) and got.kind is Code.TARGET_UNATTAINABLE


def test_first_tokens_count_attainment_calibrate_and_report_the_error():
    p = policy()
    ttft_observed = []
    for k in range(60):
        jid = f"j{k}"
        assert p.submit(job(jid, target_ms=50), float(k)) is None
        predicted, raw, *_ = p.targets.pending[jid]
        [a] = [a for a in p.schedule(float(k)) if isinstance(a, DispatchJob)]
        actual = 4.0 * raw  # the engine is 4x slower than the capacity model says
        p.first_token(jid, "m", actual)
        p.finish(jid, float(k) + 1)
        ttft_observed.append(abs(actual - predicted) / actual)
    assert p.counters["ttft_target_met"] + p.counters["ttft_target_missed"] == 60
    assert ttft_observed[-1] < 0.1 < ttft_observed[0]  # learnt: the factor approaches 4
    assert 3.5 < p.targets.factor[("m", FREE, SHORT)] <= 4.0
    mape = p.snapshot(100.0)["ttft_prediction_mape"]
    assert mape is not None and 0.0 < mape < ttft_observed[0]


def test_an_ended_job_leaves_no_pending_prediction():
    p = policy()
    assert p.submit(job("a", target_ms=100), 0.0) is None
    p.finish("a", 0.0)
    assert not p.targets.pending


@settings(max_examples=60, deadline=None)
@given(
    queued=st.integers(0, 30),
    target=st.floats(1.0, 10_000.0),
    tpot=st.one_of(st.just(0.0), st.floats(0.1, 100.0)),
    sheddable=st.booleans(),
)
def test_only_sheddable_work_is_ever_shed(queued, target, tpot, sheddable):
    p = policy()
    busy(p, queued)
    x = job("x", target_ms=target, sheddable=sheddable)
    x.tpot_target_s = tpot / 1000.0
    got = p.submit(x, 0.0)
    if got is not None:  # refused only if sheddable and a target is predicted missed
        assert sheddable and got.kind is Code.TARGET_UNATTAINABLE
        ttft_late = p.targets.predict(p.models["m"], _entry(p), 0.0, tpot / 1000.0)[0] > target / 1000.0
        tpot_late = tpot > 0.0 and p.targets.best_tpot(p.models["m"])[0] > tpot / 1000.0
        assert ttft_late or tpot_late
    else:
        assert "x" in p.entries


def _entry(p: Policy):
    from router.policy.records import Entry

    return Entry(job("probe", sheddable=True), 2, 0, 0)


def test_a_job_refused_by_its_wait_bound_leaves_no_prediction_behind():
    """Only a queued job's prediction is kept (it leaves at its first token or
    its end); one refused later in admission would never leave."""
    p = policy(classes=[ClassConfig(name="normal"), ClassConfig(name="low", max_predicted_wait_s=0.001)])
    busy(p, queued=20)
    got = p.submit(job("x", target_ms=60_000, klass="low"), 0.0)
    assert isinstance(got, Refusal) and got.kind is Code.QUEUE_WAIT_EXCEEDED
    assert not p.targets.pending


# ------------------------------------------------------------ TPOT


def test_tpot_is_predicted_from_a_workers_decode_load_and_its_step_time():
    from router.policy.records import WorkerState
    from router.policy.targets import step_parts, tpot_raw

    cfg = SchedulerConfig()
    w = WorkerState(spec(0, seqs=16), cfg)
    fixed, per_seq = step_parts(w)
    assert tpot_raw(w) == fixed + per_seq  # alone: a step with one sequence
    for k in range(5):
        w.running[f"r{k}"] = 1
    w.other_seqs = 3  # other routers' sequences decode in the same steps
    assert tpot_raw(w) == fixed + per_seq * 9
    for k in range(40):
        w.running[f"x{k}"] = 1
    assert tpot_raw(w) == fixed + per_seq * 16  # never more than a full batch
    slow = WorkerState(WorkerSpec("s", "m", Pool.ANY, 1 << 20, 16, 16, 8192, step_time_s=0.1), cfg)
    assert tpot_raw(slow) > 5 * tpot_raw(WorkerState(spec(1, seqs=16), cfg))  # its registered step time


def test_a_sheddable_request_whose_tpot_no_worker_meets_is_refused_and_one_that_is_not_is_served():
    p = policy()
    got = p.submit(_tpot_job("fast", 0.5, sheddable=True), 0.0)  # 0.5 ms a token: no engine steps that fast
    assert isinstance(got, Refusal) and got.kind is Code.TARGET_UNATTAINABLE
    assert "TPOT target of 0.5 ms" in got.render().message
    assert p.counters["tpot_target_shed"] == 1 and "fast" not in p.entries
    assert p.submit(_tpot_job("must", 0.5), 0.0) is None
    assert p.submit(_tpot_job("easy", 50.0, sheddable=True), 0.0) is None


def test_tpot_is_calibrated_by_what_each_job_ends_with_and_its_error_reported():
    p = policy()
    for k in range(40):
        jid = f"j{k}"
        assert p.submit(_tpot_job(jid, 50.0), float(k)) is None
        p.schedule(float(k))
        raw = p.targets.decoding[jid][1]
        p.first_token(jid, "m", 0.01)
        p.finish(jid, float(k) + 1, tpot_s=3.0 * raw)  # the engine decodes 3x slower than registered
    assert p.counters["tpot_target_met"] == 40
    assert 2.5 < p.targets.tpot_factor["m"] <= 3.0
    snap = p.snapshot(50.0)
    assert snap["tpot_prediction_mape"] is not None and snap["tpot_prediction_mape"] < 0.5
    assert not p.targets.decoding


def _tpot_job(jid: str, tpot_ms: float, sheddable: bool = False, ttft_ms: float = 0.0) -> Job:
    j = job(jid, target_ms=ttft_ms, sheddable=sheddable)
    j.tpot_target_s = tpot_ms / 1000.0
    return j


def _mixed_fleet() -> Policy:
    """w0 is slow (a 100 ms step), w1 fast: least loaded alone ties them (to w0)."""
    p = Policy(SchedulerConfig())
    p.add_worker(WorkerSpec("w0", "m", Pool.ANY, 1 << 20, 16, 8, 8192, step_time_s=0.1), 0.0)
    p.add_worker(WorkerSpec("w1", "m", Pool.ANY, 1 << 20, 16, 8, 8192, step_time_s=0.005), 0.0)
    return p


def _placed(p: Policy, now: float = 0.0) -> str:
    [a] = [a for a in p.schedule(now) if isinstance(a, DispatchJob)]
    return a.worker_id


def test_placement_puts_a_job_where_its_tpot_target_is_met():
    p = _mixed_fleet()
    assert p.submit(job("plain"), 0.0) is None
    assert _placed(p) == "w0"  # no target: least loaded, the tie to the lowest id
    p.finish("plain", 0.0)
    assert p.submit(_tpot_job("t", 20.0, sheddable=True), 0.0) is None
    assert _placed(p) == "w1"  # only w1's steps meet 20 ms a token


def test_placement_puts_a_job_where_its_ttft_target_has_the_most_headroom():
    p = _mixed_fleet()
    assert p.submit(job("t", target_ms=200.0, sheddable=True), 0.0) is None
    assert _placed(p) == "w1"  # its first step there is 5 ms, not 100


def test_attainment_and_goodput_are_counted_per_model_and_class_and_exposed():
    from router.observe.worker_series import _queues

    p = policy()
    assert p.submit(job("a", target_ms=200), 0.0) is None  # met
    assert p.submit(_tpot_job("b", 50.0, ttft_ms=200), 0.0) is None  # both met
    assert p.submit(job("c", target_ms=1), 0.0) is None  # missed
    p.schedule(0.0)
    p.first_token("a", "m", 0.05)
    p.first_token("b", "m", 0.05)
    p.first_token("c", "m", 0.05)
    p.finish("b", 1.0, tpot_s=0.01)
    busy(p, queued=20)
    assert isinstance(p.submit(job("d", target_ms=200, sheddable=True), 0.0), Refusal)  # shed
    [row] = p.snapshot(1.0)["targets"]
    assert (row["model"], row["klass"]) == ("m", "normal")
    assert (row["ttft_met"], row["ttft_missed"], row["ttft_shed"], row["tpot_met"]) == (2, 1, 1, 1)
    assert row["goodput"] == 2  # a (TTFT met) and b (both met)
    text = "".join(_queues(p.snapshot(1.0)))
    assert 'weir_target_requests_total{klass="normal",model="m",outcome="shed",target="ttft"} 1.0' in text
    assert 'weir_target_requests_total{klass="normal",model="m",outcome="missed",target="ttft"} 1.0' in text
    assert 'weir_target_goodput_requests_total{klass="normal",model="m"} 2.0' in text
    assert "weir_tpot_prediction_error_ratio" in text


def test_a_job_waits_for_a_worker_that_meets_its_tpot_target_rather_than_run_slowly():
    p = _mixed_fleet()
    for k in range(8):  # fill the fast worker (w1): plain jobs go to the least loaded, w0 first
        assert p.submit(job(f"bg{k}"), 0.0) is None
    p.schedule(0.0)
    for k in range(8, 16):
        assert p.submit(job(f"bg{k}"), 0.0) is None
    p.schedule(0.0)
    on_fast = [j for j in p.running_on("w1")]
    assert len(on_fast) == 8 and len(p.running_on("w0")) == 8
    p.finish(p.running_on("w0")[0], 0.1)  # a slot frees on the slow worker only
    assert p.submit(_tpot_job("t", 20.0, sheddable=True), 0.1) is None  # w1 meets it even full: admitted
    assert not [a for a in p.schedule(0.1) if isinstance(a, DispatchJob)]  # not run at w0's 100 ms a token
    p.finish(on_fast[0], 0.2)
    assert _placed(p, 0.2) == "w1"


def test_a_job_the_policy_ended_itself_leaves_no_prediction_behind_once_the_router_finishes_it():
    """Expired in the queue or aborted at its generation deadline, the policy
    has released it before the router's ``finish``: that call still drops
    its predictions (they would stay for good), and judges its TPOT."""
    classes = [ClassConfig(name="normal", queue_deadline_s=1.0, max_predicted_wait_s=0.0)]
    p = policy(classes=classes, generation_deadline_s=5.0)
    for k in range(4):  # every slot taken
        assert p.submit(job(f"bg{k}", max_tokens=2000, klass="normal"), 0.0) is None
    p.schedule(0.0)
    assert p.submit(_tpot_job("waits", 50.0, ttft_ms=200.0), 0.0) is None
    assert "waits" in p.targets.pending and "waits" in p.targets.decoding
    assert any(getattr(a, "job_id", "") == "waits" for a in p.schedule(2.0))  # past its queue deadline: refused
    p.finish("waits", 2.0)
    assert "waits" not in p.targets.pending and "waits" not in p.targets.decoding
    p.finish("bg0", 2.0)
    runs = _tpot_job("runs", 50.0)
    runs.arrival = 2.0
    assert p.submit(runs, 2.0) is None
    p.schedule(2.0)
    p.first_token("runs", "m", 0.01)
    assert any(getattr(a, "job_id", "") == "runs" for a in p.schedule(8.0))  # aborted at its generation deadline
    p.finish("runs", 8.0, tpot_s=0.02)
    assert not p.targets.decoding and p.counters["tpot_target_met"] == 1


def test_a_job_taken_off_its_worker_is_judged_where_it_runs_next_and_teaches_nothing_of_how_long_jobs_run():
    """Its engine died (or it stalled, or a drain timed out) before its first
    token: it is queued again and runs elsewhere.  Its TTFT target is judged
    there against what was predicted at admission, and its cut run is not a
    sample of how long jobs run against their bound, nor of the drain rate."""
    p = policy()
    assert p.submit(job("other", target_ms=200), 0.0) is None  # (a prediction pending: ends are sampled)
    assert p.submit(job("a", target_ms=200), 0.0) is None
    placed = {a.job_id: a.worker_id for a in p.schedule(0.0) if isinstance(a, DispatchJob)}
    first = placed["a"]
    for k in range(3):
        p.stepped(first, 0.01 * k)
    meter = p.models["m"].totals.meter
    before = meter.snapshot(0.05)
    assert p.taken_off("a", 0.05)
    assert not p.taken_off("a", 0.05)  # (released once)
    assert "a" in p.targets.pending  # judged where it runs next
    assert not p.targets.ends  # a cut run: no sample of how long jobs run
    assert meter.snapshot(0.05) == before  # nor of the drain rate
    assert p.submit(job("a", target_ms=200), 0.05, requeue=True) is None
    assert "a" in {a.job_id for a in p.schedule(0.05) if isinstance(a, DispatchJob)}
    p.first_token("a", "m", 0.06)
    assert p.counters["ttft_target_met"] == 1 and "a" not in p.targets.pending


def test_a_job_moved_off_its_worker_is_judged_but_its_outage_teaches_no_calibration():
    """Taken off (a stall, a drain's timeout) or its worker lost: its first
    token elsewhere comes late by the outage.  That counts as a miss against
    its target, but is no sample of how long requests take to start: the
    calibration factor and the error gauge stay as the others made them."""
    p = policy()
    for k in range(20):  # some ordinary samples first
        assert p.submit(job(f"n{k}", target_ms=200), float(k)) is None
        p.schedule(float(k))
        p.first_token(f"n{k}", "m", 0.004)
        p.finish(f"n{k}", float(k) + 0.5)
    factors, errors = dict(p.targets.factor), len(p.targets.errors)
    assert p.submit(job("slow", target_ms=200), 30.0) is None
    assert p.submit(job("lost", target_ms=200), 30.0) is None
    placed = {a.job_id: a.worker_id for a in p.schedule(30.0) if isinstance(a, DispatchJob)}
    assert p.taken_off("slow", 40.0)  # stalled 10 s
    assert placed["lost"] != placed["slow"]
    assert p.remove_worker(placed["lost"], 40.0) == ["lost"]
    for jid in ("slow", "lost"):
        assert p.submit(job(jid, target_ms=200, now=30.0), 40.0, requeue=True) is None
    p.schedule(40.0)
    p.first_token("slow", "m", 10.01)
    p.first_token("lost", "m", 10.02)
    assert p.counters["ttft_target_missed"] == 2  # judged
    assert p.targets.factor == factors and len(p.targets.errors) == errors  # taught nothing
    p.finish("slow", 41.0)
    p.finish("lost", 41.0)
    assert not p.targets.moved and not p.targets.pending
