"""A worker pod's probes and preStop, asked of the routers (the worker has no port);
an Envoy pod's preStop.

    python -m deploy.k8s_probe ready   # exit 0 iff some router has this pod's worker as ready
    python -m deploy.k8s_probe drain   # POST .../drain at every router, then wait until nothing of it runs
    python -m deploy.k8s_probe envoy-drain ADMIN_PORT PAUSE_S MAX_S

The worker is ``$POD_NAME`` (it registers under it: --instance-id), the
config ``$WEIR_CONFIG``; the routers are every address of the host of the
worker's ``router.backend`` (the headless Service: every router pod, as the
worker links to them), on ``router.admin_http``'s port (else ``router.http``'s;
deploy/k8s_objects.py renders both), with the admin token of
``router.admin_token_file`` (the Secret weir-admin-token).

``envoy-drain``: Envoy's listeners drain gracefully (admin
``/drain_listeners?graceful``: every connection is told to close, new ones
are still taken for Envoy's ``--drain-time-s`` while the Service stops
sending here); after PAUSE_S it waits until no request is active (the
streams in flight end), at most MAX_S more; then the kubelet's SIGTERM
finds Envoy idle.
Standard library only: a probe runs every 10 s in every worker pod.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from shared.config import Config, load, split_hostport
from shared.keys import admin_headers

TIMEOUT_S = 3.0
POLL_S = 0.5


def _router_urls(cfg: Config) -> list[str]:
    host, _ = split_hostport(cfg.router.backend.partition("://")[2])
    _, port = split_hostport(cfg.router.admin_http or cfg.router.http)
    try:
        ips = sorted({str(a[4][0]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
    except OSError:
        ips = []
    return [f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}" for ip in ips] or [f"http://{host}:{port}"]


# The router's admin token (router.admin_token_file: the Secret weir-admin-token
# mounted in the pod): a router answers /admin/* from another pod only with it.
_ADMIN: dict[str, str] = {}


def _call(url: str, method: str = "GET") -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None, headers=_ADMIN)
    with opener.open(req, timeout=TIMEOUT_S) as resp:
        return json.loads(resp.read() or b"null")


def _worker(base: str, worker_id: str) -> dict[str, Any] | None:
    """This worker as the router sees it (one worker: O(1) for the router), None if unknown."""
    try:
        w: dict[str, Any] = _call(f"{base}/admin/workers/{worker_id}")  # GET /admin/workers/ID: one object
        return w
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def ready(bases: list[str], worker_id: str) -> bool:
    """Registered and taking work at some router (a router unreachable now counts as not)."""
    for base in bases:
        try:
            w = _worker(base, worker_id)
        except (OSError, ValueError):
            continue
        if w is not None and w.get("state") == "ready":
            return True
    return False


def drain(bases: list[str], worker_id: str, timeout_s: float) -> str:
    """Drain at every router and wait for this worker's running requests there (or the timeout)."""
    draining = []
    for base in bases:
        try:
            _call(f"{base}/admin/workers/{worker_id}/drain", "POST")
            draining.append(base)
        except urllib.error.HTTPError as e:
            if e.code != 404:  # 404: not registered there
                raise
        except OSError as e:  # a router going away: SIGTERM's own drain covers it
            print(f"k8s_probe: router {base}: {e}", file=sys.stderr)
    if not draining:
        return "not registered"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = False
        for base in draining:
            try:
                w = _worker(base, worker_id)
            except (OSError, ValueError):
                continue
            busy = busy or (w is not None and bool(w.get("running")))
        if not busy:
            return "drained"
        time.sleep(POLL_S)
    return "timeout"


def envoy_drain(admin_port: int, pause_s: float, max_s: float) -> str:
    base = f"http://127.0.0.1:{admin_port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    opener.open(urllib.request.Request(f"{base}/drain_listeners?graceful", method="POST", data=b""), timeout=TIMEOUT_S)
    time.sleep(pause_s)
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        with opener.open(f"{base}/stats?filter=downstream_rq_active$&format=json", timeout=TIMEOUT_S) as resp:
            stats = json.loads(resp.read()).get("stats", [])
        # every HTTP listener's active requests but the admin's own (this very query)
        active = [
            st for st in stats if st.get("name", "").startswith("http.") and not st["name"].startswith("http.admin.")
        ]
        if not any(st.get("value") for st in active):
            return "drained"
        time.sleep(POLL_S)
    return "timeout"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["envoy-drain"] and len(argv) == 4:
        try:
            print(envoy_drain(int(argv[1]), float(argv[2]), float(argv[3])))
        except (OSError, ValueError) as e:
            print(f"k8s_probe: envoy admin: {e}", file=sys.stderr)
        return 0  # preStop: whatever happened, SIGTERM follows
    if argv[:1] not in (["ready"], ["drain"]):
        print(__doc__, file=sys.stderr)
        return 2
    cfg = load(os.environ.get("WEIR_CONFIG"))
    worker_id = os.environ.get("POD_NAME") or (argv[1] if len(argv) > 1 else "")
    if not worker_id:
        print("k8s_probe: no worker id ($POD_NAME)", file=sys.stderr)
        return 2
    bases = _router_urls(cfg)
    try:
        _ADMIN.update(admin_headers(cfg))
        if argv[0] == "ready":
            ok = ready(bases, worker_id)
            print("ready" if ok else "not ready")
            return 0 if ok else 1
        print(drain(bases, worker_id, cfg.router.drain_timeout_s))
        return 0  # preStop: whatever happened, SIGTERM's own drain follows
    except (OSError, ValueError) as e:  # (ConfigError: the token file unreadable)
        print(f"k8s_probe: routers {bases}: {e}", file=sys.stderr)
        return 1 if argv[0] == "ready" else 0


if __name__ == "__main__":
    sys.exit(main())
