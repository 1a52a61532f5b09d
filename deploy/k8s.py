"""Kubernetes manifests rendered from the one TOML config (``weir render-k8s``).

deploy/k8s/ holds a kustomize base and two overlays, all written by
``write(cfg, dir)``; a test keeps the checked-in files equal to a fresh
rendering of deploy/weir.toml, as envoy/envoy.yaml is kept.

    base/              Envoy Deployment + Service; router Deployment (probes,
                       PodDisruptionBudget) + a headless Service; one worker
                       StatefulSet per (model, pool) of [[workers]]; KEDA
                       ScaledObjects; pre-scaling CronJobs; NetworkPolicies;
                       the config as a ConfigMap (each role's view of it)
    overlays/cpu-demo  models and adapters built in the pod (deploy/make_model.py, make_adapter.py), small CPU requests
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

The objects come from deploy.k8s_objects (names, config, workloads, network
policies) and deploy.k8s_scaling (KEDA, pre-scaling); this module lays them
out as the base and overlays and writes the files.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from deploy.k8s_groups import dns_name, worker_groups
from deploy.k8s_objects import (
    APP,
    BATCH_DIR,
    CONFIG_DIR,
    HASH_ANNOTATION,
    MODELS_DIR,
    PART,
    ROUTERS_SERVICE,
    _drop_none,
    _has_vllm,
    check,
    configmap,
    envoy_objects,
    network_policies,
    pod_config_sha,
    router_objects,
    routers_host,
    worker_objects,
    worker_router_backend,
    worker_statefulset,
)
from deploy.k8s_scaling import autoscaling_objects, prescale_objects, scaled_object
from shared.config import Config

# What callers read as deploy.k8s.X: the layout below, and the objects' names the tests and docs use.
__all__ = [
    "BATCH_DIR",
    "CONFIG_DIR",
    "HASH_ANNOTATION",
    "HEADER",
    "OVERLAYS",
    "PART",
    "ROUTERS_SERVICE",
    "base",
    "built",
    "dump",
    "files",
    "merge_patch",
    "routers_host",
    "worker_groups",
    "worker_router_backend",
    "write",
]

HEADER = "# Rendered by deploy/k8s.py from the weir TOML config -- do not edit: `weir render-k8s`.\n"

# ------------------------------------------------------------------ layout and overlays


def base(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    """File name -> objects of the kustomize base."""
    check(cfg)
    ns = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": cfg.kubernetes.namespace, "labels": {APP: "weir"}},
    }
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


def _target(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]},
    }


def _make_model_init(cfg: Config, image: str) -> dict[str, Any]:
    paths = " && ".join(
        f"python -m deploy.make_model {'--embed ' if m.task == 'embed' else ''}{MODELS_DIR}/{dns_name(m.name)}"
        for m in cfg.models
        if m.engine == "vllm"
    )
    for a in cfg.adapters:  # the tiny adapter, as `make setup` builds it
        paths += (
            f" && python -m deploy.make_adapter {MODELS_DIR}/{dns_name(a.name)} --base {MODELS_DIR}/{dns_name(a.base)}"
        )
    return {
        "name": "make-model",
        "image": image,
        "command": ["/bin/sh", "-c", paths],
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}],
    }


def cpu_demo_patches(cfg: Config) -> dict[str, dict[str, Any]]:
    """The tiny random Llama built in each pod that needs it (as `make run` does), small requests."""
    out: dict[str, dict[str, Any]] = {}
    models_tmp = {"name": "models", "persistentVolumeClaim": None, "emptyDir": {"sizeLimit": "1Gi"}}
    # (a demo cluster may have no ReadWriteMany storage: batches live with their router pod)
    batches_tmp: dict[str, Any] = {"name": "batches", "persistentVolumeClaim": None, "emptyDir": {}}
    router_spec: dict[str, Any] = {}
    if _has_vllm(cfg):
        router_spec = {"initContainers": [_make_model_init(cfg, cfg.kubernetes.image)], "volumes": [models_tmp]}
    if cfg.batch.enabled:
        router_spec["volumes"] = [*router_spec.get("volumes", []), batches_tmp]
    if router_spec:
        p = _target(router_objects(cfg)[0])
        p["spec"] = {"template": {"spec": router_spec}}
        out["router.yaml"] = p
    for g in worker_groups(cfg):
        p = _target(worker_statefulset(cfg, g))
        spec: dict[str, Any] = {
            "containers": [
                {
                    "name": "worker",
                    "resources": {"requests": {"cpu": "1", "memory": "3Gi" if g.engine == "vllm" else "256Mi"}},
                }
            ]
        }
        if g.engine == "vllm":
            spec["initContainers"] = [_make_model_init(cfg, cfg.kubernetes.image)]
            spec["volumes"] = [models_tmp]
        p["spec"] = {"template": {"spec": spec}}
        out[f"{g.name}.yaml"] = p
    return out


def gpu_patches(cfg: Config) -> dict[str, dict[str, Any]]:
    """One GPU per vLLM worker pod (its image, toleration, config view), and GPU utilisation as a second trigger."""
    k = cfg.kubernetes
    cm = configmap(cfg, gpu=True)
    p = _target(cm)
    p["data"] = {"worker.toml": cm["data"]["worker.toml"]}
    out: dict[str, dict[str, Any]] = {"config.yaml": p}
    for g in worker_groups(cfg):
        if g.engine != "vllm":
            continue
        p = _target(worker_statefulset(cfg, g))
        p["spec"] = {
            "template": {
                "metadata": {"annotations": {HASH_ANNOTATION: pod_config_sha(cfg, cm["data"]["worker.toml"])}},
                "spec": {
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [
                        {"name": "worker", "image": k.gpu_image, "resources": {"limits": {"nvidia.com/gpu": 1}}}
                    ],
                },
            }
        }
        out[f"{g.name}.yaml"] = p
        so = scaled_object(cfg, g, gpu=True)
        p = _target(so)
        p["spec"] = {"triggers": so["spec"]["triggers"]}  # a CRD: kustomize replaces lists whole
        out[f"{g.name}-scaledobject.yaml"] = p
    return out


OVERLAYS = {"cpu-demo": cpu_demo_patches, "gpu": gpu_patches}

# Lists of built-in kinds that kustomize's strategic merge merges by key.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
}
_BUILTIN_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1", "rbac.authorization.k8s.io/v1")


def merge_patch(obj: dict[str, Any], patch: dict[str, Any], builtin: bool) -> dict[str, Any]:
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


def built(cfg: Config, overlay: str | None = None) -> list[dict[str, Any]]:
    """Every object of the base, or of an overlay with its patches applied."""
    objs = [o for group in base(cfg).values() for o in group]
    if overlay is None:
        return objs
    for p in OVERLAYS[overlay](cfg).values():
        for i, o in enumerate(objs):
            if (o["kind"], o["metadata"]["name"]) == (p["kind"], p["metadata"]["name"]):
                objs[i] = merge_patch(
                    o,
                    {k: v for k, v in p.items() if k not in ("apiVersion", "kind")},
                    o["apiVersion"] in _BUILTIN_GROUPS,
                )
    return objs


class _ManifestDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_presenter(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None  # the ConfigMap's files stay readable
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _str_presenter)


def dump(objs: list[dict[str, Any]]) -> str:
    return HEADER + "---\n".join(yaml.dump(o, Dumper=_ManifestDumper, sort_keys=False, width=120) for o in objs)


def files(cfg: Config) -> dict[str, str]:
    """Relative path -> text of everything under deploy/k8s/."""
    out: dict[str, str] = {}
    b = base(cfg)
    for name, objs in b.items():
        out[f"base/{name}"] = dump(objs)
    out["base/kustomization.yaml"] = HEADER + yaml.dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": list(b)},
        Dumper=_ManifestDumper,
        sort_keys=False,
    )
    for overlay, patches in OVERLAYS.items():
        ps = patches(cfg)
        for name, p in ps.items():
            out[f"overlays/{overlay}/{name}"] = dump([p])
        out[f"overlays/{overlay}/kustomization.yaml"] = HEADER + yaml.dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["../../base"],
                "patches": [{"path": name} for name in ps],
            },
            Dumper=_ManifestDumper,
            sort_keys=False,
        )
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
