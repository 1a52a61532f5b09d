"""Spans out of a process (shared.otlp) and the worker's spans (engine_worker.tracing):
a collector that is down or a queue that is full drops and counts spans
without ever blocking (what a live receiver gets: tests/e2e/test_tracing.py)."""

from __future__ import annotations

import time

import pytest
from otlp_receiver import export_in_child
from stackutil import free_port

from engine_worker.tracing import WorkerTracer
from shared.config import TracingConfig
from shared.otlp import SERVER, Span, SpanExporter, new_span_id, new_trace_id
from shared.protocol import Delta, GenerateRequest, SamplingParams, TraceContext


def _span(tid: bytes, name: str = "s", parent: bytes = b"") -> Span:
    now = time.time_ns()
    return Span(
        tid, new_span_id(), parent, name, SERVER, now, now + 1000, {"gen_ai.request.model": "m", "n": 3, "x": 0.5}
    )


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_dead_collector_costs_dropped_spans_never_a_wait(protocol):
    # (exported from a child process: gRPC's threads stay out of the test runner, otlp_receiver)
    got = export_in_child(f"127.0.0.1:{free_port()}", protocol, new_trace_id(), n=200, timeout_s=0.5)
    assert got["added_s"] < 0.5  # queued, not sent, by the caller
    assert got["exported"] == 0 and got["dropped"] == 200


def test_a_full_queue_drops_and_counts_the_rest():
    exp = SpanExporter(TracingConfig(endpoint=f"127.0.0.1:{free_port()}", protocol="http", max_queued_spans=10), "t")
    exp.add([_span(new_trace_id()) for _ in range(25)])
    assert exp.dropped_full == 15
    exp.close(timeout_s=5.0)


class _Spans:
    def __init__(self) -> None:
        self.spans: list[Span] = []

    def add(self, spans: list[Span]) -> None:
        self.spans.extend(spans)


def test_the_worker_spans_hang_under_the_routers_dispatch_and_hand_their_own_context_on():
    out = _Spans()
    tracer = WorkerTracer(TracingConfig(endpoint="127.0.0.1:9"), "w0", "m", "sim", out)
    tid, dispatch = new_trace_id(), new_span_id()
    req = GenerateRequest(
        "0:1", [1, 2, 3], 3, SamplingParams(max_tokens=4), trace_context=TraceContext(tid, dispatch, True)
    )
    tracer.dispatched("0:1", req)
    assert req.trace_context is not None and req.trace_context.trace_id == tid
    own = req.trace_context.span_id
    assert own != dispatch  # what the engine (vLLM's span) hangs under: the worker's span
    tracer.delta("0:1", Delta("0:1", "a", 1, prompt_tokens=3, completion_tokens=1))
    tracer.delta("0:1", Delta("0:1", "b", 1, "length", prompt_tokens=3, completion_tokens=2, cached_tokens=2))
    assert not tracer.live
    by = {s.name: s for s in out.spans}
    assert set(by) == {"weir.worker.request", "weir.worker.prefill", "weir.worker.decode"}
    w = by["weir.worker.request"]
    assert (w.span_id, w.parent_id, w.trace_id) == (own, dispatch, tid)
    assert w.attributes["gen_ai.usage.input_tokens"] == 3 and w.attributes["gen_ai.usage.output_tokens"] == 2
    assert w.attributes["weir.prefix.cached_tokens"] == 2
    assert by["weir.worker.prefill"].parent_id == own and by["weir.worker.decode"].parent_id == own
    assert w.start_ns <= by["weir.worker.prefill"].end_ns <= by["weir.worker.decode"].start_ns + 1 <= w.end_ns + 1


def test_an_untraced_request_is_left_alone():
    out = _Spans()
    tracer = WorkerTracer(TracingConfig(endpoint="127.0.0.1:9"), "w0", "m", "sim", out)
    unsampled = GenerateRequest(
        "0:1", [], 3, SamplingParams(), trace_context=TraceContext(new_trace_id(), new_span_id())
    )
    for req in (GenerateRequest("0:2", [], 3, SamplingParams()), unsampled):
        tracer.dispatched(req.request_id, req)
        tracer.delta(req.request_id, Delta(req.request_id, "a", 1, "stop"))
    assert (
        out.spans == []
        and not tracer.live
        and unsampled.trace_context is not None
        and not unsampled.trace_context.sampled
    )
