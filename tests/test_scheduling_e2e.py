"""Scheduling end to end: Envoy -> router -> sim workers, real processes.

A burst bigger than the fleet's KV capacity must be refused at the door (429
with a computed Retry-After) rather than over-commit the engine: no engine
preemptions, and every reservation back to zero once the burst has drained.
With the ledger switched off (huge over-commit) the same burst does preempt,
which shows the first assertion can fail.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

from stackutil import SIM_MODEL, sim_worker, start_stack, write_config

KV_TOKENS = 4096  # per sim worker
PROMPT = "x" * 400  # ~100 tokens by the sim's chars/4 estimate
MAX_TOKENS = 300  # -> ~400 KV tokens a request: ~10 fit one worker at once
BURST = 80


def _config(tmp_path, **scheduler):
    sim = {"kv_capacity_tokens": KV_TOKENS, "block_size": 16, "step_fixed_ms": 1.0,
           "decode_token_us": 20.0, "prefill_token_us": 2.0}
    return write_config(
        tmp_path,
        workers=[sim_worker("sim-a", max_num_seqs=64, sim=sim)],
        rate_limit={"route_rps": 100000, "route_burst": 100000},
        scheduler={"classes": [{"name": "normal", "max_queue": 16, "queue_deadline_s": 60.0}],
                   **scheduler},
    )


def _burst(url: str) -> list[requests.Response]:
    def one(i: int) -> requests.Response:
        return requests.post(url + "/v1/completions", timeout=120, json={
            "model": SIM_MODEL, "prompt": f"{i} {PROMPT}", "max_tokens": MAX_TOKENS})

    with cf.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, range(BURST)))


def _worker(stack) -> dict:
    return requests.get(stack.router_url + "/admin/workers", timeout=5).json()[0]


def _drained(stack, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        w = _worker(stack)
        if (w["running"] == 0 and w["reserved_tokens"] == 0) or time.monotonic() > deadline:
            return w
        time.sleep(0.1)


def test_burst_beyond_kv_capacity_is_refused_not_overcommitted(tmp_path):
    with start_stack(_config(tmp_path), tmp_path / "run") as stack:
        responses = _burst(stack.envoy_url)
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        refused = [r for r in responses if r.status_code == 429]
        served = [r for r in responses if r.status_code == 200]
        assert refused and served
        for r in refused:
            body = r.json()["error"]
            assert body["code"] in ("queue_full", "tenant_queue_full") and body["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1  # computed from the queue's drain estimate
        for r in served:
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS

        w = _drained(stack)
        assert w["preemptions"] == 0, "the ledger let the engine over-commit its KV"
        assert w["reserved_tokens"] == 0 and w["running"] == 0
        assert w["capacity_tokens"] == KV_TOKENS
        queues = requests.get(stack.router_url + "/admin/queues", timeout=5).json()
        assert all(q["queued"] == 0 for q in queues)
        # Refusals are counted by reason.
        metrics = requests.get(stack.router_url + "/metrics", timeout=5).text
        assert 'reason="queue_full"' in metrics or 'reason="tenant_queue_full"' in metrics


def test_without_the_ledger_the_same_burst_preempts(tmp_path):
    cfg = _config(tmp_path, overcommit=100.0)
    with start_stack(cfg, tmp_path / "run") as stack:
        responses = _burst(stack.envoy_url)
        assert any(r.status_code == 200 for r in responses)
        w = _drained(stack)
        assert w["preemptions"] > 0
        assert w["reserved_tokens"] == 0 and w["running"] == 0


@pytest.mark.parametrize("tier_key,lowered", [("sk-hi", "low")])
def test_priority_may_be_lowered_not_raised(tmp_path, tier_key, lowered):
    cfg = write_config(
        tmp_path,
        workers=[sim_worker("sim-a")],
        api_keys=[{"key": tier_key, "tenant": "t", "tier": "normal"}],
    )
    with start_stack(cfg, tmp_path / "run") as stack:
        def ask(priority):
            return requests.post(stack.envoy_url + "/v1/completions", timeout=30,
                                 headers={"x-api-key": tier_key},
                                 json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 2,
                                       "priority": priority})
        assert ask(lowered).status_code == 200
        assert ask("critical").status_code == 200  # asked above its tier: served at its tier
        metrics = requests.get(stack.router_url + "/metrics", timeout=5).text
        served = [l for l in metrics.splitlines() if l.startswith("weir_requests_total{")]
        assert any('klass="low"' in l for l in served)
        assert not any('klass="critical"' in l for l in served)


def test_queued_request_of_a_vanished_zeromq_client_is_dropped(tmp_path):
    """A direct client that dies (no Cancel) while its request waits gives up
    its place: the router probes waiting clients once per heartbeat."""
    import zmq

    from shared import protocol as p

    slow = {"kv_capacity_tokens": KV_TOKENS, "block_size": 16, "step_fixed_ms": 50.0}
    cfg = write_config(tmp_path, workers=[sim_worker("sim-a", max_num_seqs=1, sim=slow)])
    ctx = zmq.Context.instance()

    def submit(sock, rid: str) -> None:
        sock.send(p.encoder.encode(p.Submit(
            request_id=rid, model=SIM_MODEL, kind=p.RequestKind.COMPLETION, prompt="hold the slot",
            max_tokens=400)))

    def queued(stack) -> int:
        return sum(q["queued"] for q in requests.get(stack.router_url + "/admin/queues", timeout=5).json())

    with start_stack(cfg, tmp_path / "run") as stack:
        holder, leaver = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for s in (holder, leaver):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(stack.zmq_frontend)
            submit(holder, "a")  # 400 steps of 50 ms: runs for ~20 s on the only slot
            assert holder.poll(10_000)  # its first output: it holds the slot
            submit(leaver, "b")
            deadline = time.monotonic() + 10
            while queued(stack) != 1:
                assert time.monotonic() < deadline, "b never queued"
                time.sleep(0.05)
            leaver.close()  # gone without a Cancel
            deadline = time.monotonic() + 10
            while queued(stack) != 0:
                assert time.monotonic() < deadline, "the vanished client's request kept its place"
                time.sleep(0.1)
            assert _worker(stack)["running"] == 1  # a is still being served: b left the queue, not a
        finally:
            holder.send(p.encoder.encode(p.Cancel(request_ids=["a"])))
            holder.close()
