"""deploy/k8s/ on real processes: the metrics the autoscalers query exist in a
running router's /metrics, and the worker pod's k8s path (--instance-id, the
probe, preStop drain) and every container as rendered work on real processes.
The rendering and offline validation of the manifests: tests/unit/test_k8s.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests

from deploy import k8s
from shared.config import DEFAULT_CONFIG, load
from stackutil import REPO

# Named by the GPU telemetry work, not served by a router without GPUs.
GPU_METRICS = {"weir_gpu_utilization_percent", "weir_gpu_memory_used_bytes", "weir_gpu_memory_total_bytes",
               "weir_gpu_temperature_celsius", "weir_gpu_power_watts"}


@pytest.fixture(scope="module")
def cfg():
    return load(DEFAULT_CONFIG)


def _by(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bweir_[a-z_]+\b", text))


def exposed_names(metrics_text: str) -> set[str]:
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
    return names


def test_autoscaler_metrics_exist_in_a_running_routers_metrics(cfg, sim_stack):
    used = set()
    for so in _by(k8s.built(cfg, "gpu"), "ScaledObject"):
        for t in so["spec"]["triggers"]:
            used |= metric_names(t["metadata"]["query"])
    assert "weir_model_queue_depth" in used
    exposed = exposed_names(requests.get(sim_stack.metrics_url, timeout=5).text)
    assert used - GPU_METRICS <= exposed, f"not in /metrics: {sorted(used - GPU_METRICS - exposed)}"


def test_worker_pod_path_instance_id_probe_and_drain(sim_stack):
    """What a worker pod runs: a [[workers]] entry under another id, the readiness
    probe as the router sees it, preStop's drain, then SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WEIR_CONFIG": str(sim_stack.cfg_path),
           "POD_NAME": "weir-worker-sim-tiny-1"}
    probe = [sys.executable, "-m", "deploy.k8s_probe"]
    assert subprocess.run([*probe, "ready"], env=env, capture_output=True).returncode == 1  # not there yet
    proc = subprocess.Popen([sys.executable, "-m", "engine_worker", "--worker-id", "sim-0",
                             "--instance-id", "weir-worker-sim-tiny-1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run([*probe, "ready"], env=env, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "the worker never became ready at the router"
            assert proc.poll() is None
            time.sleep(0.2)
        one = requests.get(sim_stack.router_url + "/admin/workers/weir-worker-sim-tiny-1", timeout=5).json()
        assert one["state"] == "ready" and one["model"] == "sim-tiny" and one["running"] == 0
        gone = requests.get(sim_stack.router_url + "/admin/workers/no-such-pod", timeout=5)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
        ids = {w["id"] for w in requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()}
        assert {"sim-0", "weir-worker-sim-tiny-1"} <= ids  # both registered: distinct identities
        out = subprocess.run([*probe, "drain"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "drained"
        workers = {w["id"]: w for w in requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()}
        assert workers["weir-worker-sim-tiny-1"]["state"] == "draining"
        assert workers["sim-0"]["state"] == "ready"
        assert subprocess.run([*probe, "ready"], env=env, capture_output=True).returncode == 1
        # what WeirWorkerDrainingTooLong and the dashboard read
        metrics = requests.get(sim_stack.metrics_url, timeout=5).text
        assert 'weir_worker_draining{model="sim-tiny",worker="weir-worker-sim-tiny-1"} 1.0' in metrics
        assert 'weir_worker_draining{model="sim-tiny",worker="sim-0"} 0.0' in metrics
        assert 'weir_worker_drain_left_seconds{model="sim-tiny",worker="weir-worker-sim-tiny-1"}' in metrics
        assert 'weir_model_ready_workers{model="sim-tiny"} 1.0' in metrics
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends after preStop
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while "weir-worker-sim-tiny-1" in {w["id"] for w in requests.get(sim_stack.router_url + "/admin/workers",
                                                                     timeout=5).json()}:
        assert time.monotonic() < deadline, "the drained worker's Goodbye did not remove it"
        time.sleep(0.1)



def _envoy_router_healthy(admin_port: int) -> bool:
    from deploy.envoy_config import ROUTER_CLUSTER
    body = requests.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=2).text
    return any(line.startswith(f"{ROUTER_CLUSTER}::") and line.endswith("::health_flags::healthy")
               for line in body.splitlines())


def test_pods_run_as_rendered(tmp_path):
    """The containers' own commands, environment, probes and preStop, run as local
    processes on the ConfigMap's files (all interfaces -> loopback, the routers'
    Service name -> 127.0.0.1, free ports): Envoy -> router -> worker serves."""
    from deploy.envoy_config import envoy_binary
    from stackutil import SIM_MODEL, sim_worker, write_config

    cfg_path = write_config(tmp_path, models=[{"name": SIM_MODEL, "engine": "sim", "max_model_len": 4096}],
                            workers=[sim_worker("sim-0")])
    cfg = load(cfg_path)
    objs = k8s.built(cfg)
    etc = tmp_path / "etc-weir"
    etc.mkdir()
    for name, text in _by(objs, "ConfigMap")[0]["data"].items():
        (etc / name).write_text(text.replace("0.0.0.0", "127.0.0.1").replace(k8s.routers_host(cfg), "127.0.0.1"))
    pod_name = "weir-worker-sim-tiny-0"

    def local(argv: list[str]) -> list[str]:
        out = [a.replace(k8s.CONFIG_DIR, str(etc)).replace("$(POD_NAME)", pod_name) for a in argv]
        return [sys.executable if out[0] == "python" else envoy_binary() if out[0] == "envoy" else out[0], *out[1:]]

    def container(kind: str, name: str) -> dict:
        return _by(objs, kind, name)[0]["spec"]["template"]["spec"]["containers"][0]

    worker = container("StatefulSet", "weir-worker-sim-tiny")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.update({e["name"]: e.get("value", pod_name).replace(k8s.CONFIG_DIR, str(etc)) for e in worker["env"]})
    procs: dict[str, subprocess.Popen] = {}
    try:
        for key, c in (("router", container("Deployment", "weir-router")), ("worker", worker),
                       ("envoy", container("Deployment", "weir-envoy"))):
            procs[key] = subprocess.Popen(local(c["command"]), env=env, cwd=REPO, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{key}.log", "wb"))

        def probe_ok(c: dict, kind: str) -> bool:
            p = c[kind]
            if "exec" in p:
                return subprocess.run(local(p["exec"]["command"]), env=env, cwd=REPO, capture_output=True).returncode == 0
            try:
                return requests.get(f"http://127.0.0.1:{p['httpGet']['port']}{p['httpGet']['path']}", timeout=2).ok
            except requests.ConnectionError:
                return False

        router, envoy = container("Deployment", "weir-router"), container("Deployment", "weir-envoy")
        deadline = time.monotonic() + 60
        for c, kind in ((worker, "startupProbe"), (worker, "readinessProbe"), (router, "livenessProbe"),
                        (router, "readinessProbe"), (envoy, "readinessProbe")):
            while not probe_ok(c, kind):
                dead = {k: p.returncode for k, p in procs.items() if p.poll() is not None}
                assert not dead, f"exited: {dead}; {(tmp_path / 'router.log').read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"{c['name']} {kind} never passed"
                time.sleep(0.2)
        # Envoy's readiness is Envoy's own (/ready), not its routers': a probe
        # through the rate-limited route would take every Envoy out under
        # overload.  Its health check of the router runs every interval, so the
        # router's turning ready reaches Envoy up to one interval later (CI
        # once sent in that gap and got Envoy's 503 "no healthy upstream").
        admin = next(p["containerPort"] for p in envoy["ports"] if p["name"] == "admin")
        while not _envoy_router_healthy(admin):
            assert time.monotonic() < deadline, "Envoy never saw the router healthy"
            time.sleep(0.2)
        port = next(p["containerPort"] for p in envoy["ports"] if p["name"] == "http")
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=10,
                          json={"model": SIM_MODEL, "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        stop = subprocess.run(local(worker["lifecycle"]["preStop"]["exec"]["command"]), env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert stop.stdout.strip() == "drained"
        assert not probe_ok(worker, "readinessProbe")
        procs["worker"].send_signal(signal.SIGTERM)
        grace = _by(objs, "StatefulSet", "weir-worker-sim-tiny")[0]["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"]
        assert procs["worker"].wait(timeout=grace) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
