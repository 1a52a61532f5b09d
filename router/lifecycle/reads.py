"""The lifecycle as the views read it: ``CoreReads`` (router.observe.views) over the core's public state.

Values and copies, built when asked for, so that nothing outside reaches
into the core's state and nothing is mirrored on the hot path.
"""

from __future__ import annotations

from typing import Any

from router.lifecycle.core import RouterCore
from router.tenancy.identity import Identity
from shared.config import AliasConfig, ModelConfig, WorkerConfig
from shared.protocol import ErrorInfo


class RouterCoreReads:
    """What router.observe.views (and router.observe.ops_metrics through it) read of a ``RouterCore``."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core

    @property
    def draining(self) -> bool:
        return self.core.draining

    def served_models(self) -> list[ModelConfig]:
        """The models served now (the config file's, then those added at run time)."""
        return self.core.registry.configs()

    def served_adapters(self) -> list[tuple[str, str]]:
        """(name, base model) of each LoRA adapter served now."""
        return [(a.name, a.base) for a in self.core.registry.adapters.all()]

    def adapter_paths(self) -> dict[str, str]:
        """name -> directory of each LoRA adapter served now (the admin listing's)."""
        return {a.name: a.path for a in self.core.registry.adapters.all()}

    def allowed_adapters(self, api_key: str | None) -> frozenset[str] | None | ErrorInfo:
        """The adapters a caller may use (None: every one), or why its key is
        refused: the key check of a generation (a missing, wrong or malformed key)."""
        who = self.core.identify(api_key)
        return who.adapters if isinstance(who, Identity) else who

    def model_aliases(self) -> list[AliasConfig]:
        """[[aliases]] as last loaded (router.api.aliases)."""
        return self.core.aliases.configs()

    def model_state(self, name: str) -> str:
        return self.core.model_state(name)

    def runtime_workers_of(self, name: str) -> list[WorkerConfig] | None:
        """The workers a model added at run time wants; None for a model of the config file."""
        workers = self.core.registry.runtime_workers().get(name)
        return None if workers is None else list(workers)

    def uptime_s(self) -> float:
        return self.core.clock() - self.core.started_at

    def live_jobs(self) -> int:
        return self.core.live_jobs()

    def running_on(self, worker_id: str) -> list[str]:
        return self.core.running_on(worker_id)

    def scheduler_snapshot(self) -> dict[str, Any]:
        """The policy's workers, queues and counters now (a fresh dict)."""
        return self.core.policy.snapshot(self.core.clock())

    def queued_by_model(self) -> dict[tuple[str, str], int]:
        return self.core.policy.queued_by_model()

    def tenants(self) -> dict[str, Any]:
        """Per-tenant usage, refusals and budgets (keys by their id, never the key)."""
        snap = self.core.quota.snapshot()
        if self.core.batch_tenants is not None:  # the batch tier's lines and tokens per tenant (router.services.batch)
            snap["batch"] = self.core.batch_tenants()
        return snap
