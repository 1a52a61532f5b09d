"""The router's spans of a traced request (router.observe.tracing), in process:
which requests are traced, the tree of spans and their parents, the context
each dispatch hands its worker, and a resume's dispatch linked to the one before."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fakes import FakeClock, FakeSink, FakeWorkers

from router.lifecycle.core import RouterCore
from router.observe.tracing import RouterTracer
from shared import protocol as p
from shared.config import Config
from shared.otlp import SERVER, Span, parse_traceparent, traceparent

PARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Spans:
    def __init__(self) -> None:
        self.spans: list[Span] = []

    def add(self, spans: list[Span]) -> None:
        self.spans.extend(spans)

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]


def _core(ratio: float) -> tuple[RouterCore, _Spans, FakeWorkers, asyncio.AbstractEventLoop]:
    cfg = msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}],
            "tracing": {"endpoint": "127.0.0.1:9", "sampling_ratio": ratio},
        },
        Config,
    )
    loop = asyncio.new_event_loop()
    workers = FakeWorkers()
    spans = _Spans()
    core = RouterCore(cfg, loop, workers, clock=FakeClock())
    assert core.tracer is not None
    core.tracer.close()
    core.tracer = RouterTracer(cfg.tracing, spans)
    return core, spans, workers, loop


@pytest.fixture
def traced():
    core, spans, workers, loop = _core(1.0)
    yield core, spans, workers, loop
    core.close()
    loop.close()


def _join(core: RouterCore, workers: FakeWorkers, wid: str) -> None:
    workers.linked.add(wid)
    core.worker_joined(p.Register(wid, "sim-m", p.Pool.ANY, 4096, 8192, 16, 4, "sim"))


def _settle(loop: asyncio.AbstractEventLoop) -> None:
    for _ in range(3):
        loop.run_until_complete(asyncio.sleep(0))


def test_a_clients_trace_is_continued_and_every_router_span_hangs_under_the_request(traced):
    core, spans, workers, loop = traced
    _join(core, workers, "w0")
    ctx = parse_traceparent(PARENT, b"vendor=x")
    assert ctx is not None and ctx.sampled
    sub = p.Submit("c", "sim-m", prompt="hello", max_tokens=4, trace_context=ctx)
    handle = core.submit(sub, FakeSink())
    assert isinstance(handle, int)
    _settle(loop)
    req = workers.dispatched["w0"][0]
    sent = req.trace_context
    assert sent is not None and sent.trace_id == ctx.trace_id and sent.sampled and sent.state == "vendor=x"
    core.on_outputs(
        "w0", [p.Delta(req.request_id, "x", 1, "stop", prompt_tokens=2, completion_tokens=1, token_ids=[7])]
    )
    _settle(loop)  # (spans are built after the turn's replies leave)
    assert {s.trace_id for s in spans.spans} == {ctx.trace_id}
    (root,) = spans.named("weir.request")
    assert root.parent_id == ctx.span_id and root.kind == SERVER
    assert root.attributes["gen_ai.request.model"] == "sim-m"
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.usage.output_tokens"] == 1
    assert root.attributes["gen_ai.response.finish_reasons"] == "stop"
    for name in ("weir.tokenize", "weir.admission", "weir.queue", "weir.placement", "weir.dispatch"):
        (s,) = spans.named(name)
        assert s.parent_id == root.span_id, name
        assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns, name
    (dispatch,) = spans.named("weir.dispatch")
    assert dispatch.span_id == sent.span_id  # the worker's spans are its children
    assert spans.named("weir.placement")[0].attributes["weir.worker"] == "w0"
    assert traceparent(sent) == f"00-{ctx.trace_id.hex()}-{sent.span_id.hex()}-01"


def test_a_resume_is_a_second_dispatch_linked_to_the_first(traced):
    core, spans, workers, loop = traced
    _join(core, workers, "w0")
    handle = core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=8), FakeSink())
    assert isinstance(handle, int)
    _settle(loop)
    first = workers.dispatched["w0"][0]
    assert first.trace_context is not None
    first_span = first.trace_context.span_id
    core.on_outputs("w0", [p.Delta(first.request_id, "ab", 2, completion_tokens=2, token_ids=[7, 7])])
    _join(core, workers, "w1")
    workers.linked.discard("w0")
    core.worker_left("w0", "heartbeat_timeout")  # streamed: resumed on w1
    _settle(loop)
    second = workers.dispatched["w1"][0]
    assert second.trace_context is not None and second.trace_context.span_id != first_span
    assert second.trace_context.trace_id == first.trace_context.trace_id
    core.on_outputs("w1", [p.Delta(second.request_id, "c", 1, "stop", completion_tokens=1, token_ids=[7])])
    _settle(loop)
    d1, d2 = spans.named("weir.dispatch")
    assert (d1.span_id, d2.span_id) == (first_span, second.trace_context.span_id)
    assert d1.links == () and d2.links == (first_span,)
    assert d1.end_ns <= d2.start_ns
    assert [s.attributes["weir.worker"] for s in (d1, d2)] == ["w0", "w1"]


def test_an_unsampled_parent_or_a_zero_ratio_traces_nothing():
    core, spans, workers, loop = _core(0.0)
    try:
        _join(core, workers, "w0")
        unsampled = parse_traceparent(PARENT[:-2] + b"00")
        for ctx in (unsampled, None):
            handle = core.submit(p.Submit("c", "sim-m", prompt="hi", max_tokens=1, trace_context=ctx), FakeSink())
            assert isinstance(handle, int)
            _settle(loop)
        for req in workers.dispatched["w0"]:
            assert req.trace_context is None
            core.on_outputs("w0", [p.Delta(req.request_id, "x", 1, "stop", completion_tokens=1, token_ids=[7])])
            _settle(loop)
        assert spans.spans == [] and not core.jobs
    finally:
        core.close()
        loop.close()


@pytest.mark.parametrize(
    "bad",
    [
        b"garbage",
        b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01",
    ],
)
def test_a_malformed_traceparent_is_ignored(bad):
    assert parse_traceparent(bad) is None
