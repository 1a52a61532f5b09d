"""A batch line in flight: its jobs submitted together, one result.

A line stands for the jobs its live request would run (router.services.batch.validate
``LineJobs``): a chat or one-prompt completion line is one job, whose sink is
the line itself (``LineSink``); a completions line with a prompt list is one
job per prompt, merged by router.lifecycle.fanout exactly as the live ingress
merges them, into a ``LineSink`` too; an embeddings line is one job per
input, its vectors gathered here (``EmbeddingLine``) into the live endpoint's
body.  Each reports its end to its ``LineOwner`` (the run's feeder), declared
here so that a line needs nothing of the run but those two calls.

Every job of a line is admitted, budgeted and placed on its own, and the
feeder counts jobs against its window.  The line ends once: a result when its
last job does, or an error entry (or a retry of the whole line) when any job
fails -- the others are cancelled then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from router import api
from router.lifecycle.models import ServedModel
from router.lifecycle.ports import RequestSink
from router.tenancy.budgets import Group
from router.tenancy.identity import Identity
from shared import protocol as p
from shared.errors import Code, error

if TYPE_CHECKING:
    from router.lifecycle.core import RouterCore


class LineOwner(Protocol):
    """Where a line reports how it ended (router.services.batch.feeder.LineFeeder): once, muted after."""

    def line_ok(self, sink: InFlightLine, body: bytes) -> None:
        """The line's response ``body`` (200)."""

    def line_refused(self, sink: InFlightLine, err: p.ErrorInfo) -> None:
        """A job of the line was refused or failed: the others are cancelled."""


class AsOwner:
    """The core as router.lifecycle.fanout's ``Submitter``: every job as the batch's owner, in its class."""

    __slots__ = ("core", "who")

    def __init__(self, core: RouterCore, who: Identity) -> None:
        self.core = core
        self.who = who

    def submit(self, sub: p.Submit, sink: RequestSink, *, group: Group | None = None) -> int | p.ErrorInfo:
        return self.core.submit(sub, sink, self.who, group)

    def cancel(self, handle: int) -> None:
        self.core.cancel(handle)

    def served_model(self, model: str) -> ServedModel | None:
        return self.core.served_model(model)


class LineSink:
    """One chat or completions line in flight: the RequestSink its job reports to
    (a non-streamed body); for a prompt list, the sink of the merge of its jobs."""

    __slots__ = ("run", "line", "raw", "custom_id", "ctx", "counts", "texts", "handles", "muted", "preempted")

    def __init__(self, run: LineOwner, line: int, raw: bytes, custom_id: str, ctx: api.ResponseContext) -> None:
        self.run = run
        self.line = line
        self.raw = raw  # the input line, for a retry (in flight only: bounded by the window)
        self.custom_id = custom_id
        self.ctx = ctx
        self.counts: api.Accumulator | api.TokenCounts = api.Accumulator(ctx) if ctx.rich else api.TokenCounts()
        self.texts: list[str] = []
        self.handles: list[int] = []
        self.muted = False  # cancelled by the batch (expiry, cancel, lease lost): news is ignored
        self.preempted = False  # stepped aside for interactive work once already

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        if self.muted or not deltas:
            return
        if deltas[0].model and deltas[0].model != self.ctx.model:  # a fallback model answers
            self.ctx.model = deltas[0].model
        counts = self.counts
        if isinstance(counts, api.Accumulator):
            counts.add(deltas)
        else:
            for d in deltas:
                counts.add(d)
                if d.text:
                    self.texts.append(d.text)
        last = deltas[-1]
        if last.error is not None:
            self.muted = True
            self.run.line_refused(self, api.echo_param(self.ctx, last.error))
        elif last.finish_reason is not None:
            self.muted = True
            if isinstance(counts, api.Accumulator):
                body = counts.render()
            else:
                body = api.render_completion(
                    self.ctx,
                    "".join(self.texts),
                    last.finish_reason,
                    counts.prompt,
                    counts.completion_total,
                    counts.cached,
                )
            self.run.line_ok(self, body)


class EmbeddingLine:
    """An embeddings line in flight: one job per input, one response body."""

    __slots__ = (
        "run",
        "line",
        "raw",
        "custom_id",
        "ctx",
        "handles",
        "muted",
        "preempted",
        "vectors",
        "left",
        "prompt_tokens",
    )

    def __init__(self, run: LineOwner, line: int, raw: bytes, custom_id: str, ctx: api.EmbeddingContext) -> None:
        self.run = run
        self.line = line
        self.raw = raw
        self.custom_id = custom_id
        self.ctx = ctx
        self.handles: list[int] = []
        self.muted = False
        # an embedding is one prefill step: taking it off its worker would free nothing
        # sooner (router.services.batch.service.preempt leaves lines marked preempted alone)
        self.preempted = True
        self.vectors: list[bytes] = [b""] * ctx.count
        self.left = ctx.count
        self.prompt_tokens = 0

    def submit(self, who: AsOwner, subs: list[p.Submit]) -> p.ErrorInfo | None:
        """Every input's job, their request units taken whole (router.tenancy.budgets.Group);
        the first refusal cancels those before it."""
        group = Group(len(subs)) if len(subs) > 1 else None
        failed = True
        try:
            for i, sub in enumerate(subs):
                got = who.submit(sub, _Input(self, i), group=group)
                if isinstance(got, p.ErrorInfo):
                    for h in self.handles:
                        who.cancel(h)
                    self.handles.clear()
                    return got
                self.handles.append(got)
            failed = False
        finally:
            if group is not None:
                group.close(failed)
        return None

    def on_input(self, index: int, deltas: list[p.Delta]) -> None:
        if self.muted or not deltas:
            return
        last = deltas[-1]
        if last.error is not None:
            self.muted = True
            return self.run.line_refused(self, last.error)
        if last.finish_reason is None:
            return  # (an embedding has one Delta)
        if not last.embedding:
            self.muted = True
            why = f"The engine ended an embedding without a vector ({last.finish_reason})."
            return self.run.line_refused(self, error(Code.ENGINE_ERROR, why))
        self.vectors[index] = last.embedding
        self.prompt_tokens += last.prompt_tokens
        self.left -= 1
        if self.left == 0:
            self.muted = True
            body = api.encode(api.render_embeddings(self.ctx, self.vectors, self.prompt_tokens))
            self.vectors = []
            self.run.line_ok(self, body)


class _Input:
    """The sink of one input's job."""

    __slots__ = ("line", "index")

    def __init__(self, line: EmbeddingLine, index: int) -> None:
        self.line = line
        self.index = index

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        self.line.on_input(self.index, deltas)


InFlightLine = LineSink | EmbeddingLine  # a line whose jobs are in the core
