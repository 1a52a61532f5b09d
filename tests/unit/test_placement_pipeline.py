"""Placement as a pipeline (router/policy/placement/): each filter drops
workers for its one reason, the picker takes the best load score with ties
to the lowest worker id, and a scorer added to a strategy's list takes part
in every placement -- the extension point a new scorer uses.  Pure, in-process."""

from __future__ import annotations

from router.policy import DispatchJob, Job, Policy, WorkerSpec
from router.policy.placement.ask import Ask, Candidate
from router.policy.placement.filters import class_headroom, fits, preferred_pool, takes_work
from router.policy.records import Entry
from shared.config import SchedulerConfig
from shared.protocol import Pool, TaskType


def spec(i: int, pool: Pool = Pool.ANY, cap: int = 1024, seqs: int = 8, max_len: int = 4096) -> WorkerSpec:
    return WorkerSpec(f"w{i}", "m", pool, cap, 16, seqs, max_len)


def job(jid: str, prompt: int = 100, max_tokens: int = 16, klass: str = "normal") -> Job:
    return Job(jid, "m", "t", klass, prompt, max_tokens, TaskType.SHORT, 0.0)


def placed(p: Policy, now: float = 0.0) -> dict[str, str]:
    return {a.job_id: a.worker_id for a in p.schedule(now) if isinstance(a, DispatchJob)}


def ask_for(p: Policy, j: Job, limit: float = 1.0) -> Ask:
    m = p.models["m"]
    return Ask(m, Entry(j, 0, 0, 1), set(), limit, None)


def test_each_filter_drops_for_its_one_reason():
    p = Policy(SchedulerConfig(prefix_affinity=False))
    for i, (pool, max_len) in enumerate([(Pool.ANY, 4096), (Pool.SHORT, 4096), (Pool.ANY, 64)]):
        p.add_worker(spec(i, pool, max_len=max_len), 0.0)
    p.update_worker("w0", 0.0, healthy=False)
    a = ask_for(p, job("j"))
    ws = takes_work(a, list(p.models["m"].workers.values()))
    assert [w.spec.worker_id for w in ws] == ["w1", "w2"]  # w0 is unhealthy
    cands = fits(a, ws)
    assert [c[0].spec.worker_id for c in cands] == ["w1"] and not a.kv_short  # w2: context too short, not KV
    big = ask_for(p, job("big", prompt=2000, max_tokens=64))
    assert fits(big, ws) == [] and big.kv_short  # w1 lacks the KV: another draw may help
    # a short job prefers a short worker to an "any" one
    p.update_worker("w0", 0.0, healthy=True)
    both = fits(a, takes_work(a, list(p.models["m"].workers.values())))
    assert [c[0].spec.worker_id for c in preferred_pool(a, both)] == ["w1"]


def test_class_headroom_keeps_room_for_higher_classes():
    p = Policy(SchedulerConfig(prefix_affinity=False))
    p.add_worker(spec(0, seqs=4), 0.0)
    w = p.models["m"].workers["w0"]
    a = ask_for(p, job("j"), limit=0.5)  # the class may fill half of the slots
    cand: Candidate = (w, 128, 128, 1)
    assert class_headroom(a, [cand]) == [cand]
    assert class_headroom(a, [(w, 128, 128, 2)]) == []  # at its cap of 2 slots
    assert class_headroom(a, [(w, 128, 128, 0)]) == [(w, 128, 128, 0)]  # an empty worker takes any job that fits
    assert not a.kv_short
    assert class_headroom(a, [(w, 128, w.budget, 1)]) == [] and a.kv_short  # over half the KV budget


def test_ties_go_to_the_lowest_worker_id():
    p = Policy(SchedulerConfig(prefix_affinity=False))
    for i in (2, 0, 1):
        p.add_worker(spec(i), 0.0)
    assert p.submit(job("j"), 0.0) is None
    assert placed(p) == {"j": "w0"}


def test_a_scorer_added_to_the_list_takes_part_in_placement():
    p = Policy(SchedulerConfig(prefix_affinity=False))
    for i in range(3):
        p.add_worker(spec(i), 0.0)

    def prefers_w2(ask: Ask, cands: list[Candidate]) -> list[float]:
        return [10.0 if w.spec.worker_id == "w2" else 0.0 for w, _, _, _ in cands]

    p.placement.load = (*p.placement.load, prefers_w2)
    assert p.submit(job("j"), 0.0) is None
    assert placed(p) == {"j": "w2"}  # least loaded alone would take w0
