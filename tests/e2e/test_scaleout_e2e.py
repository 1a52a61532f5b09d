"""Two routers behind Envoy over two simulated workers (README: Scaling out).

Real processes: Envoy (least-request over both routers, readiness health
checks), two routers, two sim workers each linked to both routers.  The
workers' KV is small, so a burst through both routers at once would
over-commit them by up to 2x if each router trusted only its own ledger;
the workers' own ledgers refuse what does not fit and the routers queue it
again.  Then one router is SIGKILLed: the other keeps serving, the killed
one's in-flight requests end with Envoy's 503 JSON error, the supervisor
brings it back and the workers register with it again.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import requests
from stackutil import SIM_MODEL, sim_worker, start_stack, write_config

from bench.localconfig import routers

# 8 slots but KV for 4 requests of 224 tokens (prompt ~4 + 200, whole blocks of
# 16): two routers that each saw the worker empty would put 8 there -- 1,792 of
# 1,024 tokens, which the sim engine (as vLLM) would answer by preempting.
KV_TOKENS = 1024
SLOTS = 8
BODY = {"model": SIM_MODEL, "prompt": "burst", "max_tokens": 200}


def _workers(url: str) -> dict:
    return {w["id"]: w for w in requests.get(url + "/admin/workers", timeout=5).json()}


def _refused_dispatches(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("weir_worker_events_total{") and 'event="refused_dispatch"' in line
    )


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.1)
    return False


def _settled(stack) -> bool:
    """Every router's view of every worker: nothing reserved by it or (as
    the worker's heartbeats say) by the other router; nothing running."""
    for url in stack.router_urls:
        ws = _workers(url)
        if set(ws) != {"sim-a", "sim-b"}:
            return False
        for w in ws.values():
            if w["reserved_tokens"] or w["running"] or w["other_routers_tokens"] or w["engine_running"]:
                return False
    return True


def _post(url: str, body: dict, timeout: float = 60) -> requests.Response:
    return requests.post(url + "/v1/completions", json=body, timeout=timeout)


def test_two_routers_share_two_workers_without_over_commit(tmp_path):
    classes = [
        {"name": n, "max_predicted_wait_s": 1.5, "queue_deadline_s": 6.0}
        for n in ("critical", "high", "normal", "low", "batch")
    ]
    workers = [
        sim_worker(w, max_num_seqs=SLOTS, max_model_len=KV_TOKENS, sim={"kv_capacity_tokens": KV_TOKENS})
        for w in ("sim-a", "sim-b")
    ]
    cfg = write_config(
        tmp_path,
        routers=routers(2),
        workers=workers,
        router={"heartbeat_interval_s": 0.25},
        scheduler={"classes": classes},
    )
    with start_stack(cfg, supervise=True) as stack:
        assert stack.router_names == ["router", "router:1"]
        for url in stack.router_urls:  # each worker linked to both routers
            assert set(_workers(url)) == {"sim-a", "sim-b"}

        # A burst beyond capacity: 8 requests run at once fleet-wide, 64 come.
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            got = list(pool.map(lambda _: _post(stack.envoy_url, BODY), range(64)))
        statuses = [r.status_code for r in got]
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(200) >= 8, statuses
        for r in got:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 200
            else:
                assert r.json()["error"]["message"] and r.headers.get("retry-after")
        # Both routers served, and the workers' ledgers had to arbitrate.
        per_router = [_counter(u, "weir_requests_total") for u in stack.router_urls]
        print(
            "served per router",
            per_router,
            "refused before queueing",
            [_counter(u, "weir_rejected_total") for u in stack.router_urls],
        )
        assert all(n > 0 for n in per_router), per_router
        refused = sum(_refused_dispatches(u) for u in stack.router_urls)
        print(
            f"burst: {statuses.count(200)} x 200, {statuses.count(429)} x 429, {statuses.count(503)} x 503; "
            f"{refused:.0f} dispatches refused by a worker's ledger"
        )
        assert _wait(lambda: _settled(stack), 10), [_workers(u) for u in stack.router_urls]
        for url in stack.router_urls:
            assert all(w["preemptions"] == 0 for w in _workers(url).values())

        # SIGKILL router:1 with requests in flight on both.
        victim = stack.components["router:1"]
        old_pid = victim.pid
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            inflight = [pool.submit(_post, stack.envoy_url, {**BODY, "max_tokens": 300}) for _ in range(4)]
            time.sleep(0.6)
            victim.signal_group(signal.SIGKILL)
            racing = [pool.submit(_post, stack.envoy_url, {**BODY, "max_tokens": 8}) for _ in range(6)]
            ended = [f.result() for f in inflight] + [f.result() for f in racing]
            # Envoy has seen the dead router (outlier ejection, health check) -- or
            # the supervisor's new one, with both workers registered, passed it again.
            assert _wait(
                lambda: (
                    stack.envoy_healthy_routers() == 1
                    or (
                        victim.pid != old_pid
                        and set(stack.registered_at(stack.router_urls[1])) == {"sim-a", "sim-b"}
                        and stack.envoy_healthy_routers() == 2
                    )
                ),
                10,
            )
            after = [pool.submit(_post, stack.envoy_url, {**BODY, "max_tokens": 8}) for _ in range(6)]
            later = [f.result() for f in after]
        # Served by the survivor, or the clear error of the one killed under
        # them.  (A request Envoy had just written to the dead router's pooled
        # connection is one of those: it may have started there, so it is not retried.)
        for r in ended:
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.json()["error"]["message"] and r.headers.get("retry-after")
        assert [r.status_code for r in later] == [200] * 6, [
            r.json()["error"]["message"] for r in later if r.status_code != 200
        ]
        print(
            f"kill: in flight or racing it {[r.status_code for r in ended]}, sent after "
            f"{[r.status_code for r in later]}"
        )

        # The supervisor brings it back; the workers register there again, and
        # what it ran on them was dropped (each worker's ledger forgot it).
        assert _wait(lambda: victim.pid != old_pid and set(_workers(stack.router_urls[1])) == {"sim-a", "sim-b"}, 20)
        assert stack.restarts == {"router:1": 1}
        assert _wait(lambda: _settled(stack), 10), [_workers(u) for u in stack.router_urls]
        assert _post(stack.router_urls[1], {**BODY, "max_tokens": 4}).status_code == 200


def _counter(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
