"""GPU telemetry on a real sim stack: the "no GPU" state and a peer's GPU
readings (engine_worker/gpu.py -> heartbeats -> /metrics, /admin/workers).
The gate's threshold logic and the probe script: tests/unit/test_gpu_telemetry.py."""

from __future__ import annotations

import requests

from shared.protocol import GpuInfo, Heartbeat, Pool, WorkerStats, encoder

GPU_METRICS = (
    "weir_gpu_utilization_percent",
    "weir_gpu_memory_used_bytes",
    "weir_gpu_memory_total_bytes",
    "weir_gpu_temperature_celsius",
    "weir_gpu_power_watts",
)
GIB = 1 << 30


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


def test_no_gpu_is_an_explicit_state_in_metrics_and_admin(sim_stack):
    workers = requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()
    w = next(w for w in workers if w["id"] == "sim-0")
    assert w["gpu_present"] is False and w["gpu_block"] is None and w["healthy"] is True
    assert w["gpu_temperature_celsius"] is None and w["gpu_utilization_percent"] is None
    text = requests.get(sim_stack.metrics_url, timeout=5).text
    assert 'weir_gpu_present{model="sim-tiny",worker="sim-0"} 0.0' in text
    for name in GPU_METRICS:
        assert f"# TYPE {name} gauge" in text  # declared (alert rules, HPA) ...
        assert f'{name}{{model="sim-tiny",worker="sim-0"}}' not in text  # ... never a made-up 0 reading


def test_a_gpu_workers_readings_reach_metrics_and_admin(sim_stack):
    """A peer speaking the worker protocol (this host has no GPU to read) sends
    a GPU reading in its heartbeat: the real router shows it under the names
    the alert rules and autoscaling use."""
    import time

    import zmq

    from shared.protocol import Goodbye, Register

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"gpu-peer-0")
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(sim_stack.cfg.router.backend)
    try:
        # a 1-token KV budget: this peer never fits a request, so nothing of other tests lands on it
        sock.send(
            encoder.encode(Register("gpu-peer-0", "sim-tiny", Pool.ANY, 512, 1, 16, 1, "sim", gpu=reading(temp=71.5)))
        )
        sock.send(encoder.encode(Heartbeat(WorkerStats(gpu=reading(temp=72.5, used=20 * GIB)))))
        deadline = time.monotonic() + 10
        while True:
            text = requests.get(sim_stack.metrics_url, timeout=5).text
            if 'weir_gpu_temperature_celsius{model="sim-tiny",worker="gpu-peer-0"} 72.5' in text:
                break
            assert time.monotonic() < deadline, "the heartbeat's reading never reached /metrics"
            time.sleep(0.1)
        from prometheus_client.parser import text_string_to_metric_families

        got = {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.labels.get("worker") == "gpu-peer-0" and s.name.startswith("weir_gpu_")
        }
        assert got == {
            "weir_gpu_present": 1.0,
            "weir_gpu_utilization_percent": 50.0,
            "weir_gpu_memory_used_bytes": 20 * GIB,
            "weir_gpu_memory_total_bytes": 80 * GIB,
            "weir_gpu_temperature_celsius": 72.5,
            "weir_gpu_power_watts": 300.0,
        }
        w = next(
            w
            for w in requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()
            if w["id"] == "gpu-peer-0"
        )
        assert w["gpu_present"] is True and w["gpu"] == "H100" and w["gpu_temperature_celsius"] == 72.5
    finally:
        sock.send(encoder.encode(Goodbye("test over")))
        sock.close()
        ctx.term()
    deadline = time.monotonic() + 5
    while any(w["id"] == "gpu-peer-0" for w in requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
