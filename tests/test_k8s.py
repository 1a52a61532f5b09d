"""deploy/k8s/: the checked-in manifests are the rendering of deploy/weir.toml,
every object validates offline (Kubernetes 1.32 schemas; KEDA's ScaledObject
against deploy/schemas/), the invariants that matter hold, and the worker pod's
k8s path (--instance-id, the probe, preStop drain) works on a real router."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jsonschema
import kubernetes_validate
import pytest
import requests
import yaml

from deploy import envoy_config, k8s
from shared.config import DEFAULT_CONFIG, ConfigError, load, loads
from stackutil import REPO

K8S_DIR = REPO / "deploy" / "k8s"
KEDA_SCHEMA = json.loads((REPO / "deploy" / "schemas" / "keda-scaledobject.schema.json").read_text())
K8S_VERSION = "1.32"
OVERLAYS = [None, "cpu-demo", "gpu"]
# Named by the GPU telemetry work (issue 11 part B), not served by this branch's router.
GPU_METRICS = {"weir_gpu_utilization_percent", "weir_gpu_memory_used_bytes", "weir_gpu_memory_total_bytes",
               "weir_gpu_temperature_celsius", "weir_gpu_power_watts"}


@pytest.fixture(scope="module")
def cfg():
    return load(DEFAULT_CONFIG)


def _validate(obj: dict) -> None:
    if obj["kind"] == "ScaledObject":
        jsonschema.validate(obj, KEDA_SCHEMA)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _by(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def test_checked_in_manifests_are_the_rendering_of_the_default_config(cfg):
    fresh = k8s.files(cfg)
    on_disk = {p.relative_to(K8S_DIR).as_posix() for p in K8S_DIR.rglob("*.yaml")}
    assert on_disk == set(fresh), "deploy/k8s is stale: run `weir render-k8s`"
    for rel, text in fresh.items():
        assert (K8S_DIR / rel).read_text() == text, f"deploy/k8s/{rel} is stale: run `weir render-k8s`"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_its_schema(cfg, overlay):
    objs = k8s.built(cfg, overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap", "NetworkPolicy",
            "CronJob", "ScaledObject"} <= kinds
    for o in objs:
        _validate(o)


def test_validation_would_catch_a_broken_manifest(cfg):
    objs = k8s.built(cfg)
    sts = copy.deepcopy(_by(objs, "StatefulSet")[0])
    sts["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSeconds"] = "ten"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(sts)
    sts = copy.deepcopy(_by(objs, "StatefulSet")[0])
    sts["spec"]["template"]["spec"]["containers"][0]["preStopp"] = {}  # strict: unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(sts)
    so = copy.deepcopy(_by(objs, "ScaledObject")[0])
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 12  # KEDA's metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        _validate(so)
    so = copy.deepcopy(_by(objs, "ScaledObject")[0])
    so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] = 7200
    with pytest.raises(jsonschema.ValidationError):
        _validate(so)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_builds_what_the_renderer_validated(cfg, overlay):
    """The objects validated above are what `kubectl kustomize` makes of the files."""
    path = K8S_DIR / ("base" if overlay is None else f"overlays/{overlay}")
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True).stdout

    def norm(v):
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):  # kustomize moves patched list items first: compare by key
            v = [norm(x) for x in v]
            if v and all(isinstance(x, dict) and ("name" in x or "mountPath" in x) for x in v):
                v = sorted(v, key=lambda x: str(x.get("name", x.get("mountPath"))))
        return v

    theirs = {(o["kind"], o["metadata"]["name"]): norm(o) for o in yaml.safe_load_all(out)}
    mine = {(o["kind"], o["metadata"]["name"]): norm(o) for o in k8s.built(cfg, overlay)}
    assert theirs == mine


def test_router_deployment_probes_pdb_and_headless_service(cfg):
    objs = k8s.built(cfg)
    dep = _by(objs, "Deployment", "weir-router")[0]
    assert dep["spec"]["replicas"] >= 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    pdb = _by(objs, "PodDisruptionBudget", "weir-router")[0]
    assert pdb["spec"]["minAvailable"] == 1 and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = _by(objs, "Service", k8s.ROUTERS_SERVICE)[0]["spec"]
    # headless, and listing routers that are not ready yet: a router is ready only once a worker found it
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"].items() <= labels.items()
    assert {p["port"] for p in svc["ports"]} >= {5556, 8001}


def test_worker_statefulsets_probes_drain_and_grace(cfg):
    objs = k8s.built(cfg)
    groups = {g.name: g for g in k8s.worker_groups(cfg)}
    sets = _by(objs, "StatefulSet")
    assert {s["metadata"]["name"] for s in sets} == set(groups) == {"weir-worker-tiny-llama", "weir-worker-sim-tiny"}
    for s in sets:
        g = groups[s["metadata"]["name"]]
        pod = s["spec"]["template"]["spec"]
        c = pod["containers"][0]
        startup = c["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        if g.engine == "vllm":
            assert budget >= cfg.kubernetes.model_load_timeout_s
        assert c["readinessProbe"]["exec"]["command"][-1] == "ready"
        assert c["lifecycle"]["preStop"]["exec"]["command"][-1] == "drain"
        # preStop waits up to the drain timeout; the SIGTERM after it may drain that long again
        assert pod["terminationGracePeriodSeconds"] >= 2 * cfg.router.drain_timeout_s
        assert c["command"][-2:] == ["--instance-id", "$(POD_NAME)"]
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
        assert "nvidia.com/gpu" not in json.dumps(c)
        assert "replicas" not in s["spec"]  # the ScaledObject's to set
    # every ScaledObject targets a StatefulSet that exists, windows short up / long down
    for so in _by(objs, "ScaledObject"):
        assert so["spec"]["scaleTargetRef"]["name"] in groups
        b = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert b["scaleUp"]["stabilizationWindowSeconds"] < b["scaleDown"]["stabilizationWindowSeconds"]


def test_gpu_overlay_gives_each_vllm_worker_a_gpu_and_a_gpu_config(cfg):
    objs = k8s.built(cfg, "gpu")
    vllm = _by(objs, "StatefulSet", "weir-worker-tiny-llama")[0]["spec"]["template"]
    c = vllm["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == cfg.kubernetes.gpu_image
    assert c["startupProbe"] and c["lifecycle"]["preStop"]  # the patch kept the base's probes
    sim = _by(objs, "StatefulSet", "weir-worker-sim-tiny")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "limits" not in sim["resources"]
    worker_toml = _by(objs, "ConfigMap")[0]["data"]["worker.toml"]
    w = loads(worker_toml).worker("cpu-vllm-0")
    assert w.gpu_index == 0 and w.kv_cache_bytes == 0
    assert vllm["metadata"]["annotations"][k8s.HASH_ANNOTATION] == k8s._sha(worker_toml)  # a change rolls the pods
    so = _by(objs, "ScaledObject", "weir-worker-tiny-llama")[0]
    assert [t["name"] for t in so["spec"]["triggers"]] == ["demand", "gpu-utilization"]


def test_configmap_views_load_and_point_at_the_routers(cfg):
    data = _by(k8s.built(cfg), "ConfigMap")[0]["data"]
    router, worker = loads(data["router.toml"]), loads(data["worker.toml"])
    assert router.router.backend == "tcp://0.0.0.0:5556" and router.router.http == "0.0.0.0:8001"
    assert worker.router.backend == k8s.worker_router_backend(cfg) == "tcp://weir-routers.weir.svc.cluster.local:5556"
    assert router.model("tiny-llama").path == "/models/tiny-llama"
    envoy = yaml.safe_load(data["envoy.yaml"])
    cluster = envoy["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS"  # one upstream host per router pod
    envoy_config.validate(data["envoy.yaml"])  # the real Envoy accepts it


def test_a_config_of_several_local_routers_renders_the_same_routing(cfg):
    """[[routers]] (and a worker's own routers list) name processes on hosts;
    in the cluster the routers are the Deployment behind its Services."""
    import msgspec

    raw = msgspec.to_builtins(cfg)
    raw["routers"] = [{"http": "127.0.0.1:18001", "frontend": "tcp://127.0.0.1:15555",
                       "backend": "tcp://127.0.0.1:15556"},
                      {"http": "127.0.0.1:18002", "frontend": "tcp://127.0.0.1:15557",
                       "backend": "tcp://127.0.0.1:15558"}]
    raw["workers"][0]["routers"] = ["tcp://127.0.0.1:15556"]
    several = msgspec.convert(raw, type(cfg))
    data = _by(k8s.built(several), "ConfigMap")[0]["data"]
    assert data == _by(k8s.built(cfg), "ConfigMap")[0]["data"]
    worker = loads(data["worker.toml"])
    assert worker.worker_backends(worker.workers[0]) == [k8s.worker_router_backend(cfg)]


def test_network_policies_deny_by_default_and_open_only_the_planes(cfg):
    pols = {p["metadata"]["name"]: p["spec"] for p in _by(k8s.built(cfg), "NetworkPolicy")}
    assert pols["weir-default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    router = pols["weir-router"]["ingress"]
    by_port = {}
    for rule in router:
        for p in rule["ports"]:
            by_port.setdefault(p["port"], []).append(rule.get("from"))
    assert 5556 in by_port and all(f[0]["podSelector"]["matchLabels"][k8s.PART] == "worker" for f in by_port[5556])
    assert "weir-worker" not in pols  # workers accept nothing: default deny


def test_bad_kubernetes_settings_are_refused(cfg):
    text = (REPO / "deploy" / "weir.toml").read_text()
    for extra, msg in (("router_replicas = 1", "router_replicas"), ("min_workers = 9", "min_workers"),
                       ("scale_down_window_s = 4000", "scale_down_window_s")):
        bad = loads(text + f"\n[kubernetes]\n{extra}\n", base_dir=str(REPO / "deploy"))
        with pytest.raises(ConfigError, match=msg):
            k8s.files(bad)
    import msgspec

    for names, msg in ((["m" * 50], "at most 52"), (["a.b", "a-b"], "both render")):
        raw = msgspec.to_builtins(cfg)
        raw["models"] = [{"name": n, "engine": "sim", "max_model_len": 1024} for n in names]
        raw["workers"] = [{"id": f"w{i}", "model": n} for i, n in enumerate(names)]
        raw.pop("fallbacks", None)
        with pytest.raises(ConfigError, match=msg):
            k8s.files(msgspec.convert(raw, type(cfg)))


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


def test_containerfile_copies_every_package_the_project_installs():
    import tomllib

    includes = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {i.rstrip("*") for i in includes}
    text = (REPO / "deploy" / "Containerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", text, re.M))
    assert packages <= copied, f"deploy/Containerfile does not COPY {sorted(packages - copied)}"
    assert 'pip install ".[${ENGINE}]"' in text


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
