"""Worker autoscaling: one KEDA ScaledObject per worker group (queue demand; GPU
utilisation too in the gpu overlay) and the CronJobs that raise the floor before
the weekday peak and lower it after."""

from __future__ import annotations

from typing import Any

from deploy.k8s_groups import WorkerGroup, worker_groups
from deploy.k8s_objects import _meta, _selector
from shared.config import Config

PRESCALER = "weir-prescaler"
KUBECTL_IMAGE = "registry.k8s.io/kubectl:v1.32.4"

# ------------------------------------------------------------------ autoscaling


def demand_query(g: WorkerGroup, batch_weight: float = 1.0) -> str:
    """Requests queued for this group's model (and pool) plus those running on
    its workers, summed over every router: KEDA divides by the threshold.
    Batch lines count ``batch_weight`` each (``[batch] autoscale_weight``,
    default 0: offline work fills idle workers and never adds one)."""
    queue = f'model="{g.model}"' + ("" if g.pool == "any" else f',pool="{g.pool}"')
    running = f'model="{g.model}"' + ("" if g.pool == "any" else f',pool="{g.pool}"')
    demand = (
        f"(sum(weir_model_queue_depth{{{queue}}}) or vector(0)) + (sum(weir_worker_running{{{running}}}) or vector(0))"
    )
    if batch_weight >= 1.0:
        return demand
    batch = f'(sum(weir_batch_model_lines{{model="{g.model}"}}) or vector(0))'
    return f"clamp_min({demand} - {1.0 - batch_weight:g} * {batch}, 0)"


def gpu_query(g: WorkerGroup) -> str:
    """Summed GPU utilisation of the group's workers (KEDA divides by the target)."""
    return (
        f'sum(weir_gpu_utilization_percent and on(worker) weir_worker_capacity_tokens{{model="{g.model}"}})'
        " or vector(0)"
    )


def _trigger(cfg: Config, name: str, query: str, threshold: float) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": cfg.kubernetes.prometheus_url,
            "query": query,
            "threshold": f"{threshold:g}",
            "ignoreNullValues": "true",
        },
    }


def scaled_object(cfg: Config, g: WorkerGroup, gpu: bool = False) -> dict[str, Any]:
    k = cfg.kubernetes
    triggers = [
        _trigger(
            cfg,
            "demand",
            demand_query(g, cfg.batch.autoscale_weight),
            g.template.max_num_seqs * k.target_slot_utilization,
        )
    ]
    if gpu and g.engine == "vllm":
        triggers.append(_trigger(cfg, "gpu-utilization", gpu_query(g), k.gpu_utilization_target_percent))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(cfg, g.name, "worker"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": g.name},
            "minReplicaCount": k.min_workers,
            "maxReplicaCount": k.max_workers,
            "pollingInterval": k.polling_interval_s,
            "cooldownPeriod": k.scale_down_window_s,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        # short window up: a growing queue gets workers at once (model load is the lag)
                        "scaleUp": {
                            "stabilizationWindowSeconds": k.scale_up_window_s,
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60}],
                        },
                        # long window down, one pod a minute: a lull inside a burst keeps its workers
                        "scaleDown": {
                            "stabilizationWindowSeconds": k.scale_down_window_s,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                        },
                    }
                }
            },
            "triggers": triggers,
        },
    }


def autoscaling_objects(cfg: Config) -> list[dict[str, Any]]:
    return [scaled_object(cfg, g) for g in worker_groups(cfg)]


def prescale_objects(cfg: Config) -> list[dict[str, Any]]:
    """CronJobs that raise the ScaledObjects' floor before the weekday peak and lower it after."""
    k = cfg.kubernetes
    names = [g.name for g in worker_groups(cfg)]
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cfg, PRESCALER, "prescaler")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(cfg, PRESCALER, "prescaler"),
            "rules": [
                {
                    "apiGroups": ["keda.sh"],
                    "resources": ["scaledobjects"],
                    "resourceNames": names,
                    "verbs": ["get", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(cfg, PRESCALER, "prescaler"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": PRESCALER},
            "subjects": [{"kind": "ServiceAccount", "name": PRESCALER, "namespace": k.namespace}],
        },
    ]
    for suffix, schedule, floor in (
        ("peak", k.prescale_schedule, k.prescale_min_workers),
        ("off-peak", k.prescale_end_schedule, k.min_workers),
    ):
        patch = '{"spec":{"minReplicaCount":%d}}' % floor
        script = " && ".join(
            f"kubectl -n {k.namespace} patch scaledobject {n} --type merge -p '{patch}'" for n in names
        )
        objs.append(
            {
                "apiVersion": "batch/v1",
                "kind": "CronJob",
                "metadata": _meta(cfg, f"{PRESCALER}-{suffix}", "prescaler"),
                "spec": {
                    "schedule": schedule,
                    "concurrencyPolicy": "Forbid",
                    "jobTemplate": {
                        "spec": {
                            "backoffLimit": 2,
                            "template": {
                                "metadata": {"labels": _selector("prescaler")},
                                "spec": {
                                    "serviceAccountName": PRESCALER,
                                    "restartPolicy": "OnFailure",
                                    "containers": [
                                        {
                                            "name": "kubectl",
                                            "image": KUBECTL_IMAGE,
                                            "command": ["/bin/sh", "-c", script],
                                        }
                                    ],
                                },
                            },
                        }
                    },
                },
            }
        )
    return objs
