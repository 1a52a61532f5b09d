"""CURVE keys and Envoy's TLS certificate in the rendered Kubernetes objects.

Key material lives only in Secrets the operator creates from files
(``secret_commands`` prints the exact ``kubectl create secret`` lines; `weir
render-k8s` prints them too), never in the ConfigMap and never in the
rendered files -- so deploy/k8s/ can be committed and the keys cannot.  The
manifests name the Secrets and project the keys they need:

    weir-curve-router      router pods, at /etc/weir-curve: router.key, router.key_secret,
                           workers/<id>.key and clients/<name>.key (the public keys let in)
    <statefulset>-curve    that worker StatefulSet's pods, at /etc/weir-curve:
                           worker.key_secret (the group's pair), router.key
    weir-envoy-tls         Envoy pods, at /etc/weir-tls: tls.crt, tls.key -- the
                           kubernetes.io/tls shape cert-manager writes
    weir-admin-token       router and worker pods, at /etc/weir-admin: token -- the
                           router's /admin/* token (router.admin_token_file), which
                           the workers' probes and preStop drain send (always rendered)

One worker key pair per StatefulSet, shared by its replicas: pods come and
go with the autoscaler and are named at run time, so a key per pod would need
a controller to mint and register it; the router identifies a worker by its
registered id (the pod name), the key only proves the pod belongs to the fleet.
Revoking a StatefulSet's key is one public key out of weir-curve-router.

The key directory is the config's ``security.curve_dir`` as `weir keys curve
DIR` lays it out (shared/curve.py); a StatefulSet's pair is that of the
[[workers]] entry its pods run (``WorkerConfig.curve_secret_key`` or
workers/<id>.key_secret).  Rendering reads the directory for file names and
public keys only: a missing file is a ConfigError naming it.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.k8s_groups import WorkerGroup
from shared.config import Config, ConfigError
from shared.curve import ROUTER, worker_key_files

CURVE_DIR = "/etc/weir-curve"
TLS_DIR = "/etc/weir-tls"
ROUTER_CURVE_SECRET = "weir-curve-router"
ENVOY_TLS_SECRET = "weir-envoy-tls"
ADMIN_DIR = "/etc/weir-admin"
ADMIN_SECRET = "weir-admin-token"
ADMIN_TOKEN = "token"  # the Secret's key and the file's name
ADMIN_TOKEN_FILE = f"{ADMIN_DIR}/{ADMIN_TOKEN}"
WORKER_KEY = "worker.key_secret"  # a worker pod's own pair, whichever entry it runs
_KEEP = ".present"  # a hidden (never loaded) file that makes an empty key subdirectory exist


def worker_secret(g: WorkerGroup) -> str:
    return f"{g.name}-curve"


def _public_of(secret_file: str) -> str:
    return secret_file.removesuffix("_secret")


def _key_dir(cfg: Config) -> Path:
    return Path(cfg.resolve(cfg.security.curve_dir))


def _group_files(cfg: Config, g: WorkerGroup) -> tuple[str, str]:
    """(the group's secret key file, its public key file)."""
    secret, _ = worker_key_files(cfg, g.template)
    return secret, _public_of(secret)


def _public_keys(cfg: Config, groups: Sequence[WorkerGroup], sub: str) -> dict[str, str]:
    """Secret key name -> local file of every public key the router lets in on one plane."""
    d = _key_dir(cfg) / sub
    files = {p.name: str(p) for p in sorted(d.glob("*.key"))} if d.is_dir() else {}
    if sub == "workers":
        for g in groups:
            public = _group_files(cfg, g)[1]
            files.setdefault(Path(public).name, public)
    return {f"{sub}.{name}": path for name, path in files.items()}


def check(cfg: Config, groups: Sequence[WorkerGroup]) -> None:
    """ConfigError naming every key file CURVE needs and the directory lacks."""
    if not cfg.security.curve:
        return
    d = _key_dir(cfg)
    need = [str(d / f"{ROUTER}.key"), str(d / f"{ROUTER}.key_secret")]
    for g in groups:
        need += list(_group_files(cfg, g))
    missing = [f for f in need if not Path(f).is_file()]
    if missing:
        raise ConfigError(
            f"security.curve: key files missing: {', '.join(missing)} (`weir keys curve {d} --workers "
            f"{','.join(g.template.id for g in groups)}` makes them)"
        )


def router_secret_files(cfg: Config, groups: Sequence[WorkerGroup]) -> dict[str, str]:
    """weir-curve-router's keys -> local files."""
    d = _key_dir(cfg)
    return {
        f"{ROUTER}.key": str(d / f"{ROUTER}.key"),
        f"{ROUTER}.key_secret": str(d / f"{ROUTER}.key_secret"),
        **_public_keys(cfg, groups, "workers"),
        **_public_keys(cfg, groups, "clients"),
    }


def worker_secret_files(cfg: Config, g: WorkerGroup) -> dict[str, str]:
    return {WORKER_KEY: _group_files(cfg, g)[0], f"{ROUTER}.key": str(_key_dir(cfg) / f"{ROUTER}.key")}


def secret_commands(cfg: Config, groups: Sequence[WorkerGroup]) -> list[list[str]]:
    """The ``kubectl`` commands that create every Secret the manifests name."""
    ns = cfg.kubernetes.namespace
    out: list[list[str]] = []

    def generic(name: str, files: dict[str, str]) -> list[str]:
        return [
            "kubectl",
            "-n",
            ns,
            "create",
            "secret",
            "generic",
            name,
            *(f"--from-file={k}={v}" for k, v in files.items()),
        ]

    if cfg.security.curve:
        check(cfg, groups)
        out.append(generic(ROUTER_CURVE_SECRET, router_secret_files(cfg, groups)))
        out += [generic(worker_secret(g), worker_secret_files(cfg, g)) for g in groups]
    # The admin token: the config's file, else a fresh one (printed once, like `weir keys new`)
    token = (
        f"--from-file={ADMIN_TOKEN}={cfg.resolve(cfg.router.admin_token_file)}"
        if cfg.router.admin_token_file
        else (f"--from-literal={ADMIN_TOKEN}={secrets.token_urlsafe(32)}")
    )
    out.append(["kubectl", "-n", ns, "create", "secret", "generic", ADMIN_SECRET, token])
    if cfg.envoy.tls_cert_file and cfg.envoy.tls_key_file:
        cert, key = cfg.resolve(cfg.envoy.tls_cert_file), cfg.resolve(cfg.envoy.tls_key_file)
        out.append(["kubectl", "-n", ns, "create", "secret", "tls", ENVOY_TLS_SECRET, f"--cert={cert}", f"--key={key}"])
    return out


def public_keys_sha(cfg: Config, groups: Sequence[WorkerGroup]) -> str:
    """A digest of the public keys (never a secret one): in the pods' annotation,
    so a re-render after a key change rolls them onto the new Secret."""
    h = hashlib.sha256()
    for name, path in sorted(router_secret_files(cfg, groups).items()):
        if not name.endswith("_secret"):
            h.update(name.encode() + b"\0" + Path(path).read_bytes())
    return h.hexdigest()[:16]


def _projected(name: str, secret: str, items: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "name": name,
        "projected": {
            # the image runs as 65532 and the files are root's: readable, as the
            # container has that one user (the Secret itself is the access boundary)
            "defaultMode": 0o444,
            "sources": [{"secret": {"name": secret, "items": [{"key": k, "path": p} for k, p in items]}}],
        },
    }


def router_curve_volume(cfg: Config, groups: Sequence[WorkerGroup]) -> dict[str, Any]:
    """The router's key directory as shared/curve.py reads it.  The key
    subdirectories must exist (the ZAP handler loads each; a projected volume
    is read-only), hence a hidden placeholder in each, which ``*.key`` skips."""
    keys = router_secret_files(cfg, groups)
    items = [(k, k.replace(".", "/", 1) if k.startswith(("workers.", "clients.")) else k) for k in keys]
    items += [(f"{ROUTER}.key", f"{sub}/{_KEEP}") for sub in ("workers", "clients")]
    return _projected("curve", ROUTER_CURVE_SECRET, items)


def worker_curve_volume(g: WorkerGroup) -> dict[str, Any]:
    return _projected("curve", worker_secret(g), [(WORKER_KEY, WORKER_KEY), (f"{ROUTER}.key", f"{ROUTER}.key")])


def envoy_tls_volume() -> dict[str, Any]:
    return {"name": "tls", "secret": {"secretName": ENVOY_TLS_SECRET, "defaultMode": 0o444}}


def admin_volume() -> dict[str, Any]:
    return _projected("admin", ADMIN_SECRET, [(ADMIN_TOKEN, ADMIN_TOKEN)])


def admin_mount() -> dict[str, Any]:
    return {"name": "admin", "mountPath": ADMIN_DIR, "readOnly": True}


def curve_mount() -> dict[str, Any]:
    return {"name": "curve", "mountPath": CURVE_DIR, "readOnly": True}


def tls_mount() -> dict[str, Any]:
    return {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
