"""CURVE on the ZeroMQ planes: key files, the router's ZAP authenticator, socket set-up.

Layout of a key directory (``weir keys curve DIR``; ``[security] curve_dir``):

    DIR/router.key, DIR/router.key_secret          the router (both planes)
    DIR/workers/<id>.key, <id>.key_secret          one pair per engine worker
    DIR/clients/<name>.key, <name>.key_secret      one pair per direct client

``*.key`` hold a public key only; ``*.key_secret`` both (mode 0600): give a
worker or a client its own ``.key_secret`` and ``router.key``.  The router's
frontend lets in only the public keys in ``clients/``, its backend only those
in ``workers/`` (pyzmq's ZAP authenticator, one ZAP domain per plane); any
other key never completes the handshake -- no message of its reaches the
router -- and is counted (``weir_zmq_auth_denied``) and logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from shared.config import Config, WorkerConfig

log = logging.getLogger("weir.curve")

ROUTER = "router"
DOMAINS = {"frontend": "clients", "backend": "workers"}  # plane -> ZAP domain == subdirectory

StrPath = str | os.PathLike[str]
Socket = zmq.Socket[bytes]
Context = zmq.Context[zmq.Socket[bytes]]


def generate(directory: StrPath, workers: list[str], clients: list[str]) -> list[Path]:
    """Key pairs for the router, each worker and each client (existing ones are kept)."""
    d = Path(directory)
    made: list[Path] = []
    for sub, names in (("", [ROUTER]), ("workers", workers), ("clients", clients)):
        where = d / sub if sub else d
        where.mkdir(parents=True, exist_ok=True)
        for name in names:
            if (where / f"{name}.key_secret").exists():
                continue
            public, secret = zmq.auth.create_certificates(str(where), name)
            os.chmod(secret, 0o600)
            made.append(Path(secret))
    return made


def load_pair(secret_file: StrPath) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise ValueError(f"{secret_file}: no secret key in it (a .key_secret file is needed)")
    return public, secret


def load_public(public_file: StrPath) -> bytes:
    public, _ = zmq.auth.load_certificate(str(public_file))
    return public


def client_socket(sock: Socket, secret_file: StrPath, server_public_file: StrPath) -> None:
    """Make ``sock`` (before connect) a CURVE client of the router."""
    public, secret = load_pair(secret_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = load_public(server_public_file)


def worker_key_files(cfg: Config, wcfg: WorkerConfig) -> tuple[str, str]:
    """(the worker's secret key file, the router's public key file) from the config."""
    d = Path(cfg.resolve(cfg.security.curve_dir))
    secret = (
        cfg.resolve(wcfg.curve_secret_key) if wcfg.curve_secret_key else str(d / "workers" / f"{wcfg.id}.key_secret")
    )
    return secret, str(d / f"{ROUTER}.key")


class _CountingAuthenticator(ThreadAuthenticator):
    on_denied: Callable[[str, str], None] | None = None

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            try:
                name = zmq.utils.z85.encode(client_key)[:8].decode() if len(client_key) == 32 else "?"
            except Exception:  # noqa: BLE001
                name = "?"
            log.warning("CURVE: refused a %s key (%s...) : %s", domain, name, reason.decode(errors="replace"))
            if self.on_denied is not None:
                self.on_denied(domain, name)
        return allowed, reason


_auth_lock = threading.Lock()
_authenticators: dict[int, _CountingAuthenticator] = {}


def _authenticator(
    ctx: Context, curve_dir: Path, on_denied: Callable[[str, str], None] | None
) -> _CountingAuthenticator:
    """One ZAP handler per context, serving both planes' domains."""
    with _auth_lock:
        auth = _authenticators.get(id(ctx))
        if auth is None:
            auth = _CountingAuthenticator(ctx, log=logging.getLogger("weir.curve.zap"))
            auth.on_denied = on_denied
            auth.start()
            for domain in DOMAINS.values():
                (curve_dir / domain).mkdir(parents=True, exist_ok=True)
                auth.configure_curve(domain=domain, location=str(curve_dir / domain))
            _authenticators[id(ctx)] = auth
        return auth


def server_configure(
    ctx: Context, curve_dir: StrPath, plane: str, on_denied: Callable[[str, str], None] | None = None
) -> Callable[[Socket], None]:
    """What ``bind_router`` applies before binding a plane's ROUTER socket as a CURVE server."""
    d = Path(curve_dir)
    public, secret = load_pair(d / f"{ROUTER}.key_secret")
    _authenticator(ctx, d, on_denied)

    def configure(sock: Socket) -> None:
        sock.zap_domain = DOMAINS[plane].encode()
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    return configure


def stop_authenticators() -> None:
    with _auth_lock:
        for auth in _authenticators.values():
            auth.stop()
        _authenticators.clear()
