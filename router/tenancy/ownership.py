"""Who may see a stored object: the one rule for responses, files and batches.

Every stored object carries its owner: the tenant, and for a stored response
also the digest of the API key that made it.  A caller is identified from
its key as the router's keys read now (after the last reload).  The rule:

- keys configured and none (or an unknown one) presented: 401, before any
  object is looked up;
- an object of another tenant is answered as one that does not exist (404,
  never 403: its existence is not disclosed);
- an object that names its key is visible only while that key is still
  configured for the object's tenant: a key removed or moved to another
  tenant by a reload takes its stored responses with it (revocation).

Pure (no I/O): the callers look the object up and act on the answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

from router.tenancy.identity import ANONYMOUS_TENANT, malformed_key
from shared.errors import Code, error
from shared.keys import digest, well_formed
from shared.protocol import ErrorInfo


class KeyEntry(Protocol):
    """What the rule reads of a configured key (shared.config.ApiKey)."""

    @property
    def tenant(self) -> str: ...


class Caller(NamedTuple):
    tenant: str
    key: str  # SHA-256 of the presented key; "" when no keys are configured


def caller_of(by_key: Mapping[str, KeyEntry], api_key: str | None) -> Caller | ErrorInfo:
    """The caller of a request presenting ``api_key``, or the 401 to answer."""
    if api_key and not well_formed(api_key):  # the rule Envoy applies (shared.keys)
        return malformed_key()
    if not by_key:
        return Caller(ANONYMOUS_TENANT, "")
    h = digest(api_key) if api_key else ""
    entry = by_key.get(h)
    if entry is None:
        return error(Code.INVALID_API_KEY, "Incorrect API key provided.")
    return Caller(entry.tenant, h)


def key_live(owner_tenant: str, owner_key: str, by_key: Mapping[str, KeyEntry]) -> bool:
    """Whether the key an object was made with still speaks for its tenant."""
    if not by_key:
        return owner_key == ""
    entry = by_key.get(owner_key)
    return entry is not None and entry.tenant == owner_tenant


def may_see(
    owner_tenant: str,
    caller_tenant: str,
    owner_key: str | None = None,
    by_key: Mapping[str, KeyEntry] | None = None,
) -> bool:
    """Whether a caller of ``caller_tenant`` may read, continue, cancel or
    delete an object owned by ``owner_tenant`` (made with ``owner_key``,
    checked against the configured keys ``by_key``, when it names one)."""
    if owner_tenant != caller_tenant:
        return False
    return owner_key is None or key_live(owner_tenant, owner_key, by_key or {})
