"""A worker pod's probes and preStop, asked of the router (the worker has no port).

    python -m deploy.k8s_probe ready   # exit 0 iff the router has this pod's worker as ready
    python -m deploy.k8s_probe drain   # POST .../drain, then wait until nothing of it runs

The worker is ``$POD_NAME`` (it registers under it: --instance-id), the
config ``$WEIR_CONFIG``; the router is the host of the worker's
``router.backend`` on ``router.http``'s port (deploy/k8s_objects.py renders both).
Standard library only: a probe runs every 10 s in every worker pod.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

from shared.config import load, split_hostport

TIMEOUT_S = 3.0
POLL_S = 0.5


def _router_url(cfg) -> str:
    host, _ = split_hostport(cfg.router.backend.partition("://")[2])
    _, port = split_hostport(cfg.router.http)
    return f"http://{host}:{port}"


def _call(url: str, method: str = "GET"):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with opener.open(req, timeout=TIMEOUT_S) as resp:
        return json.loads(resp.read() or b"null")


def _worker(base: str, worker_id: str):
    """This worker as the router sees it (one worker: O(1) for the router), None if unknown."""
    try:
        return _call(f"{base}/admin/workers/{worker_id}")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def ready(base: str, worker_id: str) -> bool:
    w = _worker(base, worker_id)
    return w is not None and w.get("state") == "ready"


def drain(base: str, worker_id: str, timeout_s: float) -> str:
    """Drain at the router and wait for this worker's running requests (or the timeout)."""
    try:
        _call(f"{base}/admin/workers/{worker_id}/drain", "POST")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return "not registered"
        raise
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w = _worker(base, worker_id)
        if w is None or not w.get("running"):
            return "drained"
        time.sleep(POLL_S)
    return "timeout"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] not in (["ready"], ["drain"]):
        print(__doc__, file=sys.stderr)
        return 2
    cfg = load(os.environ.get("WEIR_CONFIG"))
    worker_id = os.environ.get("POD_NAME") or (argv[1] if len(argv) > 1 else "")
    if not worker_id:
        print("k8s_probe: no worker id ($POD_NAME)", file=sys.stderr)
        return 2
    base = _router_url(cfg)
    try:
        if argv[0] == "ready":
            ok = ready(base, worker_id)
            print("ready" if ok else "not ready")
            return 0 if ok else 1
        print(drain(base, worker_id, cfg.router.drain_timeout_s))
        return 0  # preStop: whatever happened, SIGTERM's own drain follows
    except (OSError, ValueError) as e:
        print(f"k8s_probe: router {base}: {e}", file=sys.stderr)
        return 1 if argv[0] == "ready" else 0


if __name__ == "__main__":
    sys.exit(main())
