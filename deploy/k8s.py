"""Kubernetes manifests rendered from the one TOML config (``weir render-k8s``).

deploy/k8s/ holds a kustomize base and two overlays, all written by
``write(cfg, dir)``; a test keeps the checked-in files equal to a fresh
rendering of deploy/weir.toml, as envoy/envoy.yaml is kept.

    base/              Envoy Deployment + Service; router Deployment (probes,
                       PodDisruptionBudget) + a headless Service; one worker
                       StatefulSet per (model, pool) of [[workers]]; KEDA
                       ScaledObjects; pre-scaling CronJobs; NetworkPolicies;
                       the config as a ConfigMap (each role's view of it)
    overlays/cpu-demo  models built in the pod (deploy/make_model.py), small CPU requests
    overlays/gpu       nvidia.com/gpu per vLLM worker, GPU worker config, GPU-utilisation trigger

The ConfigMap holds what each role reads: ``router.toml`` (binds every
plane on all interfaces), ``worker.toml`` (connects to the routers through
``worker_router_backend``), ``envoy.yaml`` (rendered by deploy.envoy_config
with the routers' headless Service as a STRICT_DNS cluster: one upstream
host per router pod, each health-checked on /health/ready).

Worker pods run one [[workers]] entry's settings (the first of its model and
pool) under their pod name (``--instance-id``), so a StatefulSet scales to
any number of workers without a config entry each.  Readiness is the
router's own view (deploy/k8s_probe.py asks /admin/workers/{id}); preStop drains
there and waits, and SIGTERM then drains what is left, so
``terminationGracePeriodSeconds`` covers both (``worker_grace_s``).
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import tomli_w
import yaml

from deploy import envoy_config
from shared.config import Config, ConfigError, WorkerConfig, split_hostport

HEADER = "# Rendered by deploy/k8s.py from the weir TOML config -- do not edit: `weir render-k8s`.\n"
CONFIG_DIR = "/etc/weir"
MODELS_DIR = "/models"
CONFIGMAP = "weir-config"
ROUTERS_SERVICE = "weir-routers"  # headless: one DNS record per router pod, ready or not
WORKERS_SERVICE = "weir-workers"  # headless: the StatefulSets' governing Service
PRESCALER = "weir-prescaler"
KUBECTL_IMAGE = "registry.k8s.io/kubectl:v1.32.4"
PROBE_PERIOD_S = 10
SIM_STARTUP_S = 60  # the sim engine starts in ~1 s
DRAIN_SLACK_S = 15  # Goodbye, engine shutdown, process exit
APP = "app.kubernetes.io/name"
PART = "app.kubernetes.io/component"
MODEL_LABEL = "weir.io/model"
POOL_LABEL = "weir.io/pool"
CLIENT_LABEL = "weir.io/zmq-client"  # pods allowed to reach the routers' direct-client plane
HASH_ANNOTATION = "weir.io/config-sha256"


# ------------------------------------------------------------------ names


def dns_name(text: str) -> str:
    """A DNS-1123 label from a model or pool name."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:50] or "x"


def routers_host(cfg: Config) -> str:
    return f"{ROUTERS_SERVICE}.{cfg.kubernetes.namespace}.svc.cluster.local"


def worker_router_backend(cfg: Config) -> str:
    """Where a worker pod connects: THE one place that decides it.

    Today a worker links to one router: ZeroMQ resolves the headless
    Service's name to one router pod.  With several routers that each need
    every worker (issue 10), this becomes the list the worker connects to
    (the Service's per-pod records); nothing else here changes."""
    _, port = split_hostport(cfg.router.backend.partition("://")[2])
    return f"tcp://{routers_host(cfg)}:{port}"


def _port(addr: str) -> int:
    return split_hostport(addr.partition("://")[2] if "://" in addr else addr)[1]


class WorkerGroup(msgspec.Struct, frozen=True):
    """One StatefulSet: the [[workers]] of one model and pool."""

    name: str
    model: str
    pool: str
    engine: str
    template: WorkerConfig  # the first entry's settings, run by every pod


def worker_groups(cfg: Config) -> list[WorkerGroup]:
    groups: dict[tuple[str, str], list[WorkerConfig]] = {}
    for w in cfg.workers:
        groups.setdefault((w.model, w.pool), []).append(w)
    out = []
    for (model, pool), ws in groups.items():
        suffix = "" if pool == "any" else f"-{pool}"
        out.append(WorkerGroup(f"weir-worker-{dns_name(model)}{suffix}", model, pool,
                               cfg.model(model).engine, ws[0]))
    return out


STATEFULSET_NAME_MAX = 52


def worker_grace_s(cfg: Config) -> int:
    """preStop waits up to the drain timeout, SIGTERM's own drain may take it again."""
    return math.ceil(2 * cfg.router.drain_timeout_s) + DRAIN_SLACK_S


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
    if cfg.security.curve:
        raise ConfigError("kubernetes: CURVE keys per pod are not rendered yet; use NetworkPolicies "
                          "(rendered) or set security.curve = false")
    if cfg.envoy.tls_cert_file:
        raise ConfigError("kubernetes: terminate TLS at your Ingress/Gateway; unset envoy.tls_*")
    if not cfg.workers:
        raise ConfigError("kubernetes: no [[workers]] to render")
    seen: dict[str, str] = {}
    for g in worker_groups(cfg):
        # a StatefulSet's pods carry a controller-revision-hash label of its
        # name + 11 characters, and a label value holds at most 63
        if len(g.name) > STATEFULSET_NAME_MAX:
            raise ConfigError(f"kubernetes: model {g.model!r} makes the StatefulSet name {g.name!r}, "
                              f"{len(g.name)} characters (at most {STATEFULSET_NAME_MAX}): use a shorter model name")
        if seen.setdefault(g.name, g.model) != g.model:
            raise ConfigError(f"kubernetes: models {seen[g.name]!r} and {g.model!r} both render as {g.name!r}")


# ------------------------------------------------------------------ each role's config


def _role_config(cfg: Config, role: str, gpu: bool = False) -> dict:
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
    if gpu:
        for w in raw["workers"]:
            if cfg.model(w["model"]).engine == "vllm":
                w["gpu_index"] = 0  # the one GPU the pod is given (CUDA_VISIBLE_DEVICES)
                w["kv_cache_bytes"] = 0  # 0: vLLM sizes KV by gpu_memory_utilization
    return _drop_none(raw)


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


# ------------------------------------------------------------------ objects


def _meta(cfg: Config, name: str, part: str | None = None, **labels: str) -> dict:
    lab = {APP: "weir"}
    if part:
        lab[PART] = part
    lab.update(labels)
    return {"name": name, "namespace": cfg.kubernetes.namespace, "labels": lab}


def _selector(part: str, **labels: str) -> dict:
    return {APP: "weir", PART: part, **labels}


def _config_volume() -> dict:
    return {"name": "config", "configMap": {"name": CONFIGMAP}}


def _models_volume(cfg: Config) -> dict:
    return {"name": "models", "persistentVolumeClaim": {"claimName": cfg.kubernetes.models_claim, "readOnly": True}}


def _has_vllm(cfg: Config) -> bool:
    return any(m.engine == "vllm" for m in cfg.models)


def _http_probe(path: str, port: int, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 2,
            "failureThreshold": failures}


def configmap(cfg: Config, gpu: bool = False) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(cfg, CONFIGMAP),
            "data": {"router.toml": role_toml(cfg, "router"), "worker.toml": role_toml(cfg, "worker", gpu),
                     "envoy.yaml": envoy_yaml(cfg)}}


def envoy_objects(cfg: Config) -> list[dict]:
    k = cfg.kubernetes
    listen, admin = _port(cfg.envoy.listen), _port(cfg.envoy.admin)
    sel = _selector("envoy")
    pod = {
        "metadata": {"labels": sel, "annotations": {
            HASH_ANNOTATION: _sha(envoy_yaml(cfg)), "prometheus.io/scrape": "true",
            "prometheus.io/port": str(admin), "prometheus.io/path": "/stats/prometheus"}},
        "spec": {
            "containers": [{
                "name": "envoy", "image": k.image,
                "command": ["envoy", "-c", f"{CONFIG_DIR}/envoy.yaml", "--disable-hot-restart",
                            "--concurrency", str(cfg.envoy.concurrency), "-l", "warning"],
                "ports": [{"name": "http", "containerPort": listen}, {"name": "admin", "containerPort": admin}],
                # Envoy's own readiness, not its routers': a probe through the
                # rate-limited route would fail every Envoy at once under
                # overload.  With no healthy router it answers 503 + Retry-After.
                "readinessProbe": _http_probe("/ready", admin, 5, 2),
                "livenessProbe": _http_probe("/ready", admin, 10, 3),
                "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}},
                "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
            }],
            "volumes": [_config_volume()],
        },
    }
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(cfg, "weir-envoy", "envoy"),
         "spec": {"replicas": k.envoy_replicas, "selector": {"matchLabels": sel}, "template": pod}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, "weir", "envoy"),
         "spec": {"selector": sel, "ports": [{"name": "http", "port": listen, "targetPort": "http"}]}},
    ]


def router_objects(cfg: Config) -> list[dict]:
    k = cfg.kubernetes
    http, front, back = _port(cfg.router.http), _port(cfg.router.frontend), _port(cfg.router.backend)
    sel = _selector("router")
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [_config_volume()]
    if _has_vllm(cfg):  # the router tokenizes: it reads each model's tokenizer files
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        volumes.append(_models_volume(cfg))
    pod = {
        "metadata": {"labels": sel, "annotations": {
            HASH_ANNOTATION: _sha(role_toml(cfg, "router")), "prometheus.io/scrape": "true",
            "prometheus.io/port": str(http), "prometheus.io/path": "/metrics"}},
        "spec": {
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": sel},
                                                   "topologyKey": "kubernetes.io/hostname"}}]}},
            "containers": [{
                "name": "router", "image": k.image,
                "command": ["python", "-m", "router", "--config", f"{CONFIG_DIR}/router.toml"],
                "ports": [{"name": "http", "containerPort": http}, {"name": "zmq-clients", "containerPort": front},
                          {"name": "zmq-workers", "containerPort": back}],
                # live: the process answers; ready: some worker takes new work (else Envoy's own
                # health check would skip it anyway)
                "livenessProbe": _http_probe("/health/live", http, 10, 3),
                "readinessProbe": _http_probe("/health/ready", http, 5, 2),
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                "volumeMounts": mounts,
            }],
            "terminationGracePeriodSeconds": 30,
            "volumes": volumes,
        },
    }
    ports = [{"name": "http", "port": http, "targetPort": http}, {"name": "zmq-clients", "port": front},
             {"name": "zmq-workers", "port": back}]
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(cfg, "weir-router", "router"),
         "spec": {"replicas": k.router_replicas, "selector": {"matchLabels": sel}, "template": pod}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(cfg, "weir-router", "router"),
         "spec": {"minAvailable": 1, "selector": {"matchLabels": sel}}},
        # Workers and Envoy find every router here.  publishNotReadyAddresses: a router is
        # ready only once a worker registered, so workers must reach unready ones.
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, ROUTERS_SERVICE, "router"),
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": sel, "ports": ports}},
        # Direct ZeroMQ clients (shared.client): one router per connection.
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, "weir-zmq", "router"),
         "spec": {"selector": sel, "ports": [{"name": "zmq-clients", "port": front, "targetPort": front}]}},
    ]


def _probe_exec(action: str) -> list[str]:
    return ["python", "-m", "deploy.k8s_probe", action]


def worker_statefulset(cfg: Config, g: WorkerGroup) -> dict:
    k = cfg.kubernetes
    sel = _selector("worker", **{MODEL_LABEL: dns_name(g.model), POOL_LABEL: g.pool})
    vllm = g.engine == "vllm"
    startup_s = k.model_load_timeout_s if vllm else SIM_STARTUP_S
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [_config_volume()]
    if vllm:
        mounts += [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
                   {"name": "dshm", "mountPath": "/dev/shm"}]
        volumes += [_models_volume(cfg), {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    container = {
        "name": "worker", "image": k.image,
        "command": ["python", "-m", "engine_worker", "--config", f"{CONFIG_DIR}/worker.toml",
                    "--worker-id", g.template.id, "--instance-id", "$(POD_NAME)"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "WEIR_CONFIG", "value": f"{CONFIG_DIR}/worker.toml"}],
        # Registered and taking work, as the router sees it (no port of its own to probe).
        "startupProbe": {"exec": {"command": _probe_exec("ready")}, "periodSeconds": PROBE_PERIOD_S,
                         "timeoutSeconds": 5, "failureThreshold": math.ceil(startup_s / PROBE_PERIOD_S)},
        "readinessProbe": {"exec": {"command": _probe_exec("ready")}, "periodSeconds": PROBE_PERIOD_S,
                           "timeoutSeconds": 5, "failureThreshold": 2},
        # Drain at the router first (no new work at once) and wait for what runs; SIGTERM follows.
        "lifecycle": {"preStop": {"exec": {"command": _probe_exec("drain")}}},
        "resources": {"requests": {"cpu": "1", "memory": "4Gi" if vllm else "512Mi"}},
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(cfg, g.name, "worker", **{MODEL_LABEL: dns_name(g.model), POOL_LABEL: g.pool}),
        "spec": {
            # no "replicas": the ScaledObject owns it (min_workers..max_workers), and a
            # re-apply of these manifests must not reset what the autoscaler chose
            "serviceName": WORKERS_SERVICE,
            "podManagementPolicy": "Parallel",  # scale-ups load models side by side
            "selector": {"matchLabels": sel},
            "template": {
                "metadata": {"labels": sel, "annotations": {HASH_ANNOTATION: _sha(role_toml(cfg, "worker"))}},
                "spec": {"terminationGracePeriodSeconds": worker_grace_s(cfg), "containers": [container],
                         "volumes": volumes},
            },
        },
    }


def worker_objects(cfg: Config) -> list[dict]:
    out: list[dict] = [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, WORKERS_SERVICE, "worker"),
         "spec": {"clusterIP": "None", "selector": _selector("worker")}}]
    for g in worker_groups(cfg):
        out.append(worker_statefulset(cfg, g))
        out.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": _meta(cfg, g.name, "worker"),
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": worker_statefulset(cfg, g)
                                                               ["spec"]["selector"]["matchLabels"]}}})
    return out


# ------------------------------------------------------------------ autoscaling


def demand_query(g: WorkerGroup) -> str:
    """Requests queued for this group's model (and pool) plus those running on
    its workers, summed over every router: KEDA divides by the threshold."""
    queue = f'model="{g.model}"' + ("" if g.pool == "any" else f',pool="{g.pool}"')
    running = f'model="{g.model}"' + ("" if g.pool == "any" else f',pool="{g.pool}"')
    return (f"(sum(weir_model_queue_depth{{{queue}}}) or vector(0))"
            f" + (sum(weir_worker_running{{{running}}}) or vector(0))")


def gpu_query(g: WorkerGroup) -> str:
    """Summed GPU utilisation of the group's workers (KEDA divides by the target)."""
    return (f'sum(weir_gpu_utilization_percent and on(worker) weir_worker_capacity_tokens{{model="{g.model}"}})'
            " or vector(0)")


def _trigger(cfg: Config, name: str, query: str, threshold: float) -> dict:
    return {"type": "prometheus", "name": name, "metricType": "AverageValue",
            "metadata": {"serverAddress": cfg.kubernetes.prometheus_url, "query": query,
                         "threshold": f"{threshold:g}", "ignoreNullValues": "true"}}


def scaled_object(cfg: Config, g: WorkerGroup, gpu: bool = False) -> dict:
    k = cfg.kubernetes
    triggers = [_trigger(cfg, "demand", demand_query(g), g.template.max_num_seqs * k.target_slot_utilization)]
    if gpu and g.engine == "vllm":
        triggers.append(_trigger(cfg, "gpu-utilization", gpu_query(g), k.gpu_utilization_target_percent))
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(cfg, g.name, "worker"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": g.name},
            "minReplicaCount": k.min_workers, "maxReplicaCount": k.max_workers,
            "pollingInterval": k.polling_interval_s, "cooldownPeriod": k.scale_down_window_s,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                # short window up: a growing queue gets workers at once (model load is the lag)
                "scaleUp": {"stabilizationWindowSeconds": k.scale_up_window_s,
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60}]},
                # long window down, one pod a minute: a lull inside a burst keeps its workers
                "scaleDown": {"stabilizationWindowSeconds": k.scale_down_window_s,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
            }}},
            "triggers": triggers,
        },
    }


def autoscaling_objects(cfg: Config) -> list[dict]:
    return [scaled_object(cfg, g) for g in worker_groups(cfg)]


def prescale_objects(cfg: Config) -> list[dict]:
    """CronJobs that raise the ScaledObjects' floor before the weekday peak and lower it after."""
    k = cfg.kubernetes
    names = [g.name for g in worker_groups(cfg)]
    objs: list[dict] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cfg, PRESCALER, "prescaler")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(cfg, PRESCALER, "prescaler"),
         "rules": [{"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "resourceNames": names,
                    "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(cfg, PRESCALER, "prescaler"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": PRESCALER},
         "subjects": [{"kind": "ServiceAccount", "name": PRESCALER, "namespace": k.namespace}]},
    ]
    for suffix, schedule, floor in (("peak", k.prescale_schedule, k.prescale_min_workers),
                                    ("off-peak", k.prescale_end_schedule, k.min_workers)):
        patch = '{"spec":{"minReplicaCount":%d}}' % floor
        script = " && ".join(f"kubectl -n {k.namespace} patch scaledobject {n} --type merge -p '{patch}'"
                             for n in names)
        objs.append({
            "apiVersion": "batch/v1", "kind": "CronJob", "metadata": _meta(cfg, f"{PRESCALER}-{suffix}", "prescaler"),
            "spec": {"schedule": schedule, "concurrencyPolicy": "Forbid", "jobTemplate": {"spec": {
                "backoffLimit": 2, "template": {
                    "metadata": {"labels": _selector("prescaler")},
                    "spec": {"serviceAccountName": PRESCALER, "restartPolicy": "OnFailure",
                             "containers": [{"name": "kubectl", "image": KUBECTL_IMAGE,
                                             "command": ["/bin/sh", "-c", script]}]}}}}},
        })
    return objs


# ------------------------------------------------------------------ network


def network_policies(cfg: Config) -> list[dict]:
    k = cfg.kubernetes
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": k.monitoring_namespace}}}
    http, front, back = _port(cfg.router.http), _port(cfg.router.frontend), _port(cfg.router.backend)

    def pol(name: str, part: str, ingress: list[dict]) -> dict:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(cfg, name),
                "spec": {"podSelector": {"matchLabels": {APP: "weir", PART: part}}, "policyTypes": ["Ingress"],
                         "ingress": ingress}}

    def tcp(*ports: int) -> list[dict]:
        return [{"protocol": "TCP", "port": p} for p in ports]

    return [
        # Everything else in the namespace -- the workers above all, which listen on
        # nothing (they dial the router) -- takes no connection at all.
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(cfg, "weir-default-deny"),
         "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}},
        pol("weir-envoy", "envoy", [
            {"ports": tcp(_port(cfg.envoy.listen))},  # the OpenAI API: from anywhere
            {"from": [monitoring], "ports": tcp(_port(cfg.envoy.admin))}]),
        pol("weir-router", "router", [
            {"from": [{"podSelector": {"matchLabels": _selector("envoy")}}], "ports": tcp(http)},
            # workers: their link, and /admin/workers for their probes
            {"from": [{"podSelector": {"matchLabels": _selector("worker")}}], "ports": tcp(back, http)},
            {"from": [monitoring], "ports": tcp(http)},
            {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {CLIENT_LABEL: "true"}}}],
             "ports": tcp(front)}]),
    ]


# ------------------------------------------------------------------ layout and overlays


def base(cfg: Config) -> dict[str, list[dict]]:
    """File name -> objects of the kustomize base."""
    check(cfg)
    ns = {"apiVersion": "v1", "kind": "Namespace",
          "metadata": {"name": cfg.kubernetes.namespace, "labels": {APP: "weir"}}}
    return {
        "namespace.yaml": [ns],
        "config.yaml": [configmap(cfg)],
        "envoy.yaml": envoy_objects(cfg),
        "router.yaml": router_objects(cfg),
        "workers.yaml": worker_objects(cfg),
        "autoscaling.yaml": autoscaling_objects(cfg),
        "prescale.yaml": prescale_objects(cfg),
        "network-policies.yaml": network_policies(cfg),
    }


def _target(obj: dict) -> dict:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]}}


def _make_model_init(cfg: Config, image: str) -> dict:
    paths = " && ".join(f"python -m deploy.make_model {MODELS_DIR}/{dns_name(m.name)}"
                        for m in cfg.models if m.engine == "vllm")
    return {"name": "make-model", "image": image, "command": ["/bin/sh", "-c", paths],
            "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}]}


def cpu_demo_patches(cfg: Config) -> dict[str, dict]:
    """The tiny random Llama built in each pod that needs it (as `make run` does), small requests."""
    out: dict[str, dict] = {}
    models_tmp = {"name": "models", "persistentVolumeClaim": None, "emptyDir": {"sizeLimit": "1Gi"}}
    if _has_vllm(cfg):
        p = _target(router_objects(cfg)[0])
        p["spec"] = {"template": {"spec": {"initContainers": [_make_model_init(cfg, cfg.kubernetes.image)],
                                           "volumes": [models_tmp]}}}
        out["router.yaml"] = p
    for g in worker_groups(cfg):
        p = _target(worker_statefulset(cfg, g))
        spec: dict = {"containers": [{"name": "worker", "resources": {
            "requests": {"cpu": "1", "memory": "3Gi" if g.engine == "vllm" else "256Mi"}}}]}
        if g.engine == "vllm":
            spec["initContainers"] = [_make_model_init(cfg, cfg.kubernetes.image)]
            spec["volumes"] = [models_tmp]
        p["spec"] = {"template": {"spec": spec}}
        out[f"{g.name}.yaml"] = p
    return out


def gpu_patches(cfg: Config) -> dict[str, dict]:
    """One GPU per vLLM worker pod (its image, toleration, config view), and GPU utilisation as a second trigger."""
    k = cfg.kubernetes
    cm = configmap(cfg, gpu=True)
    p = _target(cm)
    p["data"] = {"worker.toml": cm["data"]["worker.toml"]}
    out: dict[str, dict] = {"config.yaml": p}
    for g in worker_groups(cfg):
        if g.engine != "vllm":
            continue
        p = _target(worker_statefulset(cfg, g))
        p["spec"] = {"template": {
            "metadata": {"annotations": {HASH_ANNOTATION: _sha(cm["data"]["worker.toml"])}},
            "spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "worker", "image": k.gpu_image,
                                     "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}}
        out[f"{g.name}.yaml"] = p
        so = scaled_object(cfg, g, gpu=True)
        p = _target(so)
        p["spec"] = {"triggers": so["spec"]["triggers"]}  # a CRD: kustomize replaces lists whole
        out[f"{g.name}-scaledobject.yaml"] = p
    return out


OVERLAYS = {"cpu-demo": cpu_demo_patches, "gpu": gpu_patches}

# Lists of built-in kinds that kustomize's strategic merge merges by key.
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
               "volumeMounts": "mountPath"}
_BUILTIN_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1",
                   "rbac.authorization.k8s.io/v1")


def merge_patch(obj: dict, patch: dict, builtin: bool) -> dict:
    """``patch`` applied to ``obj`` as kustomize does: strategic merge for
    built-in kinds (lists above by key, null deletes), JSON merge for CRDs.
    The test checks this equals `kubectl kustomize` where kubectl exists."""
    out = copy.deepcopy(obj)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value, builtin)
        elif builtin and key in _MERGE_KEYS and isinstance(value, list) and isinstance(out.get(key), list):
            by = _MERGE_KEYS[key]
            items = list(out[key])
            for v in value:
                i = next((n for n, it in enumerate(items) if it.get(by) == v.get(by)), None)
                if i is None:
                    items.append(_drop_none(v))
                else:
                    items[i] = merge_patch(items[i], v, builtin)
            out[key] = items
        else:
            out[key] = _drop_none(copy.deepcopy(value))
    return out


def built(cfg: Config, overlay: str | None = None) -> list[dict]:
    """Every object of the base, or of an overlay with its patches applied."""
    objs = [o for group in base(cfg).values() for o in group]
    if overlay is None:
        return objs
    for p in OVERLAYS[overlay](cfg).values():
        for i, o in enumerate(objs):
            if (o["kind"], o["metadata"]["name"]) == (p["kind"], p["metadata"]["name"]):
                objs[i] = merge_patch(o, {k: v for k, v in p.items() if k not in ("apiVersion", "kind")},
                                      o["apiVersion"] in _BUILTIN_GROUPS)
    return objs


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_presenter(dumper: yaml.SafeDumper, text: str):
    style = "|" if "\n" in text else None  # the ConfigMap's files stay readable
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump(objs: list[dict]) -> str:
    return HEADER + "---\n".join(yaml.dump(o, Dumper=_Dumper, sort_keys=False, width=120) for o in objs)


def files(cfg: Config) -> dict[str, str]:
    """Relative path -> text of everything under deploy/k8s/."""
    out: dict[str, str] = {}
    b = base(cfg)
    for name, objs in b.items():
        out[f"base/{name}"] = dump(objs)
    out["base/kustomization.yaml"] = HEADER + yaml.dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": list(b)},
        Dumper=_Dumper, sort_keys=False)
    for overlay, patches in OVERLAYS.items():
        ps = patches(cfg)
        for name, p in ps.items():
            out[f"overlays/{overlay}/{name}"] = dump([p])
        out[f"overlays/{overlay}/kustomization.yaml"] = HEADER + yaml.dump(
            {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["../../base"],
             "patches": [{"path": name} for name in ps]}, Dumper=_Dumper, sort_keys=False)
    return out


def write(cfg: Config, out_dir: str | Path) -> list[Path]:
    """Write every file and remove rendered ones no longer rendered (a model gone, say)."""
    out_dir = Path(out_dir)
    fresh = files(cfg)
    for old in [*out_dir.glob("base/*.yaml"), *out_dir.glob("overlays/*/*.yaml")]:
        if old.relative_to(out_dir).as_posix() not in fresh and old.read_text().startswith(HEADER):
            old.unlink()
    written = []
    for rel, text in fresh.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
