"""The router's spans of a traced request (``[tracing]``; docs/operating.md#tracing).

A request is traced when its parent context says so (a client's or Envoy's
``traceparent``, or a direct client's ``Submit.trace_context``) or, with no
parent, with probability ``sampling_ratio``.  Nothing is timed for it that
the lifecycle does not stamp anyway: at its end ``ended`` turns its
timestamps into spans, one tuple each, and hands them to the exporter
(shared.otlp: a bounded queue and a thread).  A job that is not traced
costs one ``is None`` test at submit, dispatch and end.

The spans, under the parent's (Envoy's server span when it came through Envoy):

    weir.request                       SERVER  arrival -> end (GenAI attributes)
      weir.tokenize                            arrival -> tokenized
      weir.admission                           tokenized -> queued (budgets, admission by predicted wait)
      weir.queue          (per attempt)        queued (or the previous attempt's last news) -> dispatch
      weir.placement      (per attempt)        the chosen worker and its load when chosen
      weir.dispatch       (per attempt) CLIENT dispatch -> its worker's last news; the worker's spans
                                               hang under it, and a resume's links to the attempt before

Attribute names follow OpenTelemetry's GenAI semantic conventions where one
exists (``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ...), else ``weir.*``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from router.observe.exposition import TextCollector, header, number
from shared import protocol as p
from shared.config import TracingConfig
from shared.otlp import (
    CLIENT,
    INTERNAL,
    SERVER,
    Span,
    SpanExporter,
    SpanSink,
    WallClock,
    new_span_id,
    new_trace_id,
    sampled,
)

OPERATION = {
    p.RequestKind.COMPLETION: "text_completion",
    p.RequestKind.CHAT: "chat",
    p.RequestKind.EMBEDDING: "embeddings",
}


class JobTrace:
    """One traced job: its trace, the parent span, its own root span, its attempts."""

    __slots__ = ("trace_id", "parent", "root", "state", "queued_at", "predicted", "attempts")

    def __init__(self, trace_id: bytes, parent: bytes, state: str) -> None:
        self.trace_id = trace_id
        self.parent = parent
        self.root = new_span_id()
        self.state = state
        self.queued_at = 0.0  # admitted into the policy's queue (router.lifecycle.intake)
        self.predicted = -1.0  # the queue wait admission predicted (s); -1: none
        # per dispatch: [span id, worker, dispatched at, placement attributes, ended at (0: the last)]
        self.attempts: list[list[Any]] = []


class TracedJob(Protocol):
    """What ``ended`` reads of a job (router.lifecycle.jobs.JobRecord)."""

    job_id: str
    sub: p.Submit
    arrival: float
    tokenized_at: float
    first_token_at: float
    prompt_tokens: int
    completion_tokens: int
    max_tokens: int
    resumes: int

    @property
    def model(self) -> str: ...

    @property
    def trace(self) -> str: ...


class RouterTracer(TextCollector):
    def __init__(self, cfg: TracingConfig, exporter: SpanSink | None = None) -> None:
        self.ratio = cfg.sampling_ratio
        self.exporter: SpanSink = exporter or SpanExporter(cfg, cfg.router_service)
        self.wall = WallClock()
        self.started = 0  # traces this router took part in

    def start(self, parent: p.TraceContext | None) -> JobTrace | None:
        """A new job's trace (None: not sampled): the parent's, or a new one at the ratio."""
        if parent is not None:
            if not parent.sampled:
                return None
            jt = JobTrace(parent.trace_id, parent.span_id, parent.state)
        elif sampled(self.ratio):
            jt = JobTrace(new_trace_id(), b"", "")
        else:
            return None
        self.started += 1
        return jt

    @staticmethod
    def dispatched(
        jt: JobTrace, now: float, worker: str, placement: dict[str, Any], last_news: float
    ) -> p.TraceContext:
        """An attempt leaves for ``worker``: the context its worker's spans hang
        under.  ``last_news``: the job's latest news until now -- where the
        attempt before it (lost, refused, stalled) last heard from its worker."""
        if jt.attempts:
            before = jt.attempts[-1]
            before[4] = max(before[2], min(last_news, now))
        span = new_span_id()
        jt.attempts.append([span, worker, now, placement, 0.0])
        return p.TraceContext(jt.trace_id, span, True, jt.state)

    def ended(
        self, jt: JobTrace, j: TracedJob, outcome: str, error: p.ErrorInfo | None, now: float, cached: int = 0
    ) -> None:
        """The job is over: its spans, to the exporter."""
        ns = self.wall.ns
        tid, root, state = jt.trace_id, jt.root, jt.state
        sub = j.sub
        end_ns = ns(now)
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": OPERATION.get(sub.kind, "text_completion"),
            "gen_ai.request.model": sub.model,
            "gen_ai.response.model": j.model,
            "gen_ai.usage.input_tokens": j.prompt_tokens,
            "gen_ai.usage.output_tokens": j.completion_tokens,
            "weir.request_id": j.trace,
            "weir.job_id": j.job_id,
            "weir.outcome": outcome,
            "weir.resumes": j.resumes,
        }
        if j.max_tokens:
            attrs["gen_ai.request.max_tokens"] = j.max_tokens
        if sub.params is not None:
            attrs["gen_ai.request.temperature"] = sub.params.temperature
            attrs["gen_ai.request.top_p"] = sub.params.top_p
        if error is None and outcome in ("stop", "length"):
            attrs["gen_ai.response.finish_reasons"] = outcome
        if j.first_token_at:
            attrs["weir.time_to_first_token_s"] = j.first_token_at - j.arrival
        err = ""
        if error is not None:
            attrs["error.type"] = error.code or outcome
            attrs["http.response.status_code"] = error.status
            err = error.message[:256]
        spans = [Span(tid, root, jt.parent, "weir.request", SERVER, ns(j.arrival), end_ns, attrs, (), err, state)]
        tokenized = j.tokenized_at or now
        spans.append(
            Span(
                tid,
                new_span_id(),
                root,
                "weir.tokenize",
                INTERNAL,
                ns(j.arrival),
                ns(tokenized),
                {"gen_ai.usage.input_tokens": j.prompt_tokens},
                (),
                "",
                state,
            )
        )
        if jt.queued_at:
            adm: dict[str, Any] = {}
            if jt.predicted >= 0:
                adm["weir.queue.predicted_wait_s"] = jt.predicted
            spans.append(
                Span(
                    tid,
                    new_span_id(),
                    root,
                    "weir.admission",
                    INTERNAL,
                    ns(tokenized),
                    ns(jt.queued_at),
                    adm,
                    (),
                    "",
                    state,
                )
            )
        queue_from = jt.queued_at or tokenized
        prev: bytes | None = None
        for i, (span, worker, at, placement, over) in enumerate(jt.attempts):
            qa: dict[str, Any] = {"weir.attempt": i}
            if i == 0 and jt.predicted >= 0:
                qa["weir.queue.predicted_wait_s"] = jt.predicted
            spans.append(
                Span(tid, new_span_id(), root, "weir.queue", INTERNAL, ns(queue_from), ns(at), qa, (), "", state)
            )
            spans.append(
                Span(tid, new_span_id(), root, "weir.placement", INTERNAL, ns(at), ns(at), placement, (), "", state)
            )
            last = not over
            over = over or now
            da: dict[str, Any] = {"weir.worker": worker, "weir.attempt": i}
            if last and cached:
                da["weir.prefix.cached_tokens"] = cached
            spans.append(
                Span(
                    tid,
                    span,
                    root,
                    "weir.dispatch",
                    CLIENT,
                    ns(at),
                    ns(over),
                    da,
                    () if prev is None else (prev,),
                    "",
                    state,
                )
            )
            prev = span
            queue_from = over
        if not jt.attempts and jt.queued_at:  # ended while queued
            spans.append(
                Span(tid, new_span_id(), root, "weir.queue", INTERNAL, ns(queue_from), end_ns, {}, (), "", state)
            )
        self.exporter.add(spans)

    def close(self) -> None:
        close = getattr(self.exporter, "close", None)
        if close is not None:
            close()

    def text(self) -> Iterator[str]:
        exp = self.exporter
        name = "weir_tracing_traces_started"
        yield header(name, "Traced requests this router recorded spans for", "counter")
        yield f"{name}_total {number(self.started)}\n"
        name = "weir_tracing_spans_exported"
        yield header(name, "Spans sent to the OTLP collector", "counter")
        yield f"{name}_total {number(getattr(exp, 'exported', 0))}\n"
        name = "weir_tracing_spans_dropped"
        yield header(name, "Spans dropped: the export queue was full or the collector failed", "counter")
        yield f"{name}_total {number(getattr(exp, 'dropped', 0))}\n"
