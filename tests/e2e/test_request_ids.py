"""Request ids end to end: Envoy's x-request-id (or the client's) reaches the
router and the worker, is in their log lines (JSON with [logging] format =
"json") and in every error body, and comes back on the response.

One own stack (sim worker, ~2 s): logging options are per process."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import requests
import stackutil

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture(scope="module")
def logged_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("request_ids")
    cfg = stackutil.write_config(
        d,
        workers=[stackutil.sim_worker("sim-0")],
        envoy={"access_log": True},
        logging={"format": "json", "requests": True},
    )
    with stackutil.start_stack(cfg, d / "run") as s:
        yield s


def _json_lines(path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _lines_with(stack, component: str, rid: str, timeout: float = 5.0) -> list[dict]:
    log = stack.components[component].log_path
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in _json_lines(log) if r.get("request_id") == rid]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _complete(url: str, headers: dict | None = None, **body) -> requests.Response:
    payload = {"model": stackutil.SIM_MODEL, "prompt": "hello there", "max_tokens": 4, **body}
    return requests.post(url + "/v1/completions", json=payload, headers=headers or {}, timeout=30)


def test_clients_id_travels_to_router_and_worker_logs(logged_stack):
    rid = f"client-{uuid.uuid4().hex[:12]}"
    r = _complete(logged_stack.envoy_url, {"x-request-id": rid})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    (router,) = _lines_with(logged_stack, "router", rid)
    assert router["component"] == "router" and router["outcome"] == "length" and router["status"] == 200
    assert f"request {rid} length status=200 model=sim-tiny" in router["msg"]
    (worker,) = _lines_with(logged_stack, "worker:sim-0", rid)
    assert worker["component"] == "worker[sim-0]" and worker["outcome"] == "length"
    assert "completion_tokens=4" in worker["msg"]


def test_envoy_makes_an_id_when_the_client_sends_none(logged_stack):
    r = _complete(logged_stack.envoy_url, stream=True)
    assert r.status_code == 200 and "[DONE]" in r.text
    rid = r.headers["x-request-id"]
    assert UUID.match(rid), rid
    assert _lines_with(logged_stack, "router", rid) and _lines_with(logged_stack, "worker:sim-0", rid)


def test_error_bodies_carry_the_id(logged_stack):
    envoy = logged_stack.envoy_url
    # refused by the router (unknown model: 404) ...
    r = _complete(envoy, {"x-request-id": "err-404-a"}, model="no-such-model")
    assert r.status_code == 404 and r.json()["error"]["request_id"] == "err-404-a"
    assert r.headers["x-request-id"] == "err-404-a"
    # ... a bad body (400) ...
    r = _complete(envoy, {"x-request-id": "err-400-b"}, temperature=9)
    assert r.status_code == 400 and r.json()["error"]["request_id"] == "err-400-b"
    assert r.json()["error"]["param"] is None or isinstance(r.json()["error"]["param"], str)
    # ... and by Envoy itself (its local reply: 404 for a path it does not route)
    r = requests.get(envoy + "/nope", headers={"x-request-id": "err-envoy-c"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["request_id"] == "err-envoy-c"
    assert r.headers["x-request-id"] == "err-envoy-c"


def test_router_direct_ids_and_unusable_ones(logged_stack):
    router = logged_stack.router_url
    r = _complete(router)  # no header: the response's own id
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
    assert _lines_with(logged_stack, "router", r.json()["id"])
    r = _complete(router, {"x-request-id": "x" * 129}, model="no-such-model")  # too long: ours instead
    assert r.status_code == 404
    assert r.json()["error"]["request_id"] != "x" * 129 and r.headers["x-request-id"] == r.json()["error"]["request_id"]
    r = requests.post(router + "/v1/completions", data=b"{not json", timeout=10)  # an error before any parse
    assert r.status_code == 400 and r.json()["error"]["request_id"] == r.headers["x-request-id"]


def test_zeromq_clients_trace_id(logged_stack):
    from shared.client import Client, WeirError

    with Client(logged_stack.zmq_frontend) as c:
        out = c.complete(stackutil.SIM_MODEL, "hello", max_tokens=3, trace_id="zmq-trace-7")
        with pytest.raises(WeirError) as bad:  # not one to log or echo: a 400 naming it
            c.complete(stackutil.SIM_MODEL, "hello", max_tokens=3, trace_id="two words")
    assert out.completion_tokens == 3
    assert bad.value.error.status == 400 and "trace_id" in bad.value.error.message
    assert _lines_with(logged_stack, "router", "zmq-trace-7")
    assert _lines_with(logged_stack, "worker:sim-0", "zmq-trace-7")


def test_envoy_access_log_is_json_too(logged_stack):
    """Last in this module: Envoy flushes its log every 10 s (--file-flush-interval-msec)."""
    (envoy,) = _lines_with(logged_stack, "envoy", "err-404-a", timeout=15)
    assert envoy["component"] == "envoy" and envoy["status"] == 404 and envoy["path"] == "/v1/completions"
    assert envoy["method"] == "POST" and envoy["duration_ms"] >= 0
