"""API keys at rest: only their SHA-256 is kept (``key_sha256`` in the config).

``new_key()`` makes a fresh random key (``weir keys new`` prints it once);
``digest()`` is the one hashing of a presented key; ``key_id()`` a short,
non-secret name for a key (a prefix of its digest) for metrics, admin views
and logs, which never show a key itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.config import ApiKey, Config

KEY_PREFIX = "sk-weir-"

# The one rule for a key's text, the same at Envoy (deploy/envoy_config.py's
# Lua runs it before any rate-limit bucket is touched) and at the router
# (HTTP headers and direct ZeroMQ clients alike): a header value is trimmed
# of ASCII spaces and tabs only, and what is left must be printable ASCII
# without spaces.  Anything else is a malformed key (401): were U+00A0 or
# another byte trimmed or kept by one side only, KEY + junk would be a fresh
# Envoy bucket but the same key to the router.
_WELL_FORMED = re.compile(r"[\x21-\x7e]+")
_OWS = " \t"


def admin_token(cfg: Config) -> str | None:
    """The router's admin token (``router.admin_token_file``), None if none is configured."""
    if not cfg.router.admin_token_file:
        return None
    path = cfg.resolve(cfg.router.admin_token_file)
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        from shared.config import ConfigError

        raise ConfigError(f"router.admin_token_file: {e}") from None
    if not well_formed(token):
        from shared.config import ConfigError

        raise ConfigError(f"router.admin_token_file {path}: the token must be printable ASCII without spaces")
    return token


def admin_headers(cfg: Config) -> dict[str, str]:
    """What a caller of a router's /admin/* sends (nothing without a token: loopback)."""
    token = admin_token(cfg)
    return {"authorization": f"Bearer {token}"} if token else {}


def well_formed(key: str) -> bool:
    return _WELL_FORMED.fullmatch(key) is not None


def key_from_headers(x_api_key: str | None, authorization: str | None) -> str | None:
    """The key a request presents, before the ``well_formed`` check (header
    values as latin-1 text, one character per byte): ``x-api-key`` trimmed,
    else the token of ``Authorization: Bearer TOKEN``; None: no key.
    Envoy's Lua (deploy/envoy_config.py) is this function line by line."""
    key = x_api_key.strip(_OWS) if x_api_key is not None else ""
    if not key and authorization is not None:
        auth = authorization.strip(_OWS)
        cut = min((i for i in (auth.find(" "), auth.find("\t")) if i >= 0), default=-1)
        if cut > 0 and auth[:cut].lower() == "bearer":
            key = auth[cut:].lstrip(_OWS)
    return key or None


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_id(sha256_hex: str) -> str:
    """A key's public name: the first 12 hex digits of its digest."""
    return sha256_hex[:12].lower()


def config_digest(k: ApiKey) -> str:
    """The digest of a config ``[[api_keys]]`` entry (hashed or plain)."""
    if k.key_sha256 is not None:
        return k.key_sha256.lower()
    assert k.key is not None, "config validation: an api key has key_sha256 or key"
    return digest(k.key)


def world_readable(path: str | None) -> bool:
    if not path:
        return False
    try:
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    except OSError:
        return False


def secret_warnings(cfg: Config, path: str | None) -> list[str]:
    """What an operator should hear about the secrets in a config: plain
    keys, and a world-readable file that holds any secret.  Never the
    secret itself."""
    out = []
    plain = [(k.tenant, k.key) for k in cfg.api_keys if k.key is not None]
    for tenant, key in plain:
        out.append(
            f"api key {key_id(digest(key))} of tenant {tenant!r} is stored in plain text: "
            f'replace `key` with `key_sha256 = "{digest(key)}"` (or make a new one: weir keys new)'
        )
    has_secret = bool(plain) or "@" in cfg.quota.redis_url
    if has_secret and world_readable(path):
        out.append(f"config {path} holds secrets and is world-readable: chmod o-r it")
    return out


def redact_url(url: str) -> str:
    """``redis://user:pass@host`` -> ``redis://***@host`` for logs."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"
    return url
