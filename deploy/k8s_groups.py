"""The worker StatefulSets of one weir config: which [[workers]] entries share
one, and the DNS-1123 names they get.  The bottom of the Kubernetes renderer:
deploy.k8s_objects, deploy.k8s_security and deploy.k8s_scaling all read it,
and it imports none of them."""

from __future__ import annotations

import re

import msgspec

from shared.config import Config, WorkerConfig


def dns_name(text: str) -> str:
    """A DNS-1123 label from a model or pool name."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:50] or "x"


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
        out.append(WorkerGroup(f"weir-worker-{dns_name(model)}{suffix}", model, pool, cfg.model(model).engine, ws[0]))
    return out
