"""The router's /admin/* on a real socket (router.ingress.http_server with the
scripted core of test_http_server): from an address other than loopback it
needs the admin token (401 without it or with a wrong one, and the action is
not carried out); from loopback without a token it stays open (`weir up`, the
CLI).  And the admin listener (router.admin_http) serves no API."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import requests
import uvloop

from router.ingress.http_server import start_http_server
from router.ingress.routes import admin_allowed
from router.observe.exposition import MetricsPage
from router.observe.metrics import RouterMetrics

TOKEN = "adm-0123456789abcdef"


class _Operator:
    """router.observe.operator_actions.RouterOperator's interface; counts what it was told to do."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def add_model(self, body):
        self.done.append("add_model")
        return 200, {"ok": True}

    def remove_model(self, name):
        self.done.append(f"remove_model {name}")
        return 200, {"ok": True}

    def drain(self, worker_id, on):
        self.done.append(f"drain {worker_id}")
        return True

    def reload(self):
        self.done.append("reload")
        return {"ok": True}

    def drain_router(self):
        self.done.append("drain_router")
        return {"ok": True}


def _non_loopback_ip() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("198.51.100.1", 9))
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


@pytest.fixture(scope="module")
def router():
    from test_http_server import ScriptedCore

    class Core(ScriptedCore):
        def admin_worker(self, worker_id):  # what a worker pod's probes ask (deploy/k8s_probe.py)
            return {"id": worker_id, "state": "ready", "running": 0} if worker_id == "w0" else None

    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("no address other than loopback to reach the router on")
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    core = Core()
    metrics = RouterMetrics(core.registry)
    core.page = MetricsPage(core.registry, metrics.sources)
    op = _Operator()

    async def start():
        api = await start_http_server(core, core, metrics, "0.0.0.0", 0, operator=op, admin_token=TOKEN)
        admin = await start_http_server(
            core, core, metrics, "0.0.0.0", 0, operator=op, admin_token=TOKEN, admin_plane=True
        )
        return api, admin

    servers = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    ports = [srv.sockets[0].getsockname()[1] for srv in servers]
    yield ip, ports, op
    for srv in servers:
        loop.call_soon_threadsafe(srv.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


ADMIN_CALLS = [
    ("POST", "/admin/drain", "drain_router"),
    ("POST", "/admin/reload", "reload"),
    ("POST", "/admin/models/tiny/remove", "remove_model tiny"),
    ("POST", "/admin/workers/w0/drain", "drain w0"),
    ("GET", "/admin/workers", None),
    ("GET", "/admin/queues", None),
]


@pytest.mark.parametrize("listener", [0, 1], ids=["api-port", "admin-port"])
@pytest.mark.parametrize(("method", "path", "action"), ADMIN_CALLS)
def test_admin_from_another_address_needs_the_token(router, listener, method, path, action):
    ip, ports, op = router
    url = f"http://{ip}:{ports[listener]}{path}"
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": f"Bearer {TOKEN}x"},
        {"x-api-key": TOKEN},
    ):
        before = list(op.done)
        r = requests.request(method, url, headers=headers, data=b"" if method == "POST" else None, timeout=5)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("authentication_error", "invalid_admin_token")
        assert op.done == before, "a refused admin call did something"
    r = requests.request(
        method, url, headers={"authorization": f"Bearer {TOKEN}"}, data=b"" if method == "POST" else None, timeout=5
    )
    assert r.status_code == 200, r.text
    if action is not None:
        assert op.done[-1] == action


def test_loopback_without_a_token_stays_open_but_a_wrong_token_is_refused(router):
    _, ports, op = router
    url = f"http://127.0.0.1:{ports[0]}"
    assert requests.get(url + "/admin/workers", timeout=5).status_code == 200
    assert requests.post(url + "/admin/reload", timeout=5).status_code == 200 and op.done[-1] == "reload"
    r = requests.get(url + "/admin/workers", headers={"authorization": "Bearer wrong"}, timeout=5)
    assert r.status_code == 401


def test_the_rest_needs_no_admin_token(router):
    ip, ports, _ = router
    for path in ("/health", "/metrics", "/v1/models"):
        assert requests.get(f"http://{ip}:{ports[0]}{path}", timeout=5).status_code == 200, path


def test_the_admin_listener_serves_no_api(router):
    ip, ports, _ = router
    admin = f"http://{ip}:{ports[1]}"
    for path in ("/health", "/metrics"):
        assert requests.get(admin + path, timeout=5).status_code == 200, path
    r = requests.get(admin + "/v1/models", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.post(admin + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("token", "authorization", "loopback", "allowed"),
    [
        (None, None, True, True),
        (None, None, False, False),
        (None, "Bearer x", True, False),  # a token where none is configured: refused, even from loopback
        (TOKEN, None, False, False),
        (TOKEN, "", False, False),
        (TOKEN, f"Bearer {TOKEN}", False, True),
        (TOKEN, f"bearer  {TOKEN} ", False, True),
        (TOKEN, f"Bearer {TOKEN[:-1]}", False, False),
        (TOKEN, f"Bearer {TOKEN}", True, True),
        (TOKEN, "Bearer nope", True, False),
        (TOKEN, f"Token {TOKEN}", False, False),
    ],
)
def test_admin_allowed_rule(token, authorization, loopback, allowed):
    assert admin_allowed(token, authorization, loopback) is allowed


@pytest.mark.parametrize("token_ok", [True, False], ids=["right-token", "wrong-token"])
def test_a_worker_pods_probe_and_drain_send_the_token(router, tmp_path, token_ok):
    """deploy/k8s_probe.py as a worker pod runs it: the routers' admin listener on
    an address other than loopback, the token from the file its config names."""
    import os
    import subprocess
    import sys

    from stackutil import REPO, write_config

    ip, ports, op = router
    token_file = tmp_path / "token"
    token_file.write_text((TOKEN if token_ok else "not-the-token") + "\n")
    cfg = write_config(
        tmp_path,
        router={"backend": f"tcp://{ip}:5556", "admin_http": f"{ip}:{ports[1]}", "admin_token_file": str(token_file)},
    )
    env = {**os.environ, "WEIR_CONFIG": str(cfg), "POD_NAME": "w0", "PYTHONPATH": str(REPO)}
    probe = [sys.executable, "-m", "deploy.k8s_probe"]
    ready = subprocess.run([*probe, "ready"], env=env, capture_output=True, text=True, timeout=30)
    assert ready.returncode == (0 if token_ok else 1), ready.stderr
    before = list(op.done)
    drain = subprocess.run([*probe, "drain"], env=env, capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0  # preStop: whatever happened
    if token_ok:
        assert drain.stdout.strip() == "drained" and op.done[len(before) :] == ["drain w0"]
    else:
        assert op.done == before and "401" in drain.stderr
