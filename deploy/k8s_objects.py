"""The Kubernetes objects of one weir config: names and labels, each role's view
of the config (the ConfigMap), the Envoy, router and worker workloads, and the
NetworkPolicies.  deploy.k8s lays them out as a kustomize base and overlays;
deploy.k8s_scaling adds the autoscaling objects."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec
import tomli_w

from deploy import envoy_config, k8s_security
from deploy.k8s_groups import WorkerGroup, dns_name, worker_groups
from shared.config import Config, ConfigError, split_hostport

CONFIG_DIR = "/etc/weir"
MODELS_DIR = "/models"
BATCH_DIR = "/var/lib/weir/batches"  # the routers' [batch] directory (kubernetes.batch_claim)
CONFIGMAP = "weir-config"
ROUTERS_SERVICE = "weir-routers"  # headless: one DNS record per router pod, ready or not
WORKERS_SERVICE = "weir-workers"  # headless: the StatefulSets' governing Service
PROBE_PERIOD_S = 10
SIM_STARTUP_S = 60  # the sim engine starts in ~1 s
DRAIN_SLACK_S = 15  # Goodbye, engine shutdown, process exit
APP = "app.kubernetes.io/name"
PART = "app.kubernetes.io/component"
MODEL_LABEL = "weir.io/model"
POOL_LABEL = "weir.io/pool"
ROUTER_ADMIN_PORT = 8002  # router.admin_http's port when the config sets none (/admin, /metrics, /health)
CLIENT_LABEL = "weir.io/zmq-client"  # pods allowed to reach the routers' direct-client plane
HASH_ANNOTATION = "weir.io/config-sha256"


# ------------------------------------------------------------------ names


def routers_host(cfg: Config) -> str:
    return f"{ROUTERS_SERVICE}.{cfg.kubernetes.namespace}.svc.cluster.local"


def worker_router_backend(cfg: Config) -> str:
    """Where a worker pod connects: THE one place that decides it.

    The routers' headless Service name, which resolves to every router pod:
    the worker links to each address (engine_worker/discovery.py), joins a
    router pod that appears within ``discovery_interval_s`` and drops one
    that is gone."""
    _, port = split_hostport(cfg.router.backend.partition("://")[2])
    return f"tcp://{routers_host(cfg)}:{port}"


def _port(addr: str) -> int:
    return split_hostport(addr.partition("://")[2] if "://" in addr else addr)[1]


def router_admin_port(cfg: Config) -> int:
    """The routers' admin listener: /admin/*, /metrics, /health, apart from the API's port."""
    return _port(cfg.router.admin_http) if cfg.router.admin_http else ROUTER_ADMIN_PORT


STATEFULSET_NAME_MAX = 52


def worker_grace_s(cfg: Config) -> int:
    """preStop waits up to the drain timeout, SIGTERM's own drain may take it again."""
    return math.ceil(2 * cfg.router.drain_timeout_s) + DRAIN_SLACK_S


def router_grace_s(cfg: Config) -> int:
    """preStop's pause (endpoints catch up), then SIGTERM's drain up to its timeout."""
    return cfg.kubernetes.endpoint_propagation_s + math.ceil(cfg.router.drain_timeout_s) + DRAIN_SLACK_S


def envoy_grace_s(cfg: Config) -> int:
    """preStop: listeners drain for the pause, then streams run up to the drain timeout."""
    return router_grace_s(cfg)


_ROLLING = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def check(cfg: Config) -> None:
    """ConfigError for what these manifests cannot carry."""
    k = cfg.kubernetes
    if k.router_replicas < 2:
        raise ConfigError("kubernetes.router_replicas must be >= 2 (a PodDisruptionBudget keeps one)")
    if k.envoy_replicas < 1:
        raise ConfigError("kubernetes.envoy_replicas must be >= 1")
    if not 1 <= k.min_workers <= k.max_workers:
        raise ConfigError("kubernetes: need 1 <= min_workers <= max_workers")
    if not k.min_workers <= k.prescale_min_workers <= k.max_workers:
        raise ConfigError("kubernetes.prescale_min_workers must lie within min_workers..max_workers")
    if not 0 < k.target_slot_utilization <= 1:
        raise ConfigError("kubernetes.target_slot_utilization must be in (0, 1]")
    for f in ("scale_up_window_s", "scale_down_window_s"):
        if not 0 <= getattr(k, f) <= 3600:  # the HPA's own bound
            raise ConfigError(f"kubernetes.{f} must be within 0..3600")
    if k.endpoint_propagation_s < 0:
        raise ConfigError("kubernetes.endpoint_propagation_s must be >= 0")
    if not cfg.workers:
        raise ConfigError("kubernetes: no [[workers]] to render")
    if not cfg.api_keys and not k.allow_anonymous:
        raise ConfigError(
            "kubernetes: no [[api_keys]]: every client that reaches Envoy would be one anonymous tenant, able "
            "to read and delete everyone's files, batches and responses. Add keys (`weir keys new`), or set "
            "kubernetes.allow_anonymous = true for a cluster that is open on purpose."
        )
    seen: dict[str, str] = {}
    for g in worker_groups(cfg):
        # a StatefulSet's pods carry a controller-revision-hash label of its
        # name + 11 characters, and a label value holds at most 63
        if len(g.name) > STATEFULSET_NAME_MAX:
            raise ConfigError(
                f"kubernetes: model {g.model!r} makes the StatefulSet name {g.name!r}, "
                f"{len(g.name)} characters (at most {STATEFULSET_NAME_MAX}): use a shorter model name"
            )
        if seen.setdefault(g.name, g.model) != g.model:
            raise ConfigError(f"kubernetes: models {seen[g.name]!r} and {g.model!r} both render as {g.name!r}")
    k8s_security.check(cfg, worker_groups(cfg))


# ------------------------------------------------------------------ each role's config


def _role_config(cfg: Config, role: str, gpu: bool = False) -> dict[str, Any]:
    raw = msgspec.to_builtins(cfg)
    # (the routers are one Deployment here, reached through its Services:
    # [[routers]] and a worker's own `routers` list are for processes on hosts)
    for key in ("base_dir", "kubernetes", "routers"):
        raw.pop(key, None)
    for w in raw["workers"]:
        w.pop("routers", None)
    e, r = raw["envoy"], raw["router"]
    e["listen"] = f"0.0.0.0:{_port(cfg.envoy.listen)}"
    e["admin"] = f"0.0.0.0:{_port(cfg.envoy.admin)}"  # Prometheus scrapes it (NetworkPolicy: monitoring only)
    r["http"] = f"0.0.0.0:{_port(cfg.router.http)}"
    r["frontend"] = f"tcp://0.0.0.0:{_port(cfg.router.frontend)}"
    r["backend"] = f"tcp://0.0.0.0:{_port(cfg.router.backend)}"
    if role == "worker":
        r["backend"] = worker_router_backend(cfg)
    if role == "envoy":
        r["http"] = f"{routers_host(cfg)}:{_port(cfg.router.http)}"
    for m in raw["models"]:
        if m.get("path"):
            m["path"] = f"{MODELS_DIR}/{dns_name(m['name'])}"
    for a in raw.get("adapters") or []:  # (LoRA adapters: in the same volume, beside the models)
        a["path"] = f"{MODELS_DIR}/{dns_name(a['name'])}"
    if role == "router":  # (kubernetes.batch_claim's mount; the other roles never read it)
        raw["batch"]["directory"] = BATCH_DIR
    if cfg.security.curve:  # the keys as the pods mount them (deploy/k8s_security.py)
        raw["security"]["curve_dir"] = k8s_security.CURVE_DIR
        for w in raw["workers"]:
            w["curve_secret_key"] = f"{k8s_security.CURVE_DIR}/{k8s_security.WORKER_KEY}"
    # /admin/* needs the token from every pod but the router's own (the Secret weir-admin-token),
    # and lives with /metrics on a port of its own: the API port is Envoy's alone (network_policies)
    r["admin_token_file"] = k8s_security.ADMIN_TOKEN_FILE
    r["admin_http"] = f"0.0.0.0:{router_admin_port(cfg)}"
    if cfg.envoy.tls_cert_file:
        e["tls_cert_file"] = f"{k8s_security.TLS_DIR}/tls.crt"
        e["tls_key_file"] = f"{k8s_security.TLS_DIR}/tls.key"
    if gpu:
        for w in raw["workers"]:
            if cfg.model(w["model"]).engine == "vllm":
                w["gpu_index"] = 0  # the one GPU the pod is given (CUDA_VISIBLE_DEVICES)
                w["kv_cache_bytes"] = 0  # 0: vLLM sizes KV by gpu_memory_utilization
    view: dict[str, Any] = _drop_none(raw)
    return view


def _drop_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_none(x) for x in v]
    return v


def role_toml(cfg: Config, role: str, gpu: bool = False) -> str:
    head = f"# weir config for the {role} pods, rendered by deploy/k8s.py -- do not edit.\n"
    return head + tomli_w.dumps(_role_config(cfg, role, gpu))


def envoy_yaml(cfg: Config) -> str:
    view = msgspec.convert({**_role_config(cfg, "envoy"), "base_dir": CONFIG_DIR}, Config)
    envoy_config.check(view)
    return envoy_config.render(view)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pod_config_sha(cfg: Config, role_text: str) -> str:
    """A pod template's annotation: its config view and, with CURVE, the public
    keys -- so a changed config or key rolls the pods."""
    if not cfg.security.curve:
        return _sha(role_text)
    return _sha(_sha(role_text) + k8s_security.public_keys_sha(cfg, worker_groups(cfg)))


# ------------------------------------------------------------------ objects


def _meta(cfg: Config, name: str, part: str | None = None, **labels: str) -> dict[str, Any]:
    lab = {APP: "weir"}
    if part:
        lab[PART] = part
    lab.update(labels)
    return {"name": name, "namespace": cfg.kubernetes.namespace, "labels": lab}


def _selector(part: str, **labels: str) -> dict[str, Any]:
    return {APP: "weir", PART: part, **labels}


def _config_volume() -> dict[str, Any]:
    return {"name": "config", "configMap": {"name": CONFIGMAP}}


def _models_volume(cfg: Config) -> dict[str, Any]:
    return {"name": "models", "persistentVolumeClaim": {"claimName": cfg.kubernetes.models_claim, "readOnly": True}}


def _batch_volume(cfg: Config) -> dict[str, Any]:
    claim = cfg.kubernetes.batch_claim
    if not claim:
        return {"name": "batches", "emptyDir": {}}
    return {"name": "batches", "persistentVolumeClaim": {"claimName": claim}}


def _has_vllm(cfg: Config) -> bool:
    return any(m.engine == "vllm" for m in cfg.models)


def _http_probe(path: str, port: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def configmap(cfg: Config, gpu: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cfg, CONFIGMAP),
        "data": {
            "router.toml": role_toml(cfg, "router"),
            "worker.toml": role_toml(cfg, "worker", gpu),
            "envoy.yaml": envoy_yaml(cfg),
        },
    }


def envoy_objects(cfg: Config) -> list[dict[str, Any]]:
    k = cfg.kubernetes
    listen, admin = _port(cfg.envoy.listen), _port(cfg.envoy.admin)
    sel = _selector("envoy")
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [_config_volume()]
    if cfg.envoy.tls_cert_file:  # the listener's certificate: a kubernetes.io/tls Secret (cert-manager's shape)
        mounts.append(k8s_security.tls_mount())
        volumes.append(k8s_security.envoy_tls_volume())
    pause = k.endpoint_propagation_s
    pod = {
        "metadata": {
            "labels": sel,
            "annotations": {
                HASH_ANNOTATION: _sha(envoy_yaml(cfg)),
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(admin),
                "prometheus.io/path": "/stats/prometheus",
            },
        },
        "spec": {
            "containers": [
                {
                    "name": "envoy",
                    "image": k.image,
                    "command": [
                        "envoy",
                        "-c",
                        f"{CONFIG_DIR}/envoy.yaml",
                        "--disable-hot-restart",
                        "--concurrency",
                        str(cfg.envoy.concurrency),
                        "-l",
                        "warning",
                        # preStop's drain_listeners?graceful: every connection is told to
                        # close at once, new ones are taken for this long, then the listeners close
                        "--drain-time-s",
                        str(max(1, pause)),
                        "--drain-strategy",
                        "immediate",
                    ],
                    "ports": [{"name": "http", "containerPort": listen}, {"name": "admin", "containerPort": admin}],
                    # Envoy's own readiness, not its routers': a probe through the
                    # rate-limited route would fail every Envoy at once under
                    # overload.  With no healthy router it answers 503 + Retry-After.
                    "readinessProbe": _http_probe("/ready", admin, 5, 2),
                    "livenessProbe": _http_probe("/ready", admin, 10, 3),
                    # A rollout cuts no stream: listeners drain gracefully, then the
                    # streams in flight get up to the drain timeout (deploy/k8s_probe.py).
                    "lifecycle": {
                        "preStop": {
                            "exec": {
                                "command": _probe_exec(
                                    "envoy-drain", str(admin), str(pause), str(math.ceil(cfg.router.drain_timeout_s))
                                )
                            }
                        }
                    },
                    "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}},
                    "volumeMounts": mounts,
                }
            ],
            "terminationGracePeriodSeconds": envoy_grace_s(cfg),
            "volumes": volumes,
        },
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(cfg, "weir-envoy", "envoy"),
            "spec": {
                "replicas": k.envoy_replicas,
                "strategy": _ROLLING,
                "selector": {"matchLabels": sel},
                "template": pod,
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(cfg, "weir", "envoy"),
            "spec": {"selector": sel, "ports": [{"name": "http", "port": listen, "targetPort": "http"}]},
        },
    ]


def router_objects(cfg: Config) -> list[dict[str, Any]]:
    k = cfg.kubernetes
    http, front, back = _port(cfg.router.http), _port(cfg.router.frontend), _port(cfg.router.backend)
    admin = router_admin_port(cfg)
    sel = _selector("router")
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [_config_volume()]
    if _has_vllm(cfg):  # the router tokenizes: it reads each model's tokenizer files
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        volumes.append(_models_volume(cfg))
    mounts.append(k8s_security.admin_mount())  # the token /admin/* asks of other pods
    volumes.append(k8s_security.admin_volume())
    if cfg.security.curve:  # its key pair and the public keys it lets in (Secret weir-curve-router)
        mounts.append(k8s_security.curve_mount())
        volumes.append(k8s_security.router_curve_volume(cfg, worker_groups(cfg)))
    if cfg.batch.enabled:  # the Batch API's files and state, shared by the replicas
        mounts.append({"name": "batches", "mountPath": BATCH_DIR})
        volumes.append(_batch_volume(cfg))
    pod = {
        "metadata": {
            "labels": sel,
            "annotations": {
                HASH_ANNOTATION: pod_config_sha(cfg, role_toml(cfg, "router")),
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(admin),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": {
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "labelSelector": {"matchLabels": sel},
                                "topologyKey": "kubernetes.io/hostname",
                            },
                        }
                    ]
                }
            },
            "containers": [
                {
                    "name": "router",
                    "image": k.image,
                    "command": ["python", "-m", "router", "--config", f"{CONFIG_DIR}/router.toml"],
                    "ports": [
                        {"name": "http", "containerPort": http},
                        {"name": "admin", "containerPort": admin},
                        {"name": "zmq-clients", "containerPort": front},
                        {"name": "zmq-workers", "containerPort": back},
                    ],
                    # live: the process answers; ready: some worker takes new work (else Envoy's own
                    # health check would skip it anyway)
                    "livenessProbe": _http_probe("/health/live", http, 10, 3),
                    "readinessProbe": _http_probe("/health/ready", http, 5, 2),
                    # Serve on while Endpoints, DNS and Envoy catch up; SIGTERM then drains
                    # (new work refused and retried elsewhere, admitted work finished).
                    "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(k.endpoint_propagation_s)]}}},
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                    "volumeMounts": mounts,
                }
            ],
            "terminationGracePeriodSeconds": router_grace_s(cfg),
            "volumes": volumes,
        },
    }
    ports = [
        {"name": "http", "port": http, "targetPort": http},
        {"name": "admin", "port": admin, "targetPort": admin},
        {"name": "zmq-clients", "port": front},
        {"name": "zmq-workers", "port": back},
    ]
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(cfg, "weir-router", "router"),
            "spec": {
                "replicas": k.router_replicas,
                "strategy": _ROLLING,  # a new router is ready before an old one drains
                "selector": {"matchLabels": sel},
                "template": pod,
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(cfg, "weir-router", "router"),
            "spec": {"minAvailable": 1, "selector": {"matchLabels": sel}},
        },
        # Workers and Envoy find every router here.  publishNotReadyAddresses: a router is
        # ready only once a worker registered, so workers must reach unready ones.
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(cfg, ROUTERS_SERVICE, "router"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": sel, "ports": ports},
        },
        # Direct ZeroMQ clients (shared.client): one router per connection.
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(cfg, "weir-zmq", "router"),
            "spec": {"selector": sel, "ports": [{"name": "zmq-clients", "port": front, "targetPort": front}]},
        },
    ]


def _probe_exec(*args: str) -> list[str]:
    return ["python", "-m", "deploy.k8s_probe", *args]


def worker_statefulset(cfg: Config, g: WorkerGroup) -> dict[str, Any]:
    k = cfg.kubernetes
    sel = _selector("worker", **{MODEL_LABEL: dns_name(g.model), POOL_LABEL: g.pool})
    vllm = g.engine == "vllm"
    startup_s = k.model_load_timeout_s if vllm else SIM_STARTUP_S
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [_config_volume()]
    if vllm:
        mounts += [
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ]
        volumes += [_models_volume(cfg), {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    mounts.append(k8s_security.admin_mount())  # the probes and preStop send the routers' admin token
    volumes.append(k8s_security.admin_volume())
    if cfg.security.curve:  # the StatefulSet's key pair, shared by its replicas (deploy/k8s_security.py)
        mounts.append(k8s_security.curve_mount())
        volumes.append(k8s_security.worker_curve_volume(g))
    container = {
        "name": "worker",
        "image": k.image,
        "command": [
            "python",
            "-m",
            "engine_worker",
            "--config",
            f"{CONFIG_DIR}/worker.toml",
            "--worker-id",
            g.template.id,
            "--instance-id",
            "$(POD_NAME)",
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "WEIR_CONFIG", "value": f"{CONFIG_DIR}/worker.toml"},
        ],
        # Registered and taking work, as the router sees it (no port of its own to probe).
        "startupProbe": {
            "exec": {"command": _probe_exec("ready")},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(startup_s / PROBE_PERIOD_S),
        },
        "readinessProbe": {
            "exec": {"command": _probe_exec("ready")},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": 2,
        },
        # Drain at the router first (no new work at once) and wait for what runs; SIGTERM follows.
        "lifecycle": {"preStop": {"exec": {"command": _probe_exec("drain")}}},
        "resources": {"requests": {"cpu": "1", "memory": "4Gi" if vllm else "512Mi"}},
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(cfg, g.name, "worker", **{MODEL_LABEL: dns_name(g.model), POOL_LABEL: g.pool}),
        "spec": {
            # no "replicas": the ScaledObject owns it (min_workers..max_workers), and a
            # re-apply of these manifests must not reset what the autoscaler chose
            "serviceName": WORKERS_SERVICE,
            "podManagementPolicy": "Parallel",  # scale-ups load models side by side
            "selector": {"matchLabels": sel},
            "template": {
                "metadata": {
                    "labels": sel,
                    "annotations": {HASH_ANNOTATION: pod_config_sha(cfg, role_toml(cfg, "worker"))},
                },
                "spec": {
                    "terminationGracePeriodSeconds": worker_grace_s(cfg),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def worker_objects(cfg: Config) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(cfg, WORKERS_SERVICE, "worker"),
            "spec": {"clusterIP": "None", "selector": _selector("worker")},
        }
    ]
    for g in worker_groups(cfg):
        out.append(worker_statefulset(cfg, g))
        out.append(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": _meta(cfg, g.name, "worker"),
                "spec": {
                    "maxUnavailable": 1,
                    "selector": {"matchLabels": worker_statefulset(cfg, g)["spec"]["selector"]["matchLabels"]},
                },
            }
        )
    return out


# ------------------------------------------------------------------ network


def network_policies(cfg: Config) -> list[dict[str, Any]]:
    k = cfg.kubernetes
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": k.monitoring_namespace}}}
    http, front, back = _port(cfg.router.http), _port(cfg.router.frontend), _port(cfg.router.backend)
    admin = router_admin_port(cfg)

    def pol(name: str, part: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(cfg, name),
            "spec": {
                "podSelector": {"matchLabels": {APP: "weir", PART: part}},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    def tcp(*ports: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": p} for p in ports]

    return [
        # Everything else in the namespace -- the workers above all, which listen on
        # nothing (they dial the router) -- takes no connection at all.
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(cfg, "weir-default-deny"),
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        },
        pol(
            "weir-envoy",
            "envoy",
            [
                {"ports": tcp(_port(cfg.envoy.listen))},  # the OpenAI API: from anywhere
                {"from": [monitoring], "ports": tcp(_port(cfg.envoy.admin))},
            ],
        ),
        pol(
            "weir-router",
            "router",
            [
                # the API: Envoy alone (its keys, buckets and body limit come first)
                {"from": [{"podSelector": {"matchLabels": _selector("envoy")}}], "ports": tcp(http)},
                # workers: their link, and the admin listener for their probes and
                # preStop drain (/admin/workers/..., with the admin token)
                {"from": [{"podSelector": {"matchLabels": _selector("worker")}}], "ports": tcp(back, admin)},
                # /metrics: the monitoring namespace (the admin listener serves no API)
                {"from": [monitoring], "ports": tcp(admin)},
                {
                    "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {CLIENT_LABEL: "true"}}}],
                    "ports": tcp(front),
                },
            ],
        ),
    ]
