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
import threading
import time

import hostsfile
import pytest
import requests
from stackutil import REPO

from deploy import k8s
from shared.config import DEFAULT_CONFIG, load

# Named by the GPU telemetry work, not served by a router without GPUs.
GPU_METRICS = {
    "weir_gpu_utilization_percent",
    "weir_gpu_memory_used_bytes",
    "weir_gpu_memory_total_bytes",
    "weir_gpu_temperature_celsius",
    "weir_gpu_power_watts",
}


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
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "WEIR_CONFIG": str(sim_stack.cfg_path),
        "POD_NAME": "weir-worker-sim-tiny-1",
    }
    probe = [sys.executable, "-m", "deploy.k8s_probe"]
    assert subprocess.run([*probe, "ready"], env=env, capture_output=True).returncode == 1  # not there yet
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_worker", "--worker-id", "sim-0", "--instance-id", "weir-worker-sim-tiny-1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        process_group=0,
    )
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
    while "weir-worker-sim-tiny-1" in {
        w["id"] for w in requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()
    }:
        assert time.monotonic() < deadline, "the drained worker's Goodbye did not remove it"
        time.sleep(0.1)


def _envoy_healthy_routers(admin_port: int) -> int:
    from deploy.envoy_config import ROUTER_CLUSTER

    body = requests.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=2).text
    return sum(
        line.startswith(f"{ROUTER_CLUSTER}::") and line.endswith("::health_flags::healthy")
        for line in body.splitlines()
    )


ROUTER_IPS = ["127.0.0.1", "127.0.0.2"]  # two router pods: one address each, the same ports


def _secret_files(cfg) -> dict[str, dict[str, str]]:
    """What the printed `kubectl create secret` commands put in each Secret: name -> key -> local file."""
    from deploy.k8s_security import secret_commands

    out: dict[str, dict[str, str]] = {}
    for cmd in secret_commands(cfg, k8s.worker_groups(cfg)):
        files = out.setdefault(cmd[6], {})
        for arg in cmd[7:]:
            flag, _, value = arg.partition("=")
            if flag == "--from-file":
                key, _, path = value.partition("=")
                files[key] = path
            else:  # secret tls --cert / --key
                files["tls.crt" if flag == "--cert" else "tls.key"] = value
    return out


def _mount(volume: dict, secrets: dict[str, dict[str, str]], where) -> None:
    """A pod's Secret volume as the kubelet lays it out, from the Secrets' files."""
    import shutil

    if "projected" in volume:
        items = [
            (src["secret"]["name"], i["key"], i["path"])
            for src in volume["projected"]["sources"]
            for i in src["secret"]["items"]
        ]
    else:
        name = volume["secret"]["secretName"]
        items = [(name, key, key) for key in secrets[name]]
    for name, key, path in items:
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(secrets[name][key], where / path)


@pytest.mark.skipif(not hostsfile.writable(), reason="needs a writable /etc/hosts (root) for the Service name")
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")  # a self-signed test certificate
def test_pods_run_as_rendered(tmp_path):
    """The containers' own commands, environment, probes, Secret volumes and
    preStop hooks, run as local processes on the ConfigMap's files, with CURVE
    on both ZeroMQ planes and TLS at Envoy: two router pods (127.0.0.1 and
    127.0.0.2, the same ports, behind one name as the headless Service), a
    worker pod that finds both by that name, Envoy over both; then Envoy's
    preStop under a stream (it completes; the listener closes after), the
    worker's preStop drain at both routers, SIGTERM."""
    from stackutil import SIM_MODEL, sim_worker, write_config

    from bench.localconfig import free_port
    from deploy.envoy_config import envoy_binary
    from deploy.k8s_security import CURVE_DIR, TLS_DIR
    from shared import curve

    keys = tmp_path / "keys"
    admin_token = "adm-" + "7" * 40
    (tmp_path / "admin.token").write_text(admin_token + "\n")
    curve.generate(keys, ["sim-0"], ["client"])
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(tmp_path / "tls.key"),
            "-out",
            str(tmp_path / "tls.crt"),
        ],
        check=True,
        capture_output=True,
    )
    cfg_path = write_config(
        tmp_path,
        models=[{"name": SIM_MODEL, "engine": "sim", "max_model_len": 4096}],
        workers=[sim_worker("sim-0", discovery_interval_s=0.5)],
        router={
            "heartbeat_interval_s": 0.25,
            "admin_token_file": str(tmp_path / "admin.token"),
            "admin_http": f"127.0.0.1:{free_port()}",
        },
        security={"curve": True, "curve_dir": str(keys)},
        envoy={"tls_cert_file": str(tmp_path / "tls.crt"), "tls_key_file": str(tmp_path / "tls.key")},
        kubernetes={"endpoint_propagation_s": 1, "allow_anonymous": True},
    )
    cfg = load(cfg_path)
    objs = k8s.built(cfg)
    secrets = _secret_files(cfg)
    data = _by(objs, "ConfigMap")[0]["data"]
    hosts = hostsfile.HostsName()
    pod_name = "weir-worker-sim-tiny-0"

    def pod_spec(kind: str, name: str) -> dict:
        return _by(objs, kind, name)[0]["spec"]["template"]["spec"]

    # each pod's filesystem: the ConfigMap at CONFIG_DIR, its Secret volumes at their mount paths
    pods = {
        "router-0": ("Deployment", "weir-router", ROUTER_IPS[0]),
        "router-1": ("Deployment", "weir-router", ROUTER_IPS[1]),
        "worker": ("StatefulSet", "weir-worker-sim-tiny", "127.0.0.1"),
        "envoy": ("Deployment", "weir-envoy", "127.0.0.1"),
    }
    paths: dict[str, dict[str, str]] = {}
    for key, (kind, name, ip) in pods.items():
        spec = pod_spec(kind, name)
        root = tmp_path / key
        paths[key] = {k8s.CONFIG_DIR: str(root / "etc-weir")}
        for m in spec["containers"][0]["volumeMounts"]:
            vol = next(v for v in spec["volumes"] if v["name"] == m["name"])
            if "secret" in vol or "projected" in vol:
                local = root / m["mountPath"].strip("/").replace("/", "-")
                _mount(vol, secrets, local)
                paths[key][m["mountPath"]] = str(local)
            elif "persistentVolumeClaim" in vol:  # one directory for every pod, as a ReadWriteMany claim is
                shared = tmp_path / "pvc" / vol["persistentVolumeClaim"]["claimName"]
                shared.mkdir(parents=True, exist_ok=True)
                paths[key][m["mountPath"]] = str(shared)
        (root / "etc-weir").mkdir(parents=True)
        for fname, text in data.items():
            for pod_path, local in paths[key].items():
                text = text.replace(pod_path, local)
            (root / "etc-weir" / fname).write_text(
                text.replace("0.0.0.0", ip).replace(k8s.routers_host(cfg), hosts.name)
            )
    assert (
        {CURVE_DIR} <= set(paths["router-0"])
        and {CURVE_DIR} <= set(paths["worker"])
        and {TLS_DIR} <= set(paths["envoy"])
    )

    def local(key: str, argv: list[str]) -> list[str]:
        out = [a.replace(k8s.CONFIG_DIR, paths[key][k8s.CONFIG_DIR]).replace("$(POD_NAME)", pod_name) for a in argv]
        return [sys.executable if out[0] == "python" else envoy_binary() if out[0] == "envoy" else out[0], *out[1:]]

    worker = pod_spec("StatefulSet", "weir-worker-sim-tiny")["containers"][0]
    router = pod_spec("Deployment", "weir-router")["containers"][0]
    envoy = pod_spec("Deployment", "weir-envoy")["containers"][0]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    wenv = {
        **env,
        **{
            e["name"]: e.get("value", pod_name).replace(k8s.CONFIG_DIR, paths["worker"][k8s.CONFIG_DIR])
            for e in worker["env"]
        },
    }
    procs: dict[str, subprocess.Popen] = {}
    hosts.set(ROUTER_IPS)
    try:
        for key, c in (("router-0", router), ("router-1", router), ("worker", worker), ("envoy", envoy)):
            procs[key] = subprocess.Popen(
                local(key, c["command"]),
                env=wenv if key == "worker" else env,
                cwd=REPO,
                process_group=0,
                stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / f"{key}.log", "wb"),
            )

        def probe_ok(key: str, c: dict, kind: str) -> bool:
            p = c[kind]
            if "exec" in p:
                return (
                    subprocess.run(local(key, p["exec"]["command"]), env=wenv, cwd=REPO, capture_output=True).returncode
                    == 0
                )
            try:
                ip = pods[key][2]
                return requests.get(f"http://{ip}:{p['httpGet']['port']}{p['httpGet']['path']}", timeout=2).ok
            except requests.ConnectionError:
                return False

        def logs() -> str:
            return "\n".join(f"{k}: {(tmp_path / f'{k}.log').read_text()[-1500:]}" for k in procs)

        deadline = time.monotonic() + 60
        for key, c, kind in (
            ("worker", worker, "startupProbe"),
            ("worker", worker, "readinessProbe"),
            ("router-0", router, "livenessProbe"),
            ("router-0", router, "readinessProbe"),
            ("router-1", router, "readinessProbe"),
            ("envoy", envoy, "readinessProbe"),
        ):
            while not probe_ok(key, c, kind):
                dead = {k: p.returncode for k, p in procs.items() if p.poll() is not None}
                assert not dead, f"exited: {dead}; {logs()}"
                assert time.monotonic() < deadline, f"{key} {kind} never passed; {logs()}"
                time.sleep(0.2)
        http = next(p["containerPort"] for p in router["ports"] if p["name"] == "http")
        for ip in ROUTER_IPS:  # the worker found both routers by the one name, over CURVE
            w = requests.get(f"http://{ip}:{http}/admin/workers/{pod_name}", timeout=5).json()
            assert w["state"] == "ready", (ip, w)
        # the admin listener the probes use: the Secret's token opens it, another is refused, no API there
        admin_port = next(p["containerPort"] for p in router["ports"] if p["name"] == "admin")
        for ip in ROUTER_IPS:
            base = f"http://{ip}:{admin_port}"
            ok = requests.get(f"{base}/admin/workers", headers={"authorization": f"Bearer {admin_token}"}, timeout=5)
            assert ok.status_code == 200 and pod_name in {w["id"] for w in ok.json()}
            bad = requests.get(f"{base}/admin/workers", headers={"authorization": "Bearer nope"}, timeout=5)
            assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_admin_token"
            assert requests.get(f"{base}/v1/models", timeout=5).status_code == 404
            assert requests.get(f"{base}/metrics", timeout=5).status_code == 200
        # Envoy's readiness is Envoy's own (/ready), not its routers': a probe
        # through the rate-limited route would take every Envoy out under
        # overload.  Its health checks reach each router up to an interval later.
        admin = next(p["containerPort"] for p in envoy["ports"] if p["name"] == "admin")
        while _envoy_healthy_routers(admin) < 2:
            assert time.monotonic() < deadline, "Envoy never saw both routers healthy"
            time.sleep(0.2)
        port = next(p["containerPort"] for p in envoy["ports"] if p["name"] == "http")
        url = f"https://127.0.0.1:{port}/v1/completions"
        for _ in range(4):
            r = requests.post(
                url, timeout=10, verify=False, json={"model": SIM_MODEL, "prompt": "hello", "max_tokens": 4}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(requests.ConnectionError):  # TLS only
            requests.post(url.replace("https", "http"), timeout=5, json={"model": SIM_MODEL, "prompt": "x"})
        # a Batch API file uploaded through one router replica is the other's too (the batch claim)
        up = requests.post(
            f"http://{ROUTER_IPS[0]}:{http}/v1/files",
            timeout=10,
            data={"purpose": "batch"},
            files={
                "file": (
                    "in.jsonl",
                    b'{"custom_id": "a", "method": "POST", "url": '
                    b'"/v1/completions", "body": {"model": "m", "prompt": "x"}}\n',
                )
            },
        )
        assert up.status_code == 200, up.text
        got = requests.get(f"http://{ROUTER_IPS[1]}:{http}/v1/files/{up.json()['id']}/content", timeout=10)
        assert got.status_code == 200 and got.content.startswith(b'{"custom_id": "a"'), got.text

        # Envoy's preStop under a stream: the stream completes, then the listener is gone
        stream = {}

        def read_stream() -> None:
            with requests.post(
                url,
                timeout=30,
                verify=False,
                stream=True,
                json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 1500, "stream": True},
            ) as resp:
                stream["body"] = resp.content.decode()

        t = threading.Thread(target=read_stream)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        stop = subprocess.run(
            local("envoy", envoy["lifecycle"]["preStop"]["exec"]["command"]),
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=envoy_grace(objs),
        )
        t.join(timeout=1)
        assert not t.is_alive(), "preStop returned before the stream in flight ended"
        assert stop.stdout.strip() == "drained", stop.stderr
        assert stream["body"].rstrip().endswith("data: [DONE]") and '"error"' not in stream["body"]
        print(f"\nEnvoy preStop: drained in {time.monotonic() - t0:.2f} s with a stream in flight")
        with pytest.raises(requests.ConnectionError):
            requests.post(url, timeout=5, verify=False, json={"model": SIM_MODEL, "prompt": "x"})
        procs["envoy"].send_signal(signal.SIGTERM)  # what the kubelet sends after preStop
        assert procs["envoy"].wait(timeout=10) == 0

        # the worker's preStop drains it at both routers
        stop = subprocess.run(
            local("worker", worker["lifecycle"]["preStop"]["exec"]["command"]),
            env=wenv,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.stdout.strip() == "drained"
        for ip in ROUTER_IPS:
            w = requests.get(f"http://{ip}:{http}/admin/workers/{pod_name}", timeout=5).json()
            assert w["state"] == "draining", (ip, w)
        assert not probe_ok("worker", worker, "readinessProbe")
        procs["worker"].send_signal(signal.SIGTERM)
        grace = _by(objs, "StatefulSet", "weir-worker-sim-tiny")[0]["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        assert procs["worker"].wait(timeout=grace) == 0
    finally:
        hosts.set([])
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def envoy_grace(objs) -> int:
    return _by(objs, "Deployment", "weir-envoy")[0]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
