"""A batch line of several jobs: submitted together, one result.

A line stands for the jobs its live request would run (router.services.batch.validate
``LineJobs``): a chat or one-prompt completion line is one job, whose sink is
the line itself (router.services.batch.feeder.LineSink); a completions line with a
prompt list is one job per prompt, merged by router.lifecycle.fanout exactly as
the live ingress merges them; an embeddings line is one job per input, its
vectors gathered here (``EmbeddingLine``) into the live endpoint's body.

Every job of a line is admitted, budgeted and placed on its own, and the
feeder counts jobs against its window.  The line ends once: a result when its
last job does, or an error entry (or a retry of the whole line) when any job
fails -- the others are cancelled then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router import api
from router.lifecycle.models import ServedModel
from router.lifecycle.ports import RequestSink
from router.tenancy.budgets import Group
from router.tenancy.identity import Identity
from shared import protocol as p
from shared.errors import Code, error

if TYPE_CHECKING:
    from router.lifecycle.core import RouterCore
    from router.services.batch.feeder import BatchRun


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

    def __init__(self, run: BatchRun, line: int, raw: bytes, custom_id: str, ctx: api.EmbeddingContext) -> None:
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
