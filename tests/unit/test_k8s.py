"""deploy/k8s/: the checked-in manifests are the rendering of deploy/weir.toml,
every object validates offline (Kubernetes 1.32 schemas; KEDA's ScaledObject
against deploy/schemas/) and the invariants that matter hold.  The same
manifests on real processes: tests/e2e/test_k8s_e2e.py."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml
from stackutil import REPO

from deploy import envoy_config, k8s
from shared.config import DEFAULT_CONFIG, ConfigError, load, loads

K8S_DIR = REPO / "deploy" / "k8s"
KEDA_SCHEMA = json.loads((REPO / "deploy" / "schemas" / "keda-scaledobject.schema.json").read_text())
K8S_VERSION = "1.32"
OVERLAYS = [None, "cpu-demo", "gpu"]


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
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "ConfigMap",
        "NetworkPolicy",
        "CronJob",
        "ScaledObject",
    } <= kinds
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
    so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] = (
        7200
    )
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
    assert (
        {s["metadata"]["name"] for s in sets}
        == set(groups)
        == {
            "weir-worker-tiny-llama",
            "weir-worker-tiny-embed",
            "weir-worker-sim-tiny",
        }
    )
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
    assert vllm["metadata"]["annotations"][k8s.HASH_ANNOTATION] == k8s.pod_config_sha(
        cfg, worker_toml
    )  # a change rolls the pods
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


def test_adapters_live_beside_the_models_and_the_cpu_demo_builds_them(cfg):
    data = _by(k8s.built(cfg), "ConfigMap")[0]["data"]
    for view in ("router.toml", "worker.toml"):
        assert [(a.name, a.base, a.path) for a in loads(data[view]).adapters] == [
            ("tiny-lora", "tiny-llama", "/models/tiny-lora")
        ]
    demo = k8s.cpu_demo_patches(cfg)
    for part in ("router.yaml", "weir-worker-tiny-llama.yaml"):
        (init,) = demo[part]["spec"]["template"]["spec"]["initContainers"]
        assert "python -m deploy.make_adapter /models/tiny-lora --base /models/tiny-llama" in init["command"][-1]


def _router_volumes(objs: list[dict]) -> tuple[dict, dict]:
    spec = _by(objs, "Deployment", "weir-router")[0]["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    return mounts, {v["name"]: v for v in spec["volumes"]}


def test_routers_keep_batches_on_the_shared_claim(cfg):
    """Batch files and state outlive a router pod and are the same for every
    replica: the claim is mounted where the routers' config keeps them."""
    import msgspec

    objs = k8s.built(cfg)
    mounts, volumes = _router_volumes(objs)
    assert mounts["batches"] == k8s.BATCH_DIR
    assert volumes["batches"]["persistentVolumeClaim"] == {"claimName": cfg.kubernetes.batch_claim}
    data = _by(objs, "ConfigMap")[0]["data"]
    assert loads(data["router.toml"]).batch.directory == k8s.BATCH_DIR
    assert loads(data["worker.toml"]).batch.directory == cfg.batch.directory  # (workers never read it)
    demo_mounts, demo_volumes = _router_volumes(k8s.built(cfg, "cpu-demo"))
    assert demo_mounts["batches"] == k8s.BATCH_DIR and "persistentVolumeClaim" not in demo_volumes["batches"]
    assert demo_volumes["batches"]["emptyDir"] == {}  # a demo cluster may lack ReadWriteMany storage

    raw = msgspec.to_builtins(cfg)
    raw["kubernetes"]["batch_claim"] = ""
    _, volumes = _router_volumes(k8s.built(msgspec.convert(raw, type(cfg))))
    assert volumes["batches"] == {"name": "batches", "emptyDir": {}}
    raw["batch"]["enabled"] = False
    mounts, volumes = _router_volumes(k8s.built(msgspec.convert(raw, type(cfg))))
    assert "batches" not in mounts and "batches" not in volumes


def test_a_config_of_several_local_routers_renders_the_same_routing(cfg):
    """[[routers]] (and a worker's own routers list) name processes on hosts;
    in the cluster the routers are the Deployment behind its Services."""
    import msgspec

    raw = msgspec.to_builtins(cfg)
    raw["routers"] = [
        {"http": "127.0.0.1:18001", "frontend": "tcp://127.0.0.1:15555", "backend": "tcp://127.0.0.1:15556"},
        {"http": "127.0.0.1:18002", "frontend": "tcp://127.0.0.1:15557", "backend": "tcp://127.0.0.1:15558"},
    ]
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


def _sources(rule: dict) -> list[tuple[str, str]]:
    """(who, what) of each peer a policy rule admits: ("pods", component) or ("namespace", name)."""
    out = []
    for peer in rule.get("from", [{"anywhere": True}]):
        if "namespaceSelector" in peer and "podSelector" not in peer:
            out.append(("namespace", peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]))
        elif "podSelector" in peer and "namespaceSelector" not in peer:
            out.append(("pods", peer["podSelector"]["matchLabels"].get(k8s.PART, "?")))
        else:
            out.append(("other", json.dumps(peer, sort_keys=True)))
    return out


@pytest.mark.parametrize("monitoring", ["monitoring", "observability"])
def test_router_ports_admit_only_their_peers(cfg, monitoring):
    """The API port: Envoy pods only (keys, buckets, body limit come first); the
    admin listener (/admin/*, /metrics, /health): the workers' probes and the
    monitoring namespace; the worker plane: workers; nothing else anywhere."""
    import msgspec

    from deploy.k8s_objects import _port, router_admin_port

    k = msgspec.structs.replace(cfg.kubernetes, monitoring_namespace=monitoring)
    cfg = msgspec.structs.replace(cfg, kubernetes=k)
    objs = k8s.built(cfg)
    pol = _by(objs, "NetworkPolicy", "weir-router")[0]["spec"]
    assert pol["podSelector"]["matchLabels"][k8s.PART] == "router" and pol["policyTypes"] == ["Ingress"]
    http, back, front = _port(cfg.router.http), _port(cfg.router.backend), _port(cfg.router.frontend)
    admin = router_admin_port(cfg)
    admitted: dict[int, set] = {}
    for rule in pol["ingress"]:
        assert rule.get("from"), "no rule admits every source"
        for p in rule["ports"]:
            admitted.setdefault(p["port"], set()).update(_sources(rule))
    assert admitted[http] == {("pods", "envoy")}
    assert admitted[admin] == {("pods", "worker"), ("namespace", monitoring)}
    assert admitted[back] == {("pods", "worker")}
    assert set(admitted) == {http, admin, back, front}
    # the routers serve the admin listener there, the probes and Prometheus use it
    router_cfg = loads(_by(objs, "ConfigMap")[0]["data"]["router.toml"])
    assert _port(router_cfg.router.admin_http) == admin and _port(router_cfg.router.http) == http
    worker_cfg = loads(_by(objs, "ConfigMap")[0]["data"]["worker.toml"])
    assert _port(worker_cfg.router.admin_http) == admin  # deploy/k8s_probe.py's port
    pod = _by(objs, "Deployment", "weir-router")[0]["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(admin)
    envoy_pol = _by(objs, "NetworkPolicy", "weir-envoy")[0]["spec"]["ingress"]
    admin_rule = next(r for r in envoy_pol if r["ports"][0]["port"] == _port(cfg.envoy.admin))
    assert _sources(admin_rule) == [("namespace", monitoring)]


def test_a_config_without_api_keys_is_refused_unless_it_allows_anonymous(cfg, tmp_path):
    import msgspec

    assert not cfg.api_keys and cfg.kubernetes.allow_anonymous  # deploy/weir.toml: the open demo, said so
    closed = msgspec.structs.replace(cfg, kubernetes=msgspec.structs.replace(cfg.kubernetes, allow_anonymous=False))
    with pytest.raises(ConfigError, match=r"no \[\[api_keys\]\].*allow_anonymous"):
        k8s.files(closed)
    keyed = loads('[[api_keys]]\nkey_sha256 = "' + "a" * 64 + '"\ntenant = "t"\n', base_dir=str(REPO / "deploy"))
    keyed = msgspec.structs.replace(closed, api_keys=keyed.api_keys)
    assert k8s.files(keyed)  # with keys: rendered
    # the CLI: refused (exit non-zero, the reason on stderr); allowed: rendered with a loud warning
    import sys

    weir = [sys.executable, "-m", "weir"]
    bad = tmp_path / "closed.toml"
    bad.write_text((REPO / "deploy" / "weir.toml").read_text().replace("allow_anonymous = true", ""))
    out = subprocess.run(
        [*weir, "render-k8s", "--config", str(bad), "-o", str(tmp_path / "a")], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode != 0 and "allow_anonymous" in out.stderr and not (tmp_path / "a").exists()
    out = subprocess.run(
        [*weir, "render-k8s", "--config", str(REPO / "deploy" / "weir.toml"), "-o", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0 and "WARNING: NO API KEYS" in out.stderr


def test_router_and_worker_pods_mount_the_admin_token_secret(cfg):
    """Every router and worker pod reads /admin/*'s token from the Secret (never the ConfigMap)."""
    from deploy import k8s_security as sec

    objs = k8s.built(cfg)
    data = _by(objs, "ConfigMap")[0]["data"]
    for role in ("router.toml", "worker.toml"):
        assert loads(data[role]).router.admin_token_file == sec.ADMIN_TOKEN_FILE
    pods = [_by(objs, "Deployment", "weir-router")[0]] + [
        _by(objs, "StatefulSet", g.name)[0] for g in k8s.worker_groups(cfg)
    ]
    for o in pods:
        spec = o["spec"]["template"]["spec"]
        vol = next(v for v in spec["volumes"] if v["name"] == "admin")["projected"]["sources"][0]["secret"]
        assert vol == {"name": sec.ADMIN_SECRET, "items": [{"key": sec.ADMIN_TOKEN, "path": sec.ADMIN_TOKEN}]}
        assert {"name": "admin", "mountPath": sec.ADMIN_DIR, "readOnly": True} in spec["containers"][0]["volumeMounts"]
    envoy = _by(objs, "Deployment", "weir-envoy")[0]["spec"]["template"]["spec"]
    assert all(v["name"] != "admin" for v in envoy["volumes"])  # Envoy never calls /admin
    cmds = {c[6]: c for c in sec.secret_commands(cfg, k8s.worker_groups(cfg))}
    token_arg = cmds[sec.ADMIN_SECRET][7]
    assert token_arg.startswith(f"--from-literal={sec.ADMIN_TOKEN}=") and len(token_arg.split("=", 2)[2]) >= 32
    assert token_arg.split("=", 2)[2] not in "".join(k8s.files(cfg).values())


def test_bad_kubernetes_settings_are_refused(cfg):
    import msgspec

    for extra, msg in (
        ({"router_replicas": 1}, "router_replicas"),
        ({"min_workers": 9}, "min_workers"),
        ({"scale_down_window_s": 4000}, "scale_down_window_s"),
    ):
        bad = msgspec.structs.replace(cfg, kubernetes=msgspec.structs.replace(cfg.kubernetes, **extra))
        with pytest.raises(ConfigError, match=msg):
            k8s.files(bad)

    for names, msg in ((["m" * 50], "at most 52"), (["a.b", "a-b"], "both render")):
        raw = msgspec.to_builtins(cfg)
        raw["models"] = [{"name": n, "engine": "sim", "max_model_len": 1024} for n in names]
        raw["workers"] = [{"id": f"w{i}", "model": n} for i, n in enumerate(names)]
        raw.pop("fallbacks", None)
        with pytest.raises(ConfigError, match=msg):
            k8s.files(msgspec.convert(raw, type(cfg)))


def test_containerfile_copies_every_package_the_project_installs():
    import tomllib

    includes = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {i.rstrip("*") for i in includes}
    text = (REPO / "deploy" / "Containerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", text, re.M))
    assert packages <= copied, f"deploy/Containerfile does not COPY {sorted(packages - copied)}"
    assert 'pip install ".[${ENGINE}]"' in text


# ------------------------------------------------------------------ CURVE and TLS, rollouts


def _secure(tmp_path, cfg, clients=("client",)):
    """The default config with CURVE on (keys made in tmp_path) and Envoy TLS."""
    import msgspec

    from shared import curve

    keys = tmp_path / "curve"
    curve.generate(keys, [g.template.id for g in k8s.worker_groups(cfg)], list(clients))
    raw = msgspec.to_builtins(cfg)
    raw["security"] = {"curve": True, "curve_dir": str(keys)}
    raw["envoy"]["tls_cert_file"] = str(tmp_path / "tls.crt")
    raw["envoy"]["tls_key_file"] = str(tmp_path / "tls.key")
    return msgspec.convert(raw, type(cfg)), keys


def _key_texts(keys) -> list[str]:
    """Every z85 key (public and secret) in the key directory."""
    return re.findall(r'(?:public|secret)-key = "([^"]+)"', "".join(p.read_text() for p in keys.rglob("*.key*")))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_curve_and_tls_render_validate_and_keep_keys_out_of_configmaps(tmp_path, cfg, overlay):
    from deploy import k8s_security as sec

    secure, keys = _secure(tmp_path, cfg)
    objs = k8s.built(secure, overlay)
    for o in objs:
        _validate(o)
    texts = _key_texts(keys)
    assert len(texts) >= 6
    rendered = "".join(k8s.files(secure).values())
    assert not [t for t in texts if t in rendered], "key material in the rendered files"
    data = _by(objs, "ConfigMap")[0]["data"]
    assert not [t for t in texts if t in json.dumps(data)]
    router, worker = loads(data["router.toml"]), loads(data["worker.toml"])
    assert router.security.curve and router.security.curve_dir == sec.CURVE_DIR
    assert all(w.curve_secret_key == f"{sec.CURVE_DIR}/{sec.WORKER_KEY}" for w in worker.workers)
    envoy = yaml.safe_load(data["envoy.yaml"])
    tls = json.dumps(envoy["static_resources"]["listeners"][0])
    assert f"{sec.TLS_DIR}/tls.crt" in tls and f"{sec.TLS_DIR}/tls.key" in tls

    def pod(kind, name):
        return _by(objs, kind, name)[0]["spec"]["template"]["spec"]

    r = pod("Deployment", "weir-router")
    vol = next(v for v in r["volumes"] if v["name"] == "curve")["projected"]["sources"][0]["secret"]
    assert vol["name"] == sec.ROUTER_CURVE_SECRET
    paths = {i["path"] for i in vol["items"]}
    assert {"router.key", "router.key_secret", "clients/client.key"} <= paths
    assert {f"workers/{g.template.id}.key" for g in k8s.worker_groups(cfg)} <= paths
    assert {"mountPath": sec.CURVE_DIR, "name": "curve", "readOnly": True} in r["containers"][0]["volumeMounts"]
    for g in k8s.worker_groups(cfg):
        w = pod("StatefulSet", g.name)
        vol = next(v for v in w["volumes"] if v["name"] == "curve")["projected"]["sources"][0]["secret"]
        assert vol["name"] == sec.worker_secret(g)  # one pair per StatefulSet, shared by its replicas
        assert {i["path"] for i in vol["items"]} == {sec.WORKER_KEY, "router.key"}
    e = pod("Deployment", "weir-envoy")
    assert {"name": "tls", "secret": {"secretName": sec.ENVOY_TLS_SECRET, "defaultMode": 0o444}} in e["volumes"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_the_printed_secret_commands_make_the_secrets_the_pods_mount(tmp_path, cfg):
    """`kubectl create secret` as printed (dry run): each Secret holds exactly the keys the pods project."""
    from deploy import k8s_security as sec

    secure, keys = _secure(tmp_path, cfg)
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
            "/CN=weir",
            "-keyout",
            str(tmp_path / "tls.key"),
            "-out",
            str(tmp_path / "tls.crt"),
        ],
        check=True,
        capture_output=True,
    )
    secrets = {}
    for cmd in sec.secret_commands(secure, k8s.worker_groups(secure)):
        out = subprocess.run([*cmd, "--dry-run=client", "-o", "yaml"], capture_output=True, text=True, check=True)
        s = yaml.safe_load(out.stdout)
        _validate(s)
        secrets[s["metadata"]["name"]] = s
    k8s.write(secure, tmp_path / "k8s")  # kustomize takes the secure rendering as it is (no key files in it)
    for d in ("base", "overlays/cpu-demo", "overlays/gpu"):
        subprocess.run(["kubectl", "kustomize", str(tmp_path / "k8s" / d)], capture_output=True, check=True)
    assert secrets[sec.ENVOY_TLS_SECRET]["type"] == "kubernetes.io/tls"
    assert set(secrets[sec.ENVOY_TLS_SECRET]["data"]) == {"tls.crt", "tls.key"}
    for o in k8s.built(secure):
        for v in o.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            for src in v.get("projected", {}).get("sources", []):
                name = src["secret"]["name"]
                assert name in secrets, f"{o['metadata']['name']} mounts {name}, which no command creates"
                assert {i["key"] for i in src["secret"]["items"]} <= set(secrets[name]["data"])


def test_curve_with_a_missing_key_file_is_a_config_error(tmp_path, cfg):
    secure, keys = _secure(tmp_path, cfg)
    group = k8s.worker_groups(cfg)[0]
    (keys / "workers" / f"{group.template.id}.key_secret").unlink()
    with pytest.raises(ConfigError, match=f"key files missing: .*{group.template.id}.key_secret"):
        k8s.files(secure)
    (keys / "router.key_secret").unlink()
    with pytest.raises(ConfigError, match="router.key_secret"):
        k8s.files(secure)


def test_rollouts_keep_capacity_and_drain_before_exit(cfg):
    objs = k8s.built(cfg)
    pause = cfg.kubernetes.endpoint_propagation_s
    for name in ("weir-router", "weir-envoy"):
        dep = _by(objs, "Deployment", name)[0]
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
        pod = dep["spec"]["template"]["spec"]
        # preStop's pause, then the drain timeout, then a margin to exit
        assert pod["terminationGracePeriodSeconds"] >= pause + cfg.router.drain_timeout_s + 5
    router = _by(objs, "Deployment", "weir-router")[0]["spec"]["template"]["spec"]["containers"][0]
    assert router["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pause)]
    envoy = _by(objs, "Deployment", "weir-envoy")[0]["spec"]["template"]["spec"]["containers"][0]
    assert envoy["lifecycle"]["preStop"]["exec"]["command"][3:] == [
        "envoy-drain",
        "9901",
        str(pause),
        str(int(cfg.router.drain_timeout_s)),
    ]
    assert envoy["command"][envoy["command"].index("--drain-time-s") + 1] == str(pause)


def test_renderer_modules_import_no_circle():
    """The renderer's modules import each other downward only, type-only imports included:
    a circle (k8s_objects <-> k8s_security over WorkerGroup) makes neither readable alone."""
    import ast

    def deploy_imports(path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "deploy":
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deploy."):
                out.add(node.module.removeprefix("deploy."))
            elif isinstance(node, ast.Import):
                out |= {a.name.removeprefix("deploy.") for a in node.names if a.name.startswith("deploy.")}
        return out

    graph = {p.stem: deploy_imports(p) for p in (REPO / "deploy").glob("*.py")}

    def circle_from(mod: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(mod, ())):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            if (found := circle_from(nxt, [*path, nxt])) is not None:
                return found
        return None

    circles = [c for m in sorted(graph) if (c := circle_from(m, [m])) is not None]
    assert circles == []
