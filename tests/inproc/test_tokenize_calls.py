"""/tokenize and /detokenize on the router's real HTTP ingress and core, in
one process (fake workers, a sim model with tiny-llama's real tokenizer, a
frozen budget clock): each call is one request of its caller's budgets; too
many long calls of one tenant waiting for the tokenizer are a 503 with
Retry-After; and one tenant's backlog of long calls delays neither another
tenant's long prompt nor another tenant's call."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import msgspec
import pytest
import requests
from fakes import FakeClock, FakeSink, FakeWorkers, LoopThread, registration

from router.ingress.http_server import start_http_server
from router.lifecycle.core import RouterCore
from shared import protocol as p
from shared.config import Config
from shared.keys import digest

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
MODEL = "sim-long"
KEY_A, KEY_B, KEY_C, KEY_TIGHT, KEY_FLOOD = "sk-tok-a", "sk-tok-b", "sk-tok-c", "sk-tok-tight", "sk-tok-flood"
LONG = "word " * 50_000  # ~50k tokens: tens of ms on a tokenizer thread, never inline

pytestmark = pytest.mark.skipif(not (TINY / "tokenizer.json").exists(), reason="models/tiny-llama not built")


class Router:
    """A RouterCore and its HTTP ingress on a uvloop in a thread of their own."""

    def __init__(self, **router_cfg) -> None:
        cfg = msgspec.convert(
            {
                "router": router_cfg,
                "models": [{"name": MODEL, "engine": "sim", "path": str(TINY), "max_model_len": 200_000}],
                "api_keys": [
                    {"key_sha256": digest(KEY_A), "tenant": "a"},
                    {"key_sha256": digest(KEY_B), "tenant": "b"},
                    {"key_sha256": digest(KEY_C), "tenant": "c"},
                    {"key_sha256": digest(KEY_TIGHT), "tenant": "t", "requests_per_minute": 2},
                    {"key_sha256": digest(KEY_FLOOD), "tenant": "f", "requests_per_minute": 100},
                ],
            },
            Config,
        )
        self.lt = LoopThread()
        self.loop = self.lt.loop
        self.workers = FakeWorkers()
        self.clock = FakeClock()  # budgets never refill during a test

        async def start():
            core = RouterCore(cfg, self.loop, self.workers, clock=self.clock)
            self.workers.linked.add("w0")
            core.worker_joined(registration("w0", MODEL, max_model_len=200_000, kv=10**7, seqs=64))
            srv = await start_http_server(core, core, core.metrics, "127.0.0.1", 0, max_body_bytes=4 << 20)
            return core, srv

        self.core, self.srv = self.lt.run(start())
        self.url = f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"

    def on_loop(self, fn):
        return self.lt.call(fn)

    def tokenize(self, key: str, prompt: str) -> requests.Response:
        return requests.post(
            self.url + "/tokenize",
            json={"model": MODEL, "prompt": prompt},
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
        )

    def close(self) -> None:
        self.lt.stop(self.srv.close, self.core.close)


@pytest.fixture
def router():
    r = Router()
    yield r
    r.close()


def test_each_call_is_one_request_of_the_budget(router):
    """requests_per_minute = 2: two calls (short and long) are served, the third is a 429."""
    short = router.tokenize(KEY_TIGHT, "Hello")
    assert short.status_code == 200 and short.headers["x-ratelimit-remaining-requests"] == "1"
    long = router.tokenize(KEY_TIGHT, LONG)
    assert long.status_code == 200 and long.json()["count"] > 40_000
    assert long.headers["x-ratelimit-remaining-requests"] == "0"
    refused = router.tokenize(KEY_TIGHT, "Hello")
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests", refused.text
    assert int(refused.headers["retry-after"]) >= 1
    detok = requests.post(
        router.url + "/detokenize",
        json={"model": MODEL, "tokens": [1, 2]},
        headers={"authorization": f"Bearer {KEY_TIGHT}"},
        timeout=30,
    )
    assert detok.status_code == 429  # detokenize counts too
    assert router.tokenize(KEY_A, "Hello").status_code == 200  # (another key's budget is its own)


def test_calls_over_the_queue_bound_are_503_with_retry_after_and_take_nothing():
    r = Router(tokenize_queue_per_tenant=2)
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:  # 1 runs, 2 wait: the rest arrive to a full line
            got = list(pool.map(lambda _: r.tokenize(KEY_FLOOD, LONG), range(16)))
        codes = [g.status_code for g in got]
        assert set(codes) <= {200, 503} and 503 in codes, codes
        busy = next(g for g in got if g.status_code == 503)
        assert busy.json()["error"]["code"] == "tokenizer_busy" and busy.headers["retry-after"] == "1"
        assert r.tokenize(KEY_B, LONG).status_code == 200  # the bound is per tenant; and it drains
        q = r.core.quota  # a call refused there gives its request back
        rpm = next(b for bs in q.by_key.values() for b in bs if b.cap == 100)
        assert q.store.level(rpm, r.clock()) == 100 - codes.count(200)
        assert r.tokenize(KEY_FLOOD, LONG).status_code == 200
    finally:
        r.close()


def test_another_tenants_prompt_and_call_go_before_a_backlog_of_long_calls(router):
    """Tenant a queues 32 long /tokenize calls; then tenant b's long prompt
    and tenant c's long call are served before a's 32nd call is answered
    (one FIFO thread served them after all 32)."""
    answered: list[str] = []
    lock = threading.Lock()

    def call(key: str, who: str) -> int:
        status = router.tokenize(key, LONG).status_code
        with lock:
            answered.append(who)
        return status

    pool = concurrent.futures.ThreadPoolExecutor(40)
    try:
        backlog = [pool.submit(call, KEY_A, "a") for _ in range(32)]
        deadline = time.monotonic() + 60
        while not answered:  # a's calls are being tokenized (and all sent: the first took longer)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        sink = FakeSink()
        got = router.on_loop(
            lambda: router.core.submit(p.Submit("c", MODEL, prompt=LONG, max_tokens=4, api_key=KEY_B), sink)
        )
        assert isinstance(got, int), got
        other = pool.submit(call, KEY_C, "c")
        while not router.workers.dispatched.get("w0"):
            assert time.monotonic() < deadline, "b's prompt never dispatched"
            time.sleep(0.005)
        with lock:
            a_done_at_dispatch = answered.count("a")
        assert a_done_at_dispatch < 32, "b's prompt waited behind all of a's calls"
        assert other.result(60) == 200
        with lock:
            a_done_at_c = answered[: answered.index("c")].count("a")
        assert a_done_at_c < 32, "c's call waited behind all of a's calls"
        assert all(f.result(120) == 200 for f in backlog)
    finally:
        pool.shutdown(wait=True)
