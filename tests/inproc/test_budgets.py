"""Budgets (router/tenancy/budgets.py, the ledger) through the lifecycle, in-process: fake ports,
fake clock, the real BudgetLedger with its MemoryBudgetStore (or a store that answers
later, as Redis does).  The promise checked everywhere: a job's reservation
returns exactly once, whatever path it ends on, and what stays taken is
exactly what the engines used (prompt once it ran + completion)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fakes import registration
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_lifecycle import Harness, Sink

from router.ingress.headers import ratelimit_headers
from router.ingress.headers import reset_duration as _duration
from router.lifecycle.jobs import JobState
from router.tenancy.budgets import Group
from router.tenancy.store_memory import MemoryBudgetStore
from shared import protocol as p
from shared.config import Config
from shared.keys import digest

KEY, KEY2, OTHER = "sk-test-a", "sk-test-a2", "sk-test-b"
PROMPT = "x" * 40  # the sim model (no tokenizer) counts 40 bytes as 10 tokens
PROMPT_TOKENS = 10


def config(keys=None, tenants=None, quota=None, **scheduler) -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "scheduler": {"generation_deadline_s": 30.0, **scheduler},
            "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}],
            "api_keys": keys
            if keys is not None
            else [{"key_sha256": digest(KEY), "tenant": "a", "tokens_per_minute": 1000, "requests_per_minute": 10}],
            "tenants": tenants or [],
            "quota": quota or {},
        },
        Config,
    )


class QHarness(Harness):
    def submit_key(self, key: str = KEY, max_tokens: int = 8, prompt: str = PROMPT):
        sink = Sink()
        got = self.core.submit(p.Submit("c", "sim-m", prompt=prompt, max_tokens=max_tokens, api_key=key), sink)
        if isinstance(got, int):
            self.sinks[got] = sink
        return got

    def level(self, field: str = "tokens_per_minute", scope: str = "k") -> float:
        q = self.core.quota
        for bs in q.by_key.values() if scope == "k" else q.by_tenant.values():
            for b in bs:
                if b.field == field:
                    return q.store.level(b, self.clock())
        raise KeyError(field)


@pytest.fixture
def qh():
    h = QHarness(config())
    h.join("w0")
    yield h
    h.close()


def test_reserve_then_settle_on_what_the_engine_used(qh):
    a = qh.submit_key(max_tokens=50)
    assert qh.level() == 1000 - (PROMPT_TOKENS + 50)
    assert qh.level("requests_per_minute") == 9
    qh.settle()
    qh.tokens(a, 3)
    qh.tokens(a, 2, "stop")
    assert qh.level() == 1000 - (PROMPT_TOKENS + 5)  # 45 not generated came back
    assert qh.level("requests_per_minute") == 9  # a served request stays counted
    first = qh.sinks[a].deltas[0].ratelimit
    assert (first.limit_tokens, first.remaining_tokens, first.limit_requests, first.remaining_requests) == (
        1000,
        1000 - 60,
        10,
        9,
    )
    assert first.reset_tokens_s == pytest.approx(60 * 60 / 1000)
    assert qh.core.quota.outstanding == 0
    assert qh.core.quota.usage["a"] == [1, PROMPT_TOKENS, 5]


def test_n_choices_reserve_max_tokens_for_each(qh):
    """Usage sums the completion tokens of all n choices: so does the reservation."""
    sink = Sink()
    a = qh.core.submit(
        p.Submit("c", "sim-m", prompt=PROMPT, max_tokens=50, api_key=KEY, params=p.SamplingParams(n=4)), sink
    )
    assert isinstance(a, int)
    assert qh.level() == 1000 - (PROMPT_TOKENS + 4 * 50)
    # n x max_tokens alone beyond the budget: refused at once, as for one choice
    big = qh.core.submit(
        p.Submit("c", "sim-m", prompt=PROMPT, max_tokens=300, api_key=KEY, params=p.SamplingParams(n=4)), Sink()
    )
    assert not isinstance(big, int)


def test_a_dispatch_refused_by_the_workers_ledger_charges_no_prompt(qh):
    """Refused by the worker (other routers hold its room): nothing ran there,
    so a job cancelled after that, queued again, is charged no tokens."""
    a = qh.submit_key(max_tokens=50)
    qh.settle()
    job_id = "%x" % a
    assert qh.core.policy.worker_of(job_id) == "w0"
    qh.core.refused("w0", [job_id], other_tokens=10**6, other_seqs=64)  # and w0 is full meanwhile
    qh.settle()
    assert qh.core.policy.worker_of(job_id) is None  # queued again
    qh.core.cancel(a)
    assert qh.level() == 1000 and qh.core.quota.outstanding == 0
    assert qh.core.quota.usage["a"][1] == 0  # no prompt tokens used


def test_cancelled_while_queued_uses_no_tokens_and_one_request(qh):
    qh.join("w0", seqs=1)
    a, b = qh.submit_key(), qh.submit_key(max_tokens=100)
    qh.settle()
    qh.core.cancel(b)  # never reached an engine
    assert qh.level() == 1000 - (PROMPT_TOKENS + 8)
    qh.tokens(a, 1, "abort")
    qh.core.cancel(a)  # dispatched, then cancelled: the prompt and the 1 token count
    assert qh.level() == 1000 - (PROMPT_TOKENS + 1)
    assert qh.level("requests_per_minute") == 8 and qh.core.quota.outstanding == 0


def test_worker_loss_requeue_is_charged_once(qh):
    a = qh.submit_key(max_tokens=20)
    qh.settle()
    qh.join("w1")
    qh.leave("w0")  # nothing streamed yet: requeued, dispatched again
    qh.settle()
    assert qh.workers.dispatched["w1"][-1].request_id == "%x" % a
    qh.tokens(a, 4, "stop")
    assert qh.level() == 1000 - (PROMPT_TOKENS + 4) and qh.core.quota.outstanding == 0


def test_a_resumed_stream_is_charged_once_for_its_prompt_and_all_its_tokens(qh):
    a = qh.submit_key(max_tokens=20)
    qh.settle()
    qh.join("w1")
    qh.tokens(a, 5)
    qh.leave(qh.workers.where("%x" % a))  # streamed output: resumed elsewhere as a continuation
    qh.settle()
    qh.tokens(a, 15, "length", prompt_tokens=PROMPT_TOKENS + 5)
    assert qh.sinks[a].finals[0].completion_tokens == 20
    assert qh.level() == 1000 - (PROMPT_TOKENS + 20) and qh.core.quota.outstanding == 0


def test_engine_error_and_deadline_return_what_was_not_generated(qh):
    a, b = qh.submit_key(max_tokens=30), qh.submit_key(max_tokens=30)
    qh.settle()
    qh.tokens(a, 2)
    qh.core.on_outputs(
        qh.workers.where("%x" % a), [p.Delta("%x" % a, error=p.ErrorInfo(500, "boom", "server_error", "engine_error"))]
    )
    qh.tokens(b, 1)
    qh.clock.t += 31  # past generation_deadline_s
    qh.core.run_policy()
    assert qh.sinks[b].finals[0].error.code == "generation_deadline"
    assert (
        qh.level() == pytest.approx(1000 - 2 * PROMPT_TOKENS - 3 + 31 * 1000 / 60 - 0, abs=1e-6) or qh.level() == 1000
    )  # refilled meanwhile (31 s of 1000/min), capped at the budget
    assert qh.core.quota.outstanding == 0


def test_an_end_before_any_output_carries_the_budget_figures(qh):
    """Ended with an error before its first Delta (a drain, a queue deadline):
    the refusal carries the figures the first Delta would have."""
    from router.lifecycle.drain import draining_error

    a = qh.submit_key(max_tokens=30)
    qh.core.end_job("%x" % a, draining_error())
    err = qh.sinks[a].finals[0].error
    assert err.code == "router_draining" and err.ratelimit is not None
    assert (err.ratelimit.limit_tokens, err.ratelimit.limit_requests) == (1000, 10)


def test_a_policy_refusal_before_queueing_gives_everything_back():
    h = QHarness(config())
    try:  # no worker: refused at submit (503 no_worker)
        got = h.submit_key()
        assert got.code == "no_worker"
        assert got.ratelimit is not None  # its figures still travel with the refusal
        assert h.level() == 1000 and h.level("requests_per_minute") == 10
    finally:
        h.close()


def test_over_budget_is_429_with_a_retry_after_that_works(qh):
    qh.core.quota.reload(config(keys=[{"key_sha256": digest(KEY), "tenant": "a", "tokens_per_minute": 100}]))
    a = qh.submit_key(max_tokens=50)  # 60 reserved, 40 left
    assert isinstance(a, int)
    refused = qh.submit_key(max_tokens=50)
    assert refused.status == 429 and refused.code == "rate_limit_exceeded" and refused.type == "tokens"
    assert "tokens per minute" in refused.message and "`tokens_per_minute`" in refused.message
    assert refused.retry_after == pytest.approx((60 - 40) * 60 / 100)
    assert refused.ratelimit.remaining_tokens == 40 and refused.ratelimit.limit_tokens == 100
    qh.clock.t += refused.retry_after  # a client that waits that long is served
    assert isinstance(qh.submit_key(max_tokens=50), int)
    m = qh.core.quota
    assert m.refusals[("a", "tokens")] == 1


def test_requests_budget_names_requests(qh):
    qh.core.quota.reload(config(keys=[{"key_sha256": digest(KEY), "tenant": "a", "requests_per_minute": 2}]))
    assert isinstance(qh.submit_key(), int) and isinstance(qh.submit_key(), int)
    refused = qh.submit_key()
    assert refused.type == "requests" and refused.code == "rate_limit_exceeded"
    assert refused.retry_after == pytest.approx(30.0)
    assert refused.ratelimit.remaining_requests == 0 and refused.ratelimit.limit_tokens == 0


def test_max_tokens_alone_over_the_budget_is_400_at_once(qh):
    got = qh.submit_key(max_tokens=995)  # 10 + 995 > 1000: can never fit
    assert got.status == 400 and got.code == "request_exceeds_budget" and got.param == "max_tokens"
    assert got.retry_after is None and "can never be served" in got.message
    assert qh.level() == 1000


def test_a_tenant_budget_is_shared_by_its_keys():
    h = QHarness(
        config(
            keys=[
                {"key_sha256": digest(KEY), "tenant": "a"},
                {"key_sha256": digest(KEY2), "tenant": "a"},
                {"key_sha256": digest(OTHER), "tenant": "b"},
            ],
            tenants=[{"name": "a", "requests_per_minute": 3}],
        )
    )
    try:
        h.join("w0")
        got = [h.submit_key(k) for k in (KEY, KEY2, KEY, KEY2)]
        assert [isinstance(g, int) for g in got] == [True, True, True, False]
        assert "for this tenant" in got[3].message
        assert all(isinstance(h.submit_key(OTHER), int) for _ in range(5))  # b has no budget
    finally:
        h.close()


def test_reload_swaps_keys_and_budgets(qh):
    assert isinstance(qh.submit_key(KEY), int)
    assert qh.submit_key(OTHER).code == "invalid_api_key"
    qh.core.reload_keys(config(keys=[{"key_sha256": digest(OTHER), "tenant": "b", "tokens_per_minute": 50}]))
    assert qh.submit_key(KEY).code == "invalid_api_key"
    assert isinstance(qh.submit_key(OTHER, max_tokens=8), int)
    assert qh.submit_key(OTHER, max_tokens=45).code == "request_exceeds_budget"


class _FailingStore(MemoryBudgetStore):
    sync = False

    def submit(self, op, buckets, amounts, hold_id, callback):  # (a store never answers before returning)
        asyncio.get_running_loop().call_soon(callback, ConnectionError("store down"))


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_store_unreachable_fails_open_or_closed(mode):
    h = QHarness(config(quota={"on_store_error": mode}))
    try:
        h.join("w0")
        h.core.quota.store = _FailingStore()
        sink = Sink()

        async def submit():
            return h.core.submit(p.Submit("c", "sim-m", prompt=PROMPT, max_tokens=8, api_key=KEY), sink)

        got = h.loop.run_until_complete(submit())
        assert isinstance(got, int)  # the store answers through the callback, after submit
        h.settle()
        if mode == "closed":
            err = sink.finals[0].error
            assert err.status == 503 and err.code == "quota_unavailable" and err.retry_after
        else:
            assert not sink.finals and h.workers.dispatched["w0"]
            h.tokens(got, 1, "stop")
            assert sink.finals[0].finish_reason == "stop"
        assert h.core.quota.store_errors["reserve"] == 1 and h.core.quota.outstanding == 0
    finally:
        h.close()


def test_headers_render_openai_style():
    assert _duration(0.02) == b"20ms" and _duration(1.0) == b"1s" and _duration(1.5) == b"1.5s"
    assert _duration(360) == b"6m0s" and _duration(3723) == b"1h2m3s"
    h = ratelimit_headers(p.RateLimit(10, 9, 6.0, 1000, 940, 3.6)).decode()
    assert "x-ratelimit-limit-requests: 10\r\n" in h and "x-ratelimit-remaining-tokens: 940\r\n" in h
    assert "x-ratelimit-reset-tokens: 3.6s\r\n" in h and "x-ratelimit-reset-requests: 6s\r\n" in h
    assert ratelimit_headers(p.RateLimit(0, 0, 0, 5, 5, 0)).decode().count("x-ratelimit") == 3


# ------------------------------------------------------------------ fan-out: k jobs, k request units at once


def fan_config(rpm: int = 10, tpm: int = 100_000) -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "models": [
                {"name": "sim-m", "engine": "sim", "max_model_len": 4096},
                {"name": "sim-e", "engine": "sim", "task": "embed", "max_model_len": 4096},
            ],
            "api_keys": [
                {"key_sha256": digest(KEY), "tenant": "a", "requests_per_minute": rpm, "tokens_per_minute": tpm}
            ],
        },
        Config,
    )


@pytest.fixture
def fh():
    h = QHarness(fan_config())
    h.join("w0", seqs=64, kv=10**6)
    yield h
    h.close()


def fan_out(h: QHarness, k: int, prompts: list[str] | None = None, max_tokens: int = 8):
    """A k-prompt completion as the ingress and batch lines submit it (router.lifecycle.fanout)."""
    from router.lifecycle.fanout import PromptFanOut

    sink = Sink()
    subs = [p.Submit("c", "sim-m", prompt=pr, max_tokens=max_tokens, api_key=KEY) for pr in (prompts or [PROMPT] * k)]
    fan = PromptFanOut(h.core, sink, 1, len(subs), [])
    return fan, sink, fan.submit(subs)


class _Conn:
    """What router.ingress.embeddings answers through: the status and body it would send."""

    def __init__(self):
        self.answers = []

    def respond_error(self, req, err, label, extra=b""):
        self.answers.append((err.status, err))

    def respond(self, req, status, ctype, body, label, extra=b""):
        self.answers.append((status, body))


def embed_inputs(h: QHarness, k: int):
    """A k-input /v1/embeddings request through its real handler (router.ingress.embeddings)."""
    from router import api
    from router.ingress.embeddings import EmbeddingsExchange

    body = msgspec.json.encode({"model": "sim-e", "input": [PROMPT] * k})
    subs, ctx = api.parse_embeddings(body, api.meta_from_headers(f"Bearer {KEY}", None), "r1")
    conn = _Conn()
    batch = EmbeddingsExchange(conn, None, ctx, "embeddings", h.core)
    batch.start(subs)
    h.settle()
    return conn, batch


def test_embeddings_inputs_over_the_requests_budget_are_400_and_take_nothing(fh):
    """20 inputs under requests_per_minute = 10 can never fit: 400 at once
    (not a 429 that empties the bucket each time), nothing taken."""
    conn, _ = embed_inputs(fh, 20)
    ((status, err),) = conn.answers
    assert status == 400 and err.code == "request_exceeds_budget" and err.retry_after is None
    assert "20 requests" in err.message and "`requests_per_minute`" not in err.message
    assert "requests_per_minute budget of 10" in err.message
    assert fh.level("requests_per_minute") == 10 and fh.level() == 100_000
    assert fh.core.quota.outstanding == 0 and not fh.core.jobs
    assert fh.core.quota.refusals[("a", "too_large")] == 1
    conn, _ = embed_inputs(fh, 10)  # fits, but no worker serves sim-e: refused, all 10 units back
    assert conn.answers[0][1].code == "no_worker" and fh.level("requests_per_minute") == 10
    fh.workers.linked.add("we")
    fh.core.worker_joined(registration("we", "sim-e", kv=10**6, seqs=64))
    conn, batch = embed_inputs(fh, 10)  # the whole budget is still there for a request that fits
    assert not conn.answers and len(batch.handles) == 10
    assert fh.level("requests_per_minute") == 0


def test_a_fan_out_takes_its_k_units_and_keeps_them_when_served(fh):
    fan, sink, err = fan_out(fh, 3)
    assert err is None and fh.level("requests_per_minute") == 7
    fh.settle()
    for h in fan.handles:
        fh.tokens(h, 2, "stop")
    assert sink.finals and sink.finals[-1].finish_reason == "stop"
    assert fh.level("requests_per_minute") == 7  # served: three requests counted
    assert fh.level() == 100_000 - 3 * (PROMPT_TOKENS + 2)
    assert fh.core.quota.outstanding == 0


def test_a_fan_out_larger_than_what_is_left_is_429_and_takes_nothing(fh):
    for _ in range(6):
        assert isinstance(fh.submit_key(), int)
    assert fh.level("requests_per_minute") == 4
    _, _, err = fan_out(fh, 5)
    assert err.status == 429 and err.type == "requests" and "needs 5 requests" in err.message
    assert err.retry_after == pytest.approx((5 - 4) * 60 / 10)
    assert fh.level("requests_per_minute") == 4 and not [
        j for j in fh.core.jobs if j not in ("1", "2", "3", "4", "5", "6")
    ]
    fh.clock.t += err.retry_after  # as told: then it fits
    _, _, err = fan_out(fh, 5)
    assert err is None and fh.level("requests_per_minute") == pytest.approx(0)


def test_one_prompt_refused_gives_every_unit_and_token_back(fh):
    """Prompt 3 of 4 is refused (its tokens do not fit): the request is
    refused and its other prompts, queued already, give back everything."""
    fh.core.quota.reload(fan_config(tpm=200))
    big = "x" * 4 * 150  # 150 tokens + 8: fits the budget alone, not after the others
    fan, sink, err = fan_out(fh, 4, [PROMPT, PROMPT, big, PROMPT])
    assert err is not None and err.status == 429 and err.type == "tokens"
    fh.settle()
    assert fh.level("requests_per_minute") == 10 and fh.level() == 200
    assert fh.core.quota.outstanding == 0 and not fh.core.jobs


def test_a_fan_out_cancelled_by_its_client_while_queued_counts_its_units(fh):
    """As for one request: queued and then abandoned still counts."""
    fan, _, err = fan_out(fh, 3)
    assert err is None
    fan.cancel()  # (queued, not yet dispatched: no prompt tokens used)
    fh.settle()
    assert fh.level("requests_per_minute") == 7 and fh.level() == 100_000
    assert fh.core.quota.outstanding == 0


def test_a_fan_out_with_a_store_that_answers_later_is_refused_whole():
    """Redis answers later: the k units are one call, asked before any job's
    tokens; refused, every job ends with that refusal and nothing stays taken."""
    h = QHarness(fan_config())
    try:
        h.join("w0", seqs=64, kv=10**6)
        store = h.core.quota.store = _Deferred()

        async def go(k):
            return fan_out(h, k)

        for _ in range(7):  # 7 single requests: 3 units left
            h.submit_key()
        store.answer(100)
        h.settle()
        assert h.level("requests_per_minute") == 3
        fan, sink, err = h.loop.run_until_complete(go(4))
        assert err is None and len(fan.handles) == 4
        assert store.queue[0][2] == [4]  # one reserve of 4 units, before the jobs' tokens
        store.answer(100)
        h.settle()
        (final,) = sink.finals
        assert final.error.status == 429 and final.error.type == "requests"
        store.answer(100)  # the jobs' token holds given back
        h.settle()
        assert h.level("requests_per_minute") == 3 and h.level() == 100_000 - 7 * (PROMPT_TOKENS + 8)
        assert len(h.core.jobs) == 7 and h.core.quota.outstanding == 7  # the single requests, live
    finally:
        h.close()


# ------------------------------------------------------------------ the property


class _Frozen(MemoryBudgetStore):
    """Buckets that never refill (the lifecycle's clock still runs its deadlines),
    so what is taken can be compared exactly."""

    def level(self, b, now):
        return super().level(b, 0.0)

    def reserve(self, buckets, amounts, now):
        return super().reserve(buckets, amounts, 0.0)

    def credit(self, buckets, amounts, now):
        super().credit(buckets, amounts, 0.0)


class _Deferred(_Frozen):
    """Answers when the test says (or fails), as Redis would, later -- with
    its scripts' hold ids: a reserve that takes holds its id, a credit
    applies only if it releases one."""

    sync = False

    def __init__(self):
        super().__init__()
        self.queue = []
        self.held: set[str] = set()

    def submit(self, op, buckets, amounts, hold_id, callback):
        self.queue.append((op, buckets, amounts, hold_id, callback))

    def answer(self, n: int, fail: bool = False, ran: bool = False):
        """``fail``: the caller gets an error -- before the call ran, or
        (``ran``) after it did, as a timeout may."""
        for _ in range(min(n, len(self.queue))):
            op, buckets, amounts, hold_id, cb = self.queue.pop(0)
            if fail and not ran:
                cb(ConnectionError("down"))
                continue
            if op == "reserve":
                res = self.reserve(buckets, amounts, 0.0)
                if res[0]:
                    self.held.add(hold_id)
            else:
                if hold_id in self.held:
                    self.held.discard(hold_id)
                    self.credit(buckets, amounts, 0.0)
                res = 1
            cb(TimeoutError("answered too late") if fail else res)


class QuotaMachine(RuleBasedStateMachine):
    """Any interleaving of submits on two keys of one tenant, engine news,
    cancels, deadlines, worker losses and (for a store that answers later)
    late, failed or never-heard answers: every bucket holds exactly its
    capacity less what live reservations hold less what ended jobs used."""

    deferred = False

    def __init__(self) -> None:
        super().__init__()
        self.h = QHarness(
            config(
                keys=[
                    {"key_sha256": digest(KEY), "tenant": "a", "tokens_per_minute": 5000, "requests_per_minute": 10**6},
                    {"key_sha256": digest(KEY2), "tenant": "a", "tokens_per_minute": 3000},
                ],
                tenants=[{"name": "a", "tokens_per_minute": 6000}],
                generation_deadline_s=5.0,
            )
        )
        q = self.h.core.quota
        q.store = _Deferred() if self.deferred else _Frozen()
        self.ended: list[tuple] = []  # what each end told the quota
        real = q.ended

        def spy(who, hold, prompt, completion, queued):
            self.ended.append((who.key_id, hold, prompt, completion))
            real(who, hold, prompt, completion, queued)

        q.ended = spy
        self.handles: list[int] = []
        self.h.join("w0", seqs=2, kv=2048)

    def teardown(self) -> None:
        self.h.close()

    @rule(w=st.sampled_from(["w0", "w1"]))
    def join(self, w):
        self.h.join(w, seqs=2, kv=2048)
        self.h.settle()

    @rule(w=st.sampled_from(["w0", "w1"]))
    def leave(self, w):
        if w in self.h.workers.linked:
            self.h.leave(w)
            self.h.settle()

    @rule(key=st.sampled_from([KEY, KEY2]), max_tokens=st.integers(1, 1500))
    def submit(self, key, max_tokens):
        got = self.h.submit_key(key, max_tokens=max_tokens)
        if isinstance(got, int):
            self.handles.append(got)
        self.h.settle()

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 1000), n=st.integers(0, 3), finish=st.sampled_from([None, None, "stop", "length", "error"]))
    def news(self, i, n, finish):
        job_id = "%x" % self.handles[i % len(self.handles)]
        if finish == "error":
            d = p.Delta(job_id, error=p.ErrorInfo(500, "boom", "server_error", "engine_error"))
        else:
            d = p.Delta(job_id, " t" * n, n, finish, prompt_tokens=PROMPT_TOKENS)
        self.h.core.on_outputs(self.h.workers.where(job_id) or "w0", [d])
        self.h.settle()

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 1000))
    def cancel(self, i):
        self.h.core.cancel(self.handles[i % len(self.handles)])
        self.h.settle()

    @rule(dt=st.sampled_from([0.5, 6.0, 70.0]))
    def time_passes(self, dt):
        self.h.clock.t += dt
        self.h.core.run_policy()
        self.h.settle()

    @precondition(lambda self: self.deferred)
    @rule(n=st.integers(1, 4), fail=st.booleans(), ran=st.booleans())
    def store_answers(self, n, fail, ran):
        self.h.core.quota.store.answer(n, fail, ran)
        self.h.settle()

    def _expected_taken(self, bucket) -> int:
        q = self.h.core.quota
        taken = 0
        for j in self.h.core.jobs.values():  # live reservations
            if j.hold is not None and j.hold.enforced and bucket in j.hold.buckets:
                taken += j.hold.tokens
        for _kid, hold, prompt, completion in self.ended:  # ended: what they used
            if hold is not None and hold.enforced and bucket in hold.buckets:
                taken += prompt + completion
        pending = list(q._unsent)
        if self.deferred:
            pending += [(b, a, h) for op, b, a, h, _ in q.store.queue if op == "credit"]
        for buckets, amounts, hold_id in pending:  # returns not yet applied by the store
            if self.deferred and hold_id not in q.store.held:
                continue  # undoing a reserve that never took: nothing to return
            for b, a in zip(buckets, amounts):
                if b == bucket:
                    taken += a
        return taken

    @invariant()
    def every_bucket_is_exact(self):
        q = self.h.core.quota
        buckets = {b for bs in (*q.by_key.values(), *q.by_tenant.values()) for b in bs if b.tokens}
        for b in buckets:
            assert b.cap - q.store.level(b, 0.0) == self._expected_taken(b), b

    @invariant()
    def ended_jobs_report_what_their_clients_saw(self):
        seen = {kid for kid, *_ in self.ended}
        assert seen <= {"", *self.h.core.quota.by_key}
        for handle, sink in self.h.sinks.items():
            if sink.finals:
                assert "%x" % handle not in self.h.core.jobs

    @rule()
    def everything_ends(self):
        for handle in self.handles:
            self.h.core.cancel(handle)
        if self.deferred:
            self.h.core.quota.store.answer(10**6)
            self.h.core.quota._down_until = 0.0
            self.h.core.quota._flush_credits()
            self.h.core.quota.store.answer(10**6)
        self.h.settle()
        q = self.h.core.quota
        assert not self.h.core.jobs and q.outstanding == 0
        for _kid, _hold, prompt, _completion in self.ended:
            assert prompt in (0, PROMPT_TOKENS)


class DeferredQuotaMachine(QuotaMachine):
    deferred = True


QuotaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
DeferredQuotaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_quota_state_machine = QuotaMachine.TestCase
test_quota_state_machine_with_a_store_that_answers_later = DeferredQuotaMachine.TestCase


class _Recorded(Group):
    """A fan-out's Group that remembers what its jobs and its fan-out told it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.outcomes: list[bool] = []  # per ended job: was it queued
        self.failed: bool | None = None  # the fan-out's close

    def left(self, queued: bool) -> None:
        self.outcomes.append(queued)
        super().left(queued)

    def close(self, failed: bool) -> None:
        self.failed = failed
        super().close(failed)


class FanOutMachine(RuleBasedStateMachine):
    """Single requests and fan-outs of k prompts (some of them refused: an
    empty prompt, one over the context, one over the token budget) under any
    interleaving of engine news, cancels and late store answers: the request
    bucket holds exactly its capacity less one per single request that was
    queued and k per fan-out whose every job was queued -- never more, and
    a fan-out with any refusal takes nothing."""

    deferred = False
    RPM = 40

    def __init__(self) -> None:
        super().__init__()
        import router.lifecycle.fanout

        self.module = router.lifecycle.fanout
        self.module.Group = _Recorded  # (restored at teardown)
        self.h = QHarness(
            config(
                keys=[
                    {
                        "key_sha256": digest(KEY),
                        "tenant": "a",
                        "tokens_per_minute": 3000,
                        "requests_per_minute": self.RPM,
                    }
                ]
            )
        )
        self.h.core.quota.store = _Deferred() if self.deferred else _Frozen()
        self.singles: list = []  # the single requests' job records (kept past their end)
        self.fans: list = []  # (PromptFanOut, its _Recorded group or None)
        self.handles: list[int] = []
        self.h.join("w0", seqs=4, kv=4096)

    def teardown(self) -> None:
        self.module.Group = Group
        self.h.close()

    @rule(max_tokens=st.integers(1, 400))
    def single(self, max_tokens):
        got = self.h.submit_key(max_tokens=max_tokens)
        if isinstance(got, int):
            self.handles.append(got)
            self.singles.append(self.h.core.jobs["%x" % got])
        self.h.settle()

    @rule(
        prompts=st.lists(st.sampled_from([PROMPT, PROMPT, PROMPT, "", "x" * 20000]), min_size=2, max_size=50),
        max_tokens=st.sampled_from([4, 40, 2990]),
    )
    def fan_out(self, prompts, max_tokens):
        made = []
        real = _Recorded.__init__

        def record(group, size):  # the fan-out's group, as it makes it
            real(group, size)
            made.append(group)

        _Recorded.__init__ = record
        try:
            fan, _, _ = fan_out(self.h, len(prompts), prompts, max_tokens=max_tokens)
        finally:
            _Recorded.__init__ = real
        self.fans.append((fan, made[0]))
        self.h.settle()

    @precondition(lambda self: self.handles or self.fans)
    @rule(i=st.integers(0, 1000), finish=st.sampled_from([None, "stop"]))
    def news(self, i, finish):
        live = [h for h in self.handles] + [h for f, _ in self.fans for h in f.handles]
        if not live:
            return
        job_id = "%x" % live[i % len(live)]
        where = self.h.workers.where(job_id)
        if where is not None:
            self.h.core.on_outputs(where, [p.Delta(job_id, " t", 1, finish, prompt_tokens=PROMPT_TOKENS)])
        self.h.settle()

    @precondition(lambda self: self.fans)
    @rule(i=st.integers(0, 1000))
    def client_leaves(self, i):
        self.fans[i % len(self.fans)][0].cancel()
        self.h.settle()

    @precondition(lambda self: self.deferred)
    @rule(n=st.integers(1, 6))
    def store_answers(self, n):
        self.h.core.quota.store.answer(n)
        self.h.settle()

    def _charged(self) -> int:
        """What the request bucket should hold taken now."""
        # a single request: its unit while held, kept once it was queued (``mx``: set once queued)
        taken = sum(1 for j in self.singles if (j.mx is not None if j.state is JobState.ENDED else j.hold is not None))
        for _, g in self.fans:
            if g.hold is not None:  # held, not settled yet
                taken += g.size
            elif g.settled and g.quota is not None and not g.refund:
                taken += g.size
        return taken

    @invariant()
    def a_group_is_charged_whole_and_only_when_every_job_was_queued(self):
        for _, g in self.fans:
            if g.settled and not g.refund:
                assert g.failed is False and all(g.outcomes) and len(g.outcomes) == g.size
        if not self.deferred:  # (a store that answers later holds credits in flight)
            q = self.h.core.quota
            (rpm,) = [b for bs in q.by_key.values() for b in bs if not b.tokens]
            assert rpm.cap - q.store.level(rpm, 0.0) == self._charged()

    @rule()
    def everything_ends(self):
        for f, _ in self.fans:
            f.cancel()
        for h in self.handles:
            self.h.core.cancel(h)
        q = self.h.core.quota
        if self.deferred:
            for _ in range(3):
                q.store.answer(10**6)
                self.h.settle()
        self.h.settle()
        assert not self.h.core.jobs and q.outstanding == 0
        assert all(g.settled or g.quota is None for _, g in self.fans)
        (rpm,) = [b for bs in q.by_key.values() for b in bs if not b.tokens]
        assert rpm.cap - q.store.level(rpm, 0.0) == self._charged() <= self.RPM


class DeferredFanOutMachine(FanOutMachine):
    deferred = True


FanOutMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
DeferredFanOutMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_fan_out_state_machine = FanOutMachine.TestCase
test_fan_out_state_machine_with_a_store_that_answers_later = DeferredFanOutMachine.TestCase


def test_weir_keys_new_prints_a_key_once_and_an_entry_that_loads(capsys, tmp_path):
    from shared.config import loads
    from weir.cli import main

    assert main(["keys", "new", "--tenant", "team-a", "--tier", "high", "--tokens-per-minute", "5000"]) == 0
    out = capsys.readouterr().out
    key = next(line for line in out.splitlines() if line.startswith("sk-weir-"))
    entry = out[out.index("[[api_keys]]") :]
    assert key not in entry and digest(key) in entry
    cfg = loads(entry, str(tmp_path))
    (k,) = cfg.api_keys
    assert (k.tenant, k.tier, k.tokens_per_minute, k.key) == ("team-a", "high", 5000, None)
    assert main(["keys", "curve", str(tmp_path / "curve"), "--workers", "w0,w1", "--clients", "app"]) == 0
    names = sorted(p.relative_to(tmp_path / "curve").as_posix() for p in (tmp_path / "curve").rglob("*.key*"))
    assert names == [
        "clients/app.key",
        "clients/app.key_secret",
        "router.key",
        "router.key_secret",
        "workers/w0.key",
        "workers/w0.key_secret",
        "workers/w1.key",
        "workers/w1.key_secret",
    ]
    assert (tmp_path / "curve" / "router.key_secret").stat().st_mode & 0o077 == 0
