"""Per-phase timing without a collector (router.observe.phases): the lifecycle
stamps tokenize, queue, prefill and decode on each job and hands them to the
client -- the phases so far on its first news with tokens, all of them on
its last Delta, whatever its end (finish, refusal while queued, a resume)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fakes import FakeClock, FakeSink, FakeWorkers

from router.lifecycle.core import RouterCore
from router.observe.phases import server_timing
from shared import protocol as p
from shared.config import Config


def _config() -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "scheduler": {
                "classes": [
                    {"name": n, "queue_deadline_s": 5.0} for n in ("critical", "high", "normal", "low", "batch")
                ]
            },
            "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}],
        },
        Config,
    )


class _H:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.workers = FakeWorkers()
        self.core = RouterCore(_config(), self.loop, self.workers, clock=self.clock)

    def settle(self) -> None:
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))

    def join(self, wid: str) -> None:
        self.workers.linked.add(wid)
        self.core.worker_joined(p.Register(wid, "sim-m", p.Pool.ANY, 4096, 8192, 16, 4, "sim"))

    def news(self, handle: int, n: int, finish: str | None = None, done: int = 0) -> None:
        job = "%x" % handle
        wid = self.workers.where(job)
        assert wid is not None
        self.core.on_outputs(wid, [p.Delta(job, " t" * n, n, finish, completion_tokens=done or n, token_ids=[7] * n)])


@pytest.fixture
def h():
    harness = _H()
    yield harness
    harness.core.close()
    harness.loop.close()


def _approx(t: p.Timing, **want: float) -> None:
    got = msgspec.structs.asdict(t)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-9), (k, got)


def test_first_news_carries_the_phases_so_far_and_the_last_all_of_them(h):
    h.join("w0")
    sink = FakeSink()
    h.clock.t = 1000.0
    handle = h.core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=4), sink)
    assert isinstance(handle, int)
    h.clock.t = 1000.5  # the policy pass dispatches it half a second later
    h.settle()
    h.clock.t = 1000.7
    h.news(handle, 1)
    first = sink.deltas[0].timing
    assert first is not None
    _approx(first, tokenize=0.0, queue=0.5, prefill=0.2, decode=0.0, total=0.0)
    h.clock.t = 1001.0
    h.news(handle, 1)
    assert sink.deltas[1].timing is None  # nothing new to say between first and last
    h.clock.t = 1001.2
    h.news(handle, 1, "stop", done=3)
    last = sink.finals[0].timing
    assert last is not None
    _approx(last, tokenize=0.0, queue=0.5, prefill=0.2, decode=0.5, total=1.2)
    head = server_timing(last)
    assert head.startswith(b"server-timing: tokenize;dur=0.000, queue;dur=500.000, prefill;dur=200.000")
    assert head.endswith(b"decode;dur=500.000, total;dur=1200.000\r\n")
    assert b"total" not in server_timing(first)  # a stream's head: the phases so far


def test_a_resume_keeps_the_first_attempts_prefill(h):
    h.join("w0")
    sink = FakeSink()
    h.clock.t = 1000.0
    handle = h.core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=8), sink)
    assert isinstance(handle, int)
    h.settle()
    h.clock.t = 1000.3
    h.news(handle, 2)
    h.join("w1")
    h.clock.t = 1000.6
    h.workers.linked.discard("w0")
    h.core.worker_left("w0", "heartbeat_timeout")  # streamed already: resumed on w1
    h.settle()
    assert h.workers.where("%x" % handle) == "w1"
    h.clock.t = 1001.0
    h.news(handle, 1, "stop")
    last = sink.finals[0].timing
    assert last is not None
    _approx(last, queue=0.0, prefill=0.3, decode=0.7, total=1.0)


def test_a_refusal_while_queued_says_how_long_it_queued(h):
    h.join("w0")
    sink = FakeSink()
    h.clock.t = 1000.0
    handle = h.core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=4), sink)
    assert isinstance(handle, int)
    h.workers.linked.discard("w0")
    h.core.worker_left("w0", "heartbeat_timeout")  # before its dispatch: it waits until its queue deadline
    h.clock.t = 1006.0
    h.core.run_policy()
    final = sink.finals[0]
    assert final.error is not None and final.timing is not None
    _approx(final.timing, tokenize=0.0, queue=6.0, prefill=0.0, decode=0.0, total=6.0)


def test_genai_named_metrics_observe_the_same_request(h):
    h.join("w0")
    sink = FakeSink()
    h.clock.t = 1000.0
    handle = h.core.submit(
        p.Submit("c", "sim-m", kind=p.RequestKind.CHAT, messages=[p.ChatMessage("user", "hi")], max_tokens=4), sink
    )
    assert isinstance(handle, int)
    h.settle()
    h.clock.t = 1000.25
    h.news(handle, 1)
    h.clock.t = 1001.25
    h.news(handle, 2, "stop", done=3)
    reg = h.core.metrics.registry
    labels = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "sim-m"}
    assert reg.get_sample_value("gen_ai_server_time_to_first_token_seconds_sum", labels) == pytest.approx(0.25)
    assert reg.get_sample_value("gen_ai_server_time_per_output_token_seconds_sum", labels) == pytest.approx(0.5)
    assert reg.get_sample_value("gen_ai_server_request_duration_seconds_count", labels) == 1
    assert reg.get_sample_value("gen_ai_server_request_duration_seconds_sum", labels) == pytest.approx(1.25)


def test_weir_stats_splits_each_models_time_by_phase(h):
    from prometheus_client.parser import text_string_to_metric_families

    from weir.stats import _phases

    h.join("w0")
    sink = FakeSink()
    h.clock.t = 1000.0
    handle = h.core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=4), sink)
    assert isinstance(handle, int)
    h.clock.t = 1000.03  # queued 30 ms
    h.settle()
    h.clock.t = 1000.33  # prefill 300 ms
    h.news(handle, 1)
    h.clock.t = 1002.33  # decode 2 s
    h.news(handle, 1, "stop", done=2)
    metrics: dict[str, list] = {}
    text = "".join(chunk for source in h.core.metrics.sources for chunk in source())
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            metrics.setdefault(s.name, []).append((s.labels, s.value))
    split = _phases(metrics, None)["sim-m"]
    # one request: each p50 lies in the bucket that holds its phase
    assert split["tokenize_p50_s"] is not None and split["tokenize_p50_s"] <= 0.0005
    assert 0.025 < split["queue_p50_s"] <= 0.05
    assert 0.25 < split["prefill_p50_s"] <= 0.5
    assert 1.0 < split["decode_p50_s"] <= 2.5
