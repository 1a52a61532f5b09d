"""The worker's spans of a traced request (``[tracing]``; docs/operating.md#tracing).

A GenerateRequest with a sampled ``trace_context`` (the router's dispatch
span) is traced here: its span ``weir.worker.request`` is a child of that
dispatch span, with ``weir.worker.prefill`` (received -> first token: the
engine's queue and prefill) and ``weir.worker.decode`` (first token -> end)
under it, each with its token counts.  The request's context is replaced by
the worker span's before the engine sees it, so vLLM's own ``llm_request``
span (its ``trace_headers``) hangs under the worker's.

Nothing is sent per token: the worker keeps three numbers per traced request
and hands the spans to the exporter (shared.otlp) when its last Delta goes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shared.config import TracingConfig
from shared.otlp import INTERNAL, SERVER, Span, SpanExporter, SpanSink, WallClock, new_span_id
from shared.protocol import Delta, GenerateRequest, TraceContext

MAX_LIVE = 100_000  # traced requests held at once; beyond it (ends nobody reported) the oldest are forgotten


class _Traced:
    __slots__ = ("ctx", "span", "received", "first_token", "prompt_tokens", "max_tokens")

    def __init__(self, ctx: TraceContext, span: bytes, received: float, prompt_tokens: int, max_tokens: int) -> None:
        self.ctx = ctx
        self.span = span
        self.received = received
        self.first_token = 0.0
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class WorkerTracer:
    def __init__(
        self,
        cfg: TracingConfig,
        worker_id: str,
        model: str,
        engine: str,
        exporter: SpanSink | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        resource = {"weir.worker": worker_id, "weir.engine": engine}
        self.exporter: SpanSink = exporter or SpanExporter(cfg, cfg.worker_service, resource)
        self.worker_id = worker_id
        self.model = model
        self.wall = WallClock()
        self.live: dict[str, _Traced] = {}  # engine request id -> its record
        # spans are built after the loop turn's Outputs leave (call_soon runs in order); None: at once
        self.loop = loop

    def dispatched(self, engine_id: str, req: GenerateRequest) -> None:
        """A request handed to the engine; a sampled one is traced, and its
        context becomes the worker span's (what vLLM's span hangs under)."""
        ctx = req.trace_context
        if ctx is None or not ctx.sampled:
            return
        if len(self.live) >= MAX_LIVE:
            del self.live[next(iter(self.live))]
        span = new_span_id()
        self.live[engine_id] = _Traced(ctx, span, time.monotonic(), req.prompt_tokens, req.params.max_tokens)
        req.trace_context = TraceContext(ctx.trace_id, span, True, ctx.state)

    def delta(self, engine_id: str, d: Delta) -> None:
        """A Delta of ``engine_id`` leaves the engine (called only while ``live`` holds any)."""
        t = self.live.get(engine_id)
        if t is None:
            return
        if d.num_tokens and not t.first_token:
            t.first_token = time.monotonic()
        if d.finish_reason is not None or d.error is not None:
            del self.live[engine_id]
            if self.loop is not None:
                self.loop.call_soon(self._ended, t, d, time.monotonic())
            else:
                self._ended(t, d, time.monotonic())

    def forget(self, engine_ids: list[str]) -> None:
        """Requests that ended here with no Delta (lost with the engine, or their router gone)."""
        for rid in engine_ids:
            self.live.pop(rid, None)

    def _ended(self, t: _Traced, d: Delta, now: float) -> None:
        ns, ctx = self.wall.ns, t.ctx
        tid, state = ctx.trace_id, ctx.state
        prompt = d.prompt_tokens or t.prompt_tokens
        attrs: dict[str, Any] = {
            "weir.worker": self.worker_id,
            "gen_ai.request.model": self.model,
            "gen_ai.usage.input_tokens": prompt,
            "gen_ai.usage.output_tokens": d.completion_tokens,
            "weir.prefix.cached_tokens": d.cached_tokens,
        }
        if t.max_tokens:
            attrs["gen_ai.request.max_tokens"] = t.max_tokens
        err = ""
        if d.error is not None:
            attrs["error.type"] = d.error.code or "error"
            err = d.error.message[:256]
        elif d.finish_reason is not None:
            attrs["gen_ai.response.finish_reasons"] = d.finish_reason
        first = t.first_token or now
        received = ns(t.received)
        spans = [
            Span(tid, t.span, ctx.span_id, "weir.worker.request", SERVER, received, ns(now), attrs, (), err, state),
            Span(
                tid,
                new_span_id(),
                t.span,
                "weir.worker.prefill",
                INTERNAL,
                received,
                ns(first),
                {"gen_ai.usage.input_tokens": prompt, "weir.prefix.cached_tokens": d.cached_tokens},
                (),
                "",
                state,
            ),
        ]
        if t.first_token:
            spans.append(
                Span(
                    tid,
                    new_span_id(),
                    t.span,
                    "weir.worker.decode",
                    INTERNAL,
                    ns(first),
                    ns(now),
                    {"gen_ai.usage.output_tokens": d.completion_tokens},
                    (),
                    "",
                    state,
                )
            )
        self.exporter.add(spans)

    def close(self) -> None:
        close = getattr(self.exporter, "close", None)
        if close is not None:
            close()
