"""GPU telemetry (engine_worker/gpu.py -> heartbeats -> /metrics, /admin/workers)
and the GPU gate (router/policy/gpu_gate.py, consulted by the policy).

There is no GPU here: the threshold logic is pure and tested on readings, the
probe script reports NVML's absence; the "no GPU" state on a real sim stack is
tests/e2e/test_gpu_telemetry_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from stackutil import REPO

from router.policy import DispatchJob, Job, Policy, WorkerSpec
from router.policy.gpu_gate import FULL, HOT, gpu_block
from shared.config import SchedulerConfig
from shared.protocol import GpuInfo, Heartbeat, Pool, TaskType, WorkerStats, encoder, worker_decoder

GIB = 1 << 30


def sched(**kw) -> SchedulerConfig:
    return msgspec.structs.replace(SchedulerConfig(), **kw)


def reading(temp=60.0, used=10 * GIB, total=80 * GIB, present=True) -> GpuInfo:
    return GpuInfo(
        present=present,
        name="H100",
        index=0,
        total_bytes=total,
        used_bytes=used,
        utilization_percent=50.0,
        temperature_c=temp,
        power_w=300.0,
    )


# ------------------------------------------------------------------ the pure gate


def test_gate_thresholds():
    cfg = sched(gpu_max_temperature_c=85, gpu_max_memory_fraction=0.95)
    assert gpu_block(reading(), cfg) is None
    assert gpu_block(reading(temp=85), cfg) == HOT
    assert gpu_block(reading(temp=84.9), cfg) is None
    assert gpu_block(reading(used=int(0.95 * 80 * GIB)), cfg) == FULL
    assert gpu_block(reading(temp=90, used=80 * GIB), cfg) == HOT  # the first reason
    # no GPU, an unsupported reading, thresholds off: never a block
    assert gpu_block(GpuInfo(present=False), cfg) is None
    assert gpu_block(None, cfg) is None
    assert gpu_block(msgspec.structs.replace(reading(temp=99), temperature_c=None), cfg) is None
    assert gpu_block(reading(temp=99, used=80 * GIB), sched()) is None


@given(temp=st.floats(0, 120), frac=st.floats(0, 1), tmax=st.floats(0, 120), fmax=st.floats(0, 1))
def test_gate_blocks_exactly_over_a_threshold(temp, frac, tmax, fmax):
    total = 80 * GIB
    g = reading(temp=temp, used=int(frac * total), total=total)
    over = (tmax > 0 and temp >= tmax) or (fmax > 0 and int(frac * total) >= fmax * total)
    assert (gpu_block(g, sched(gpu_max_temperature_c=tmax, gpu_max_memory_fraction=fmax)) is not None) == over


def _policy_with_two_workers(**kw) -> Policy:
    p = Policy(sched(**kw))
    for wid in ("w0", "w1"):
        p.add_worker(
            WorkerSpec(
                worker_id=wid,
                model="m",
                pool=Pool.ANY,
                capacity_tokens=4096,
                block_size=16,
                max_num_seqs=8,
                max_model_len=2048,
                gpu_total_bytes=80 * GIB,
            ),
            0.0,
        )
    return p


def _job(jid: str, t: float) -> Job:
    return Job(
        job_id=jid,
        model="m",
        tenant="t",
        klass="normal",
        prompt_tokens=100,
        max_tokens=28,
        task_type=TaskType.AUTO,
        arrival=t,
    )


def test_policy_sends_no_new_work_to_a_hot_gpu_until_it_cools():
    p = _policy_with_two_workers(gpu_max_temperature_c=85)
    p.update_worker("w0", 0.0, gpu=reading(temp=91))
    p.update_worker("w1", 0.0, gpu=reading(temp=60))
    for i in range(6):
        p.submit(_job(f"a{i}", 0.0), 0.0)
    placed = [a.worker_id for a in p.schedule(0.0) if isinstance(a, DispatchJob)]
    assert placed == ["w1"] * 6
    snap = {w["id"]: w for w in p.snapshot(0.0)["workers"]}
    assert snap["w0"]["gpu_block"] == HOT and snap["w0"]["healthy"] is False
    assert snap["w1"]["gpu_block"] is None
    # both hot: work waits in the queue rather than going anywhere
    p.update_worker("w1", 1.0, gpu=reading(temp=88))
    p.submit(_job("b", 1.0), 1.0)
    assert not [a for a in p.schedule(1.0) if isinstance(a, DispatchJob)]
    # w0 cools: the queued job goes there
    p.update_worker("w0", 2.0, gpu=reading(temp=70))
    assert [(a.job_id, a.worker_id) for a in p.schedule(2.0) if isinstance(a, DispatchJob)] == [("b", "w0")]


def test_policy_memory_threshold_and_no_gpu_state():
    p = _policy_with_two_workers(gpu_max_memory_fraction=0.9)
    p.update_worker("w0", 0.0, gpu=reading(used=79 * GIB))  # 98.75 % used
    p.update_worker("w1", 0.0, gpu=GpuInfo(present=False))  # no GPU: never blocked
    p.submit(_job("a", 0.0), 0.0)
    assert [a.worker_id for a in p.schedule(0.0) if isinstance(a, DispatchJob)] == ["w1"]
    assert {w["id"]: w["gpu_block"] for w in p.snapshot(0.0)["workers"]} == {"w0": FULL, "w1": None}


def test_heartbeat_carries_the_reading_and_older_peers_still_decode():
    hb = Heartbeat(WorkerStats(running=2, gpu=reading()))
    back = worker_decoder.decode(encoder.encode(hb))
    assert back.stats.gpu == reading()
    old = worker_decoder.decode(encoder.encode(Heartbeat(WorkerStats(running=1))))  # a peer sending no reading
    assert old.stats.gpu is None


# ------------------------------------------------------------------ the real "no GPU" state


def test_probe_script_reports_no_gpu_as_json():
    out = subprocess.run(
        [sys.executable, "-m", "engine_worker.gpu", "--probe"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    if report["nvml"]:  # a GPU host: each reading is complete
        for g in report["gpus"]:
            assert g["present"] and g["total_bytes"] > 0 and g["read_ms"] >= 0
    else:
        assert report["error"] and report["gpus"] == [msgspec.structs.asdict(GpuInfo(present=False))]
