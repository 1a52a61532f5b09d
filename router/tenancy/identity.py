"""Who is asking: API keys to tenant, tier and weight, and the anonymous tenant.

Pure, the same for HTTP and direct ZeroMQ clients: a key is looked up by its
SHA-256 (shared.keys), and a client may lower its priority, never raise it.
"""

from __future__ import annotations

from typing import NamedTuple

from router.tenancy.priority_hints import hinted_rank
from shared import protocol as p
from shared.config import ApiKey, Config
from shared.errors import Code, error
from shared.keys import config_digest, digest, key_id, well_formed

ANONYMOUS_TENANT = "anonymous"
DEFAULT_TIER = "normal"


def malformed_key() -> p.ErrorInfo:
    return error(
        Code.INVALID_API_KEY,
        "Malformed API key: a key is printable ASCII without spaces (surrounding spaces and tabs are ignored).",
    )


class Identity(NamedTuple):
    tenant: str
    klass: str  # the scheduler class the request runs in
    weight: float  # its tenant's fair-share weight
    key_id: str = ""  # the API key's public name (shared.keys.key_id); "" without keys
    adapters: frozenset[str] | None = None  # the LoRA adapters it may use (None: all)


class Keys:
    """API keys -> tenant and tier; a client may lower its priority, never raise it.
    Keys are looked up by their SHA-256 (the config holds only that, or a
    plain key that is hashed here): no key text is kept."""

    def __init__(self, cfg: Config) -> None:
        self.by_key: dict[str, ApiKey] = {config_digest(k): k for k in cfg.api_keys}
        # each key's adapter allow-list: its own and its tenant's, both (None: no list)
        tenant_lists = {t.name: t.adapters for t in cfg.tenants}
        self.adapters: dict[str, frozenset[str] | None] = {
            h: _allowed(k.adapters, tenant_lists.get(k.tenant)) for h, k in self.by_key.items()
        }
        self.rank = {c.name: i for i, c in enumerate(cfg.scheduler.classes)}
        self.names = [c.name for c in cfg.scheduler.classes]
        self.default_tier = DEFAULT_TIER if DEFAULT_TIER in self.rank else cfg.scheduler.classes[0].name

    def identify(self, sub: p.Submit) -> Identity | p.ErrorInfo:
        kid = ""
        if sub.api_key and not well_formed(sub.api_key):  # keys or not: the rule Envoy applies (shared.keys)
            return malformed_key()
        if self.by_key:
            h = digest(sub.api_key) if sub.api_key else ""
            key = self.by_key.get(h)
            if key is None:
                return error(Code.INVALID_API_KEY, "Incorrect API key provided.")
            tenant, tier, weight, kid = key.tenant, key.tier, key.weight, key_id(h)
        else:
            tenant, tier, weight = ANONYMOUS_TENANT, self.default_tier, 1.0
        klass = tier
        if sub.priority is not None:
            rank = self.rank.get(sub.priority)
            if rank is None:
                return error(
                    Code.BAD_REQUEST,
                    f"Unknown priority {sub.priority!r}; one of {', '.join(self.rank)}.",
                    param="priority",
                )
            if rank > self.rank[tier]:
                klass = sub.priority
        if sub.routing is not None:  # gateways' priorities (router.api.agent_headers): only lower
            hinted = hinted_rank(sub.routing, self.rank, self.rank[self.default_tier])
            if hinted > self.rank[klass]:
                klass = self.names[hinted]
        return Identity(tenant, klass, weight, kid, self.adapters.get(h) if self.by_key else None)


def _allowed(*lists: list[str] | None) -> frozenset[str] | None:
    """What every given allow-list allows (None: no list, everything)."""
    out: frozenset[str] | None = None
    for names in lists:
        if names is not None:
            out = frozenset(names) if out is None else out & frozenset(names)
    return out
