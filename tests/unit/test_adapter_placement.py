"""Adapter-aware placement (router/policy/adapter_placement.py) through the real policy,
the worker's account of its adapters (engine_worker/lora_cache.py), and adapter churn:
loads per 1,000 requests under adapter-aware placement vs least loaded vs round robin."""

from __future__ import annotations

import random

import msgspec

from engine_worker.lora_cache import LoraCache
from router.policy import PLACE_SCAN_ALL, DispatchJob, Job, Policy, WorkerSpec
from router.policy.adapter_placement import FREE_SLOT, HELD_CACHE, HELD_SLOT, LOAD_TIMEOUT_S, AdapterPlacement
from shared.config import SchedulerConfig
from shared.protocol import LoraHeld, Pool, TaskType, WorkerStats


def _cfg(**kw) -> SchedulerConfig:
    return msgspec.structs.replace(SchedulerConfig(), **kw)


def _spec(wid: str, seqs: int = 8) -> WorkerSpec:
    return WorkerSpec(
        worker_id=wid,
        model="m",
        pool=Pool.ANY,
        capacity_tokens=1 << 20,
        block_size=16,
        max_num_seqs=seqs,
        max_model_len=2048,
        gpu_total_bytes=0,
    )


_n = 0


def _job(lora: int, t: float = 0.0) -> Job:
    global _n
    _n += 1
    return Job(f"j{_n}", "m", "t", "normal", 32, 16, TaskType.AUTO, t, lora_id=lora)


def _placed(p: Policy, job: Job, now: float = 0.0) -> str | None:
    assert p.submit(job, now) is None
    got = [a.worker_id for a in p.schedule(now) if isinstance(a, DispatchJob) and a.job_id == job.job_id]
    return got[0] if got else None


def test_lora_cache_mirrors_lru_slots_and_cache():
    c = LoraCache(slots=2, cache=3)
    assert c.held() is None  # nothing: the heartbeat leaves the field out
    for lora in (1, 2, 3, 1, 4):
        c.touch(lora)
    # most recent two in slots, the rest of the three most recent in the cache; 2 evicted
    assert c.held() == LoraHeld(slot=[1, 4], cache=[3], slots=2)


def test_bonus_order_and_the_loads_in_flight_bound():
    a = AdapterPlacement(max_loads=1)
    a.report("w", LoraHeld(slot=[1], cache=[2], slots=2), 0.0)
    assert a.bonus("w", 1) == HELD_SLOT > a.bonus("w", 2) == HELD_CACHE > a.bonus("w", 3) == FREE_SLOT
    a.report("w", LoraHeld(slot=[1, 5], cache=[2], slots=2), 0.0)
    assert a.bonus("w", 3) == 0.0  # no free slot: an eviction
    a.dispatched("w", 3, 1.0)
    assert a.loads == 1
    assert a.bonus("w", 4) is None  # one load in flight: no second one there
    assert a.bonus("w", 3) == HELD_CACHE  # joining the load in flight costs none
    a.report("w", LoraHeld(slot=[1, 3], cache=[2, 5], slots=2), 2.0)  # loaded
    assert a.bonus("w", 4) == 0.0 and a.held("w") == ([1, 3], [2, 5], [])
    a.dispatched("w", 4, 3.0)
    assert a.bonus("w", 6) is None
    a.report("w", LoraHeld(slot=[1, 3], cache=[2, 5], slots=2), 3.0 + LOAD_TIMEOUT_S + 1)
    assert a.bonus("w", 6) == 0.0  # a load never confirmed stops counting
    a.remove_worker("w")
    assert a.bonus("w", 1) == 0.0


def test_policy_prefers_the_worker_holding_the_adapter_then_a_free_slot():
    p = Policy(_cfg())
    for wid in ("a", "b", "c"):
        p.add_worker(_spec(wid), 0.0)
    ad = p.placement.adapters
    ad.report("a", LoraHeld(slot=[9], slots=1), 0.0)
    ad.report("b", LoraHeld(slot=[7], slots=1), 0.0)
    ad.report("c", LoraHeld(slot=[], cache=[8], slots=1), 0.0)
    assert _placed(p, _job(7)) == "b"  # b is as loaded as the others after... it holds 7
    assert _placed(p, _job(7)) == "b"  # still b: one job there is less than the bonus
    assert _placed(p, _job(8)) == "c"  # in c's cache
    assert _placed(p, _job(0)) == "a"  # no adapter: least loaded, as ever
    # adapter-blind when configured so: the least loaded (a and c hold one job each, b two)
    blind = Policy(_cfg(adapter_affinity=False))
    for wid in ("a", "b"):
        blind.add_worker(_spec(wid), 0.0)
    blind.placement.adapters.report("b", LoraHeld(slot=[7], slots=1), 0.0)
    assert _placed(blind, _job(7)) == "a"


def test_policy_bounds_loads_in_flight_per_worker():
    p = Policy(_cfg(adapter_loads_in_flight=1))
    p.add_worker(_spec("a"), 0.0)
    assert _placed(p, _job(1)) == "a"  # a load of adapter 1 in flight on a
    assert _placed(p, _job(1)) == "a"  # the same adapter joins it
    second = _job(2)
    assert _placed(p, second) is None  # another load waits for the first
    p.placement.adapters.report("a", LoraHeld(slot=[1], slots=2), 1.0)  # 1 loaded
    got = [a.worker_id for a in p.schedule(1.0) if isinstance(a, DispatchJob) and a.job_id == second.job_id]
    assert got == ["a"]


def test_heartbeat_field_is_left_out_when_nothing_is_held():
    plain = msgspec.msgpack.encode(WorkerStats(running=1))
    assert msgspec.msgpack.decode(plain, type=WorkerStats).loras is None
    held = WorkerStats(running=1, loras=LoraHeld(slot=[3], slots=2))
    assert len(msgspec.msgpack.encode(held)) > len(plain)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(held), type=WorkerStats).loras == held.loras


LOAD_ROUNDS = 2.0  # a load from disk before a job's first token (a job runs 8-24 rounds)
ACTIVATE_ROUNDS = 0.25  # a copy from the host-memory cache into a slot


def test_a_sampled_placement_scores_the_workers_holding_the_adapter():
    # beyond PLACE_SCAN_ALL workers placement scores a sample of 4: the one worker holding the
    # job's adapter is added to it (else a load elsewhere ~96 % of the time)
    p = Policy(_cfg())
    n = PLACE_SCAN_ALL * 4
    for i in range(n):
        p.add_worker(_spec(f"w{i:03d}", seqs=4), 0.0)
    for i in range(n):  # every worker reports its adapters: w017 holds 7 in a slot, the rest other ones
        p.placement.adapters.report(f"w{i:03d}", LoraHeld(slot=[7 if i == 17 else 100 + i], slots=1), 0.0)
    placed = []
    for t in range(1, 21):
        j = _job(7, float(t))
        placed.append(_placed(p, j, float(t)))
        p.finish(j.job_id, float(t))
    assert placed == ["w017"] * 20
    assert p.placement.adapters.holders(7) == ["w017"]
    p.placement.adapters.report("w017", LoraHeld(slot=[8], slots=1), 30.0)  # evicted: no holder left
    assert p.placement.adapters.holders(7) == []
    p.placement.adapters.dispatched("w003", 7, 31.0)  # on its way there: a holder too
    assert p.placement.adapters.holders(7) == ["w003"]
    p.placement.adapters.remove_worker("w003")
    assert p.placement.adapters.holders(7) == []


def _churn(placement: str, affinity: bool, *, workers=8, adapters=32, slots=4, requests=4000, seed=1):
    """Requests under Zipf-popular adapters through the real policy onto workers whose
    engines hold ``slots`` adapters (their LoraCache, reported back as heartbeats do);
    each job runs a few scheduling rounds.  Loads: a job whose worker held its adapter
    neither in a slot nor in its cache when it started there (a load from disk);
    activations: not in a slot (a copy from the cache, or a load).  TTFT (in rounds,
    one request arrives per round): its wait in the queue, plus LOAD_ROUNDS for a load
    or ACTIVATE_ROUNDS for an activation (its run, and its seq on the worker, start after)."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(adapters)]  # Zipf, s = 1
    p = Policy(_cfg(placement=placement, adapter_affinity=affinity, adapter_loads_in_flight=2))
    caches = {f"w{i}": LoraCache(slots, slots * 2) for i in range(workers)}
    for wid in caches:
        p.add_worker(_spec(wid, seqs=4), 0.0)
    running: list[tuple[float, str]] = []  # (ends at, job id)
    lora_of: dict[str, int] = {}
    submitted: dict[str, float] = {}
    ttfts: list[float] = []
    loads = activations = 0
    t = 0.0
    for _ in range(requests):
        t += 1.0
        for end, jid in [x for x in running if x[0] <= t]:
            p.finish(jid, t)
            running.remove((end, jid))
        j = _job(1 + rng.choices(range(adapters), weights)[0], t)
        lora_of[j.job_id] = j.lora_id
        submitted[j.job_id] = t
        p.submit(j, t)
        for a in p.schedule(t):
            if isinstance(a, DispatchJob):
                cache = caches[a.worker_id]
                held = cache.held()
                lora = lora_of[a.job_id]
                first = t
                if held is None or lora not in held.slot:
                    activations += 1
                    first += ACTIVATE_ROUNDS
                    if held is None or lora not in held.cache:
                        loads += 1
                        first += LOAD_ROUNDS - ACTIVATE_ROUNDS
                cache.touch(lora_of[a.job_id])
                ttfts.append(first - submitted[a.job_id])
                running.append((first + rng.uniform(8.0, 24.0), a.job_id))
        for wid, cache in caches.items():  # heartbeats
            p.placement.adapters.report(wid, cache.held(), t)
    p90 = sorted(ttfts)[int(0.9 * len(ttfts))]
    return 1000.0 * loads / requests, 1000.0 * activations / requests, p90


def test_adapter_aware_placement_loads_far_less_than_round_robin_and_least_loaded():
    (aware, aware_act, aware_p90), (least, least_act, least_p90), (rr, rr_act, rr_p90) = (
        _churn("least_loaded", True),
        _churn("least_loaded", False),
        _churn("round_robin", False),
    )
    print(
        f"\nper 1,000 requests (32 adapters, Zipf; 8 workers, 4 slots, 8 cached): loads from disk: adapter-aware"
        f" {aware:.0f}, least loaded {least:.0f}, round robin {rr:.0f}; slot activations: {aware_act:.0f},"
        f" {least_act:.0f}, {rr_act:.0f}; p90 TTFT (rounds; a load {LOAD_ROUNDS:g}, an activation"
        f" {ACTIVATE_ROUNDS:g}): {aware_p90:.2f}, {least_p90:.2f}, {rr_p90:.2f}"
    )
    assert aware * 5 <= rr and aware * 5 <= least
    assert aware_act * 3 <= rr_act and aware_act * 3 <= least_act
    assert aware_p90 < least_p90 and aware_p90 < rr_p90


def test_predicted_wait_counts_a_load_when_no_worker_holds_the_adapter():
    def predicted(lora: int) -> float:
        p = Policy(_cfg(adapter_load_s=0.5))
        p.add_worker(_spec("a"), 0.0)
        p.add_worker(_spec("b"), 0.0)
        p.placement.adapters.report("b", LoraHeld(slot=[7], cache=[6], slots=1), 0.0)
        p.placement.adapters.dispatched("a", 5, 0.0)  # on its way to a
        j = _job(lora)
        assert p.submit(j, 0.0) is None
        return p.table.entries[j.job_id].predicted

    assert predicted(8) == 0.5  # nobody holds it: one load
    assert predicted(7) == predicted(6) == predicted(5) == predicted(0) == 0.0
