"""One trace from the client to the engine, through real processes: Envoy's
OpenTelemetry tracer, the router and the worker export to a real OTLP
receiver (tests/otlp_receiver.py, over gRPC and over HTTP), and one request's
spans share one trace id with the right parents; each response carries its
phases in ``server-timing``; a collector that is down fails no request.

Own stacks on the simulated engine (~2 s each): tracing is per process."""

from __future__ import annotations

import re
import signal
import time
import uuid

import pytest
import requests
import stackutil
from otlp_receiver import Receiver, RSpan, export_in_child

from shared.client import Client
from shared.otlp import SERVER, Span, new_span_id, new_trace_id

ROUTER_SPANS = {"weir.request", "weir.tokenize", "weir.admission", "weir.queue", "weir.placement", "weir.dispatch"}
WORKER_SPANS = {"weir.worker.request", "weir.worker.prefill", "weir.worker.decode"}
TIMING = re.compile(r"(\w+);dur=([0-9.]+)")


def _traced_stack(d, endpoint: str, protocol: str):
    cfg = stackutil.write_config(
        d,
        workers=[stackutil.sim_worker("sim-0")],
        tracing={"endpoint": endpoint, "protocol": protocol, "sampling_ratio": 1.0, "export_timeout_s": 1.0},
    )
    return stackutil.start_stack(cfg, d / "run")


@pytest.fixture(scope="module", params=["grpc", "http"])
def traced(request, tmp_path_factory):
    rx = Receiver(request.param).start()
    try:
        with _traced_stack(tmp_path_factory.mktemp(f"tracing-{request.param}"), rx.endpoint, request.param) as s:
            yield s, rx
    finally:
        rx.stop()


def _timing(header: str) -> dict[str, float]:
    return {k: float(v) for k, v in TIMING.findall(header)}


def _wait(rx: Receiver, trace: str, names: set[str], envoy: bool) -> list[RSpan]:
    """The trace's spans once the router's, the worker's and (``envoy``) Envoy's have come."""
    deadline = time.monotonic() + 20
    while True:
        spans = rx.wait_for(trace, names, timeout_s=20)
        if not envoy or any(s.service == "weir-envoy" for s in spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def _check_router_and_worker(spans: list[RSpan], parent_of_root: str) -> None:
    """The router's spans under its weir.request (whose parent is given), the worker's under its dispatch."""
    by: dict[str, list[RSpan]] = {}
    for s in spans:
        by.setdefault(s.name, []).append(s)
    assert ROUTER_SPANS | WORKER_SPANS <= set(by), sorted(by)
    (root,) = by["weir.request"]
    assert root.service == "weir-router" and root.parent_id == parent_of_root
    assert root.attributes["gen_ai.request.model"] == stackutil.SIM_MODEL
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    for name in ROUTER_SPANS - {"weir.request"}:
        assert all(s.parent_id == root.span_id for s in by[name]), name
    (dispatch,) = by["weir.dispatch"]
    (worker,) = by["weir.worker.request"]
    assert worker.service == "weir-worker" and worker.parent_id == dispatch.span_id
    assert worker.attributes["gen_ai.usage.output_tokens"] == 4
    assert {s.parent_id for s in by["weir.worker.prefill"] + by["weir.worker.decode"]} == {worker.span_id}
    assert root.start_ns <= dispatch.start_ns and worker.end_ns <= root.end_ns + 50_000_000  # (clocks of two processes)


def test_a_clients_trace_runs_through_envoy_router_and_worker(traced):
    stack, rx = traced
    trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    r = requests.post(
        stack.envoy_url + "/v1/completions",
        json={"model": stackutil.SIM_MODEL, "prompt": "hello there", "max_tokens": 4},
        headers={"traceparent": f"00-{trace}-{client_span}-01"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    phases = _timing(r.headers["server-timing"])
    assert set(phases) == {"tokenize", "queue", "prefill", "decode", "total"}
    assert phases["total"] >= phases["prefill"] + phases["decode"]
    spans = _wait(rx, trace, ROUTER_SPANS | WORKER_SPANS, envoy=True)
    (envoy,) = [s for s in spans if s.service == "weir-envoy"]
    assert envoy.parent_id == client_span  # Envoy's span is the client's child ...
    _check_router_and_worker(
        [s for s in spans if s.service != "weir-envoy"], envoy.span_id
    )  # ... and the router's parent


def test_without_a_parent_envoy_starts_the_trace_and_a_stream_gets_its_phases_so_far(traced):
    stack, rx = traced
    r = requests.post(
        stack.envoy_url + "/v1/completions",
        json={"model": stackutil.SIM_MODEL, "prompt": "hello there", "max_tokens": 4, "stream": True},
        timeout=30,
    )
    assert r.status_code == 200 and "[DONE]" in r.text
    assert set(_timing(r.headers["server-timing"])) == {
        "tokenize",
        "queue",
        "prefill",
    }  # the head left with the first tokens
    root = _wait_root(rx, r.headers["x-request-id"])
    spans = _wait(rx, root.trace_id, ROUTER_SPANS | WORKER_SPANS, envoy=True)
    (envoy,) = [s for s in spans if s.service == "weir-envoy"]
    assert envoy.parent_id == ""
    _check_router_and_worker([s for s in spans if s.service != "weir-envoy"], envoy.span_id)


def _wait_root(rx: Receiver, rid: str) -> RSpan:
    deadline = time.monotonic() + 20
    while True:
        found = [s for s in list(rx.spans) if s.name == "weir.request" and s.attributes.get("weir.request_id") == rid]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no router span for request {rid}"
        time.sleep(0.1)


def test_a_direct_zeromq_client_passes_its_context_in_submit(traced):
    stack, rx = traced
    trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    with Client(stack.zmq_frontend, timeout_s=30) as c:
        deltas = list(
            c.stream(stackutil.SIM_MODEL, "hello there", max_tokens=4, traceparent=f"00-{trace}-{client_span}-01")
        )
    last = deltas[-1]
    assert last.finish_reason == "length" and last.timing is not None and last.timing.total > 0
    spans = _wait(rx, trace, ROUTER_SPANS | WORKER_SPANS, envoy=False)
    assert {s.service for s in spans} == {"weir-router", "weir-worker"}
    _check_router_and_worker(spans, client_span)


def test_an_unsampled_clients_trace_is_traced_nowhere(traced):
    stack, rx = traced
    body = {"model": stackutil.SIM_MODEL, "prompt": "hello there", "max_tokens": 4}
    unsampled, sampled = uuid.uuid4().hex, uuid.uuid4().hex
    for trace, flag in ((unsampled, "00"), (sampled, "01")):
        headers = {"traceparent": f"00-{trace}-{uuid.uuid4().hex[:16]}-{flag}"}
        r = requests.post(stack.envoy_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200 and "server-timing" in r.headers  # the phases whether traced or not
    _wait(rx, sampled, ROUTER_SPANS | WORKER_SPANS, envoy=True)  # the one sent after it has come whole
    assert rx.trace(unsampled) == []


def test_a_collector_that_is_down_fails_no_request(tmp_path):
    dead = f"127.0.0.1:{stackutil.free_port()}"  # nothing listens there
    with _traced_stack(tmp_path, dead, "grpc") as stack:
        for i in range(20):
            r = requests.post(
                stack.envoy_url + "/v1/completions",
                json={"model": stackutil.SIM_MODEL, "prompt": "hello", "max_tokens": 4, "stream": i % 2 == 0},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert "server-timing" in r.headers
        want = 20 * len(ROUTER_SPANS)  # every router span of them, counted as dropped
        deadline = time.monotonic() + 15
        while True:
            text = requests.get(stack.router_url + "/metrics", timeout=5).text
            m = re.search(r"^weir_tracing_spans_dropped_total ([0-9.e+]+)$", text, re.M)
            dropped = float(m.group(1)) if m else 0.0
            if dropped >= want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert dropped >= want


@pytest.mark.vllm
def test_vllms_own_request_span_hangs_under_the_workers(tmp_path):
    """The real engine: the worker hands its span's context to vLLM (trace_headers),
    whose ``llm_request`` span (exported by vLLM itself) is that span's child."""
    rx = Receiver("grpc").start()
    try:
        cfg = stackutil.write_config(
            tmp_path,
            workers=[stackutil.vllm_worker("vllm-0")],
            tracing={"endpoint": rx.endpoint, "sampling_ratio": 1.0, "export_timeout_s": 1.0},
        )
        with stackutil.start_stack(cfg, tmp_path / "run") as stack:
            trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
            r = requests.post(
                stack.envoy_url + "/v1/completions",
                json={"model": stackutil.VLLM_MODEL, "prompt": "hello there", "max_tokens": 4, "ignore_eos": True},
                headers={"traceparent": f"00-{trace}-{client_span}-01"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert set(_timing(r.headers["server-timing"])) == {"tokenize", "queue", "prefill", "decode", "total"}
            spans = rx.wait_for(trace, ROUTER_SPANS | WORKER_SPANS | {"llm_request"}, timeout_s=30)
            by = {s.name: s for s in spans}
            assert ROUTER_SPANS | WORKER_SPANS | {"llm_request"} <= set(by), sorted(by)
            engine, worker = by["llm_request"], by["weir.worker.request"]
            assert engine.service == "vllm" and engine.parent_id == worker.span_id
            assert engine.attributes["gen_ai.usage.completion_tokens"] == 4
            assert worker.parent_id == by["weir.dispatch"].span_id
            assert by["weir.request"].parent_id not in ("", client_span)  # Envoy's span between
    finally:
        rx.stop()


def test_a_stream_resumed_after_its_worker_died_is_one_trace_with_the_resume_linked(tmp_path):
    rx = Receiver("grpc").start()
    try:
        cfg = stackutil.write_config(
            tmp_path,
            workers=[stackutil.sim_worker("sim-0"), stackutil.sim_worker("sim-1")],
            tracing={"endpoint": rx.endpoint, "sampling_ratio": 1.0, "export_timeout_s": 1.0},
        )
        with stackutil.start_stack(cfg, tmp_path / "run") as stack:
            trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
            body = {"model": stackutil.SIM_MODEL, "prompt": "hello there", "max_tokens": 1500, "stream": True}
            headers = {"traceparent": f"00-{trace}-{client_span}-01"}
            with requests.post(
                stack.envoy_url + "/v1/completions", json=body, headers=headers, stream=True, timeout=60
            ) as r:
                lines = r.iter_lines()
                for _ in range(5):
                    next(lines)
                running = [
                    w
                    for w in ("sim-0", "sim-1")
                    if requests.get(f"{stack.router_url}/admin/workers/{w}", timeout=5).json()["running"]
                ]
                assert len(running) == 1, running
                stack.components[f"worker:{running[0]}"].signal_group(signal.SIGKILL)
                rest = b"\n".join(lines)
            assert b"[DONE]" in rest and b'"error"' not in rest
            spans = rx.wait_for(trace, ROUTER_SPANS | WORKER_SPANS, timeout_s=30)
            (root,) = [s for s in spans if s.name == "weir.request"]
            assert root.attributes["weir.resumes"] == 1 and root.attributes["gen_ai.usage.output_tokens"] == 1500
            first, second = sorted((s for s in spans if s.name == "weir.dispatch"), key=lambda s: s.start_ns)
            assert first.attributes["weir.worker"] == running[0] != second.attributes["weir.worker"]
            assert first.links == [] and second.links == [first.span_id]  # the resume, linked to what it continues
            (worker,) = [s for s in spans if s.name == "weir.worker.request"]  # the killed one sent none
            assert worker.parent_id == second.span_id
    finally:
        rx.stop()


def _span(tid: bytes, name: str = "s", parent: bytes = b"") -> Span:
    now = time.time_ns()
    return Span(
        tid, new_span_id(), parent, name, SERVER, now, now + 1000, {"gen_ai.request.model": "m", "n": 3, "x": 0.5}
    )


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_real_receiver_gets_the_spans_with_their_service_and_attributes(protocol):
    rx = Receiver(protocol).start()
    try:
        tid = new_trace_id()
        counts = export_in_child(rx.endpoint, protocol, tid)  # (gRPC stays out of this process: otlp_receiver)
        got = rx.trace(tid.hex())
        assert sorted(s.name for s in got) == ["child", "root"]
        assert {s.service for s in got} == {"weir-test"}
        root = next(s for s in got if s.name == "root")
        child = next(s for s in got if s.name == "child")
        assert child.parent_id == root.span_id
        assert child.attributes == {"gen_ai.request.model": "m", "n": 3, "x": 0.5}
        assert counts["exported"] == 2 and counts["dropped"] == 0
    finally:
        rx.stop()
