"""``weir stats``: the --json snapshot's fields against a running sim stack,
the live view under a real terminal (tmux), and the message when nothing runs.

One own stack: a sim worker, a second configured worker never started (so
it shows as lost), an API key with a token budget (so a tenant has one)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest
import requests
import stackutil

KEY = "sk-stats"
KEY_TINY = "sk-stats-tiny"  # Envoy's own bucket for it: 1 request, then 1/s; the router's budget: 1 a minute
TOKENS_PER_DAY = 1_000_000  # refills ~12 tokens/s: what the test used still shows


@pytest.fixture(scope="module")
def stats_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stats")
    cfg = stackutil.write_config(
        d,
        workers=[stackutil.sim_worker("sim-0"), stackutil.sim_worker("sim-gone")],
        api_keys=[
            {"key": KEY, "tenant": "acme", "tier": "normal", "requests_per_minute": 10_000},
            {
                "key": KEY_TINY,
                "tenant": "tiny",
                "tier": "normal",
                "rate_limit_rps": 1,
                "rate_limit_burst": 1,
                "requests_per_minute": 1,
            },
        ],
        tenants=[{"name": "acme", "tokens_per_day": TOKENS_PER_DAY}],
    )
    with stackutil.start_stack(cfg, d / "run", workers=["sim-0"]) as s:
        yield s


def _weir(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weir.cli", *args], cwd=stackutil.REPO, capture_output=True, text=True, timeout=timeout
    )


def _send(url: str, n: int, key: str = KEY, **body) -> list[int]:
    codes = []
    for _ in range(n):
        payload = {"model": stackutil.SIM_MODEL, "prompt": "count to ten", "max_tokens": 16, **body}
        r = requests.post(url + "/v1/completions", json=payload, headers={"x-api-key": key}, timeout=30)
        codes.append(r.status_code)
    return codes


def test_json_snapshot_of_a_running_stack(stats_stack):
    s = stats_stack
    assert _send(s.envoy_url, 3) == [200] * 3
    assert _send(s.envoy_url, 1, model="no-such-model") == [404]
    assert _send(s.envoy_url, 2, key=KEY_TINY) == [200, 429]  # Envoy's bucket refuses the second ...
    time.sleep(1.2)
    assert _send(s.envoy_url, 1, key=KEY_TINY) == [429]  # ... the router's budget the third
    done = threading.Event()

    def load():  # traffic during the reading's interval, however long `weir stats` takes to start
        while not done.is_set():
            _send(s.envoy_url, 1)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        out = _weir("stats", "--config", str(s.cfg_path), "--json", "--interval", "1.0")
    finally:
        done.set()
        loader.join()
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["interval_s"] >= 0.9

    envoy = snap["envoy"]
    # (its health check failed while the router had no worker yet: counted, not shown as down)
    assert envoy["reachable"] and (envoy["upstream"]["healthy"], envoy["upstream"]["total"]) == (1, 1)
    assert envoy["by_status"]["2xx"]["total"] >= 3 and envoy["by_status"]["4xx"]["total"] >= 1
    assert envoy["requests"]["per_s"] > 0
    limited = envoy["rate_limited_429"]
    assert (limited["envoy"]["total"], limited["router"]["total"], limited["total"]) == (1, 1, 2)

    (router,) = snap["routers"]
    assert router["reachable"] and router["ready"] and router["ready_workers"]["sim-tiny"] == 1
    states = {m["name"]: (m["state"], m["ready_workers"]) for m in router["models"]}
    assert states == {"sim-tiny": ("ready", 1), "tiny-llama": ("loading", 0)}  # (tiny-llama: no worker here)
    assert {(q["class"], q["pool"]) for q in router["queues"]} >= {("normal", "short"), ("high", "long")}
    normal = next(q for q in router["queues"] if (q["class"], q["pool"]) == ("normal", "short"))
    assert normal["wait_p50_s"] is not None and normal["wait_p99_s"] >= normal["wait_p50_s"]
    assert router["admissions"]["dispatched"] >= 3 and router["admissions"]["finished"] >= 3
    assert router["refusals"]["model_not_found"]["total"] >= 1
    assert router["tokens_per_s"] > 0

    workers = {w["id"]: w for w in snap["workers"]}
    w = workers["sim-0"]
    assert w["state"] == "ready" and w["model"] == "sim-tiny" and w["engine"] == "sim"
    assert w["kv_capacity_tokens"] == 65536 and 0 <= w["kv_reserved_tokens"] <= w["kv_capacity_tokens"]
    assert w["tokens_total"] >= 3 * 16 and w["tokens_per_s"] is not None
    assert w["gpu"]["present"] is False and w["gpu"]["temperature_celsius"] is None
    assert workers["sim-gone"]["state"] == "lost"  # configured, not registered

    (acme,) = [t for t in snap["tenants"] if t["tenant"] == "acme"]
    assert acme["requests"] >= 3 and acme["completion_tokens"] >= 3 * 16
    budget = acme["budgets"]["tokens_per_day"]
    assert budget["limit"] == TOKENS_PER_DAY and budget["remaining"] < TOKENS_PER_DAY - 200
    keys = sorted(
        (t["budgets"]["requests_per_minute"]["limit"], t["budgets"]["requests_per_minute"]["remaining"])
        for t in snap["tenants"]
        if t["tenant"].startswith("key ")
    )  # keys' own budgets, by key id
    assert keys[0] == (1, 0) and keys[1][0] == 10_000 and KEY not in json.dumps(snap)
    (tiny,) = [t for t in snap["tenants"] if t["tenant"] == "tiny"]
    assert tiny["requests"] == 1 and tiny["refusals"] == {"requests": 1}


def test_clear_message_when_the_stack_is_not_running(tmp_path):
    cfg = stackutil.write_config(tmp_path)  # free ports: nothing listens
    for args in (["--json"], []):
        out = _weir("stats", "--config", str(cfg), *args)
        assert out.returncode == 1
        assert "weir stats: the stack is not running" in out.stderr and "weir up" in out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""


def test_live_view_in_a_real_terminal(stats_stack):
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("tmux is not installed (the Makefile's set-up installs it with apt-get)")
    session = f"weir-stats-{uuid.uuid4().hex[:8]}"
    tmux = [tmux, "-L", session]  # a tmux server of its own: none of another user's settings or sessions
    # (the size is the pane's: a COLUMNS/LINES inherited from the test run would override it)
    cmd = f"env -u COLUMNS -u LINES {sys.executable} -m weir.cli stats --config {stats_stack.cfg_path}"
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "180", "-y", "50", "-c", str(stackutil.REPO), cmd], check=True
    )
    try:
        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline:
            _send(stats_stack.envoy_url, 2)
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
            if "sim-0" in screen and "tokens/s" in screen and "routers healthy" in screen:
                break
            time.sleep(0.5)
        assert "weir stats" in screen and "Envoy" in screen, screen
        for text in (
            "routers healthy",
            "queues",
            "workers",
            "sim-0",
            "sim-gone",
            "lost",
            "no GPU",
            "tenants",
            "acme",
            "tokens_per_day",
        ):
            assert text in screen, f"{text!r} not on screen:\n{screen}"
        assert "Traceback" not in screen
        subprocess.run([*tmux, "send-keys", "-t", session, "C-c"], check=True)  # Ctrl-C ends it cleanly
        deadline = time.monotonic() + 10
        while subprocess.run([*tmux, "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "weir stats did not end on Ctrl-C"
            time.sleep(0.2)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)  # this test's own server only
