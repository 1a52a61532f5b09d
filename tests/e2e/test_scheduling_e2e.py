"""Scheduling end to end: Envoy -> router -> sim workers, real processes.

A burst bigger than the fleet's KV capacity must be refused at the door (429
with a computed Retry-After) rather than over-commit the engine: no engine
preemptions, and every reservation back to zero once the burst has drained.
With the ledger switched off (huge over-commit) the same burst does preempt,
which shows the first assertion can fail.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import requests
from stackutil import SIM_MODEL, sim_worker, start_stack, write_config

KV_TOKENS = 4096  # per sim worker
PROMPT = "x" * 400  # ~100 tokens by the sim's chars/4 estimate
MAX_TOKENS = 300  # -> ~400 KV tokens a request: ~10 fit one worker at once
BURST = 80


def _config(tmp_path, **scheduler):
    sim = {
        "kv_capacity_tokens": KV_TOKENS,
        "block_size": 16,
        "step_fixed_ms": 1.0,
        "decode_token_us": 20.0,
        "prefill_token_us": 2.0,
    }
    return write_config(
        tmp_path,
        workers=[sim_worker("sim-a", max_num_seqs=64, sim=sim)],
        rate_limit={"route_rps": 100000, "route_burst": 100000},
        scheduler={"classes": [{"name": "normal", "max_queue": 16, "queue_deadline_s": 60.0}], **scheduler},
    )


def _burst(url: str) -> list[requests.Response]:
    def one(i: int) -> requests.Response:
        return requests.post(
            url + "/v1/completions",
            timeout=120,
            json={"model": SIM_MODEL, "prompt": f"{i} {PROMPT}", "max_tokens": MAX_TOKENS},
        )

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
            assert body["code"] == "queue_full" and body["type"] == "rate_limit_error"  # max_queue 16
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
        assert 'reason="queue_full"' in metrics


def test_without_the_ledger_the_same_burst_preempts(tmp_path):
    cfg = _config(tmp_path, overcommit=100.0)
    with start_stack(cfg, tmp_path / "run") as stack:
        responses = _burst(stack.envoy_url)
        assert any(r.status_code == 200 for r in responses)
        w = _drained(stack)
        deadline = time.monotonic() + 5  # preemptions reach the router with the next heartbeat
        while w["preemptions"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            w = _worker(stack)
        assert w["preemptions"] > 0
        assert w["reserved_tokens"] == 0 and w["running"] == 0


# ------------------------------------------------------------------ overload admission (issue 14)
# A burst is admitted by its predicted queue wait, not by a count: what the
# fleet drains within the deadline is queued, the excess refused at once.

FAST_SIM = {
    "kv_capacity_tokens": 1 << 22,
    "block_size": 16,
    "step_fixed_ms": 1.0,
    "decode_token_us": 4.0,
    "admit_request_us": 20.0,
}


async def _fire(url: str, n: int, max_tokens: int, *, stream: bool = False, key_of=lambda i: None):
    """``n`` requests at once, one connection each: [(status, code, retry_after, latency_s)]."""
    import asyncio

    import aiohttp

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), trust_env=False, timeout=aiohttp.ClientTimeout(total=120)
    ) as s:

        async def one(i):
            key = key_of(i)
            t0 = time.monotonic()
            async with s.post(
                url + "/v1/completions",
                headers={"x-api-key": key} if key else {},
                json={"model": SIM_MODEL, "prompt": f"{i} {'x' * 124}", "max_tokens": max_tokens, "stream": stream},
            ) as r:
                body = await r.read()
                code = None
                if r.status == 200 and stream:
                    assert body.rstrip().endswith(b"data: [DONE]")
                elif r.status != 200:
                    code = json.loads(body)["error"]["code"]
                return r.status, code, r.headers.get("retry-after"), time.monotonic() - t0

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_2000_stream_burst_on_one_sim_worker_is_all_served(tmp_path):
    """The issue's case: one 256-slot worker, 2,000 concurrent 64-token
    streams (a count bound of 256 per tenant served 512 and refused 1,488)."""
    import asyncio

    cfg = write_config(
        tmp_path,
        workers=[sim_worker("sim-a", max_num_seqs=256, sim=FAST_SIM)],
        rate_limit={"route_rps": 100000, "route_burst": 100000},
    )
    with start_stack(cfg, tmp_path / "run") as stack:
        res = asyncio.run(_fire(stack.envoy_url, 2000, 64, stream=True))
        assert [r[0] for r in res].count(200) == 2000, sorted({r[:2] for r in res})
        w = _drained(stack)
        assert w["reserved_tokens"] == 0 and w["running"] == 0


def test_a_burst_beyond_the_deadline_is_refused_at_once(tmp_path):
    """One 16-slot worker drains ~75 64-token requests a second; with a 1 s
    deadline, 600 at once: the excess gets 429 + Retry-After without waiting."""
    import asyncio

    cfg = write_config(
        tmp_path,
        workers=[sim_worker("sim-a", max_num_seqs=16)],
        rate_limit={"route_rps": 100000, "route_burst": 100000},
        scheduler={"classes": [{"name": "normal", "queue_deadline_s": 1.0}]},
    )
    with start_stack(cfg, tmp_path / "run") as stack:
        res = asyncio.run(_fire(stack.envoy_url, 600, 64))
        statuses = [r[0] for r in res]
        assert set(statuses) <= {200, 429, 503}, statuses
        served, refused = statuses.count(200), [r for r in res if r[0] == 429]
        print(
            f"served {served}, refused {len(refused)}, 503 {statuses.count(503)}, "
            f"Retry-After {sorted({r[2] for r in refused}, key=int)}"
        )
        assert 30 <= served <= 200, served  # ~75 fit the deadline
        assert len(refused) >= 350
        # hardly any admitted job waits out its deadline (measured 0-11 of ~85 on this 2-core VM)
        assert statuses.count(503) <= 0.3 * served + 5
        assert {r[1] for r in refused} == {"queue_wait_exceeded"}
        assert all(int(r[2]) >= 1 for r in refused)
        # at once: a refusal does not wait in the queue -- the median refused
        # request is answered before most served ones (a wall-clock bound is
        # the machine's: 600 connections at once measured p50 0.3-0.5 s here,
        # 1.4 s on a slow CI run, mostly the client)
        lat = sorted(r[3] for r in refused)
        ok_lat = sorted(r[3] for r in res if r[0] == 200)
        assert lat[len(lat) // 2] < ok_lat[int(0.9 * len(ok_lat))], (lat[len(lat) // 2], ok_lat)
        # Retry-After spreads the refused over the time the worker needs for them
        ra = sorted(int(r[2]) for r in refused)
        assert ra[-1] >= 3 * ra[0] and ra[-1] >= 4
        w = _drained(stack)
        assert w["reserved_tokens"] == 0 and w["running"] == 0


def test_a_quiet_tenant_is_not_refused_while_a_flooder_is(tmp_path):
    import asyncio

    keys = [
        {"key": "sk-flood", "tenant": "flood", "tier": "normal"},
        {"key": "sk-quiet", "tenant": "quiet", "tier": "normal"},
    ]
    cfg = write_config(
        tmp_path,
        workers=[sim_worker("sim-a", max_num_seqs=16)],
        api_keys=keys,
        rate_limit={"route_rps": 100000, "route_burst": 100000, "per_key_rps": 100000, "per_key_burst": 100000},
        scheduler={"classes": [{"name": "normal", "queue_deadline_s": 1.0}]},
    )
    with start_stack(cfg, tmp_path / "run") as stack:
        # the quiet tenant's 20 requests go out in the middle of the flooder's 500
        res = asyncio.run(
            _fire(stack.envoy_url, 520, 16, key_of=lambda i: "sk-quiet" if 250 <= i < 270 else "sk-flood")
        )
        quiet, flood = res[250:270], res[:250] + res[270:]
        print(
            f"quiet {[r[0] for r in quiet].count(200)}/20 served; flood "
            f"{sum(r[0] == 429 for r in flood)} refused, {sum(r[0] == 200 for r in flood)} served"
        )
        assert all(r[0] == 200 for r in quiet), quiet
        assert sum(r[0] == 429 for r in flood) >= 100
        assert _drained(stack)["reserved_tokens"] == 0
