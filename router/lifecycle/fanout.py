"""A completion with several prompts: one job per prompt, one response.

Each prompt is submitted to the core as its own request -- reserved,
budgeted, scheduled and resumed like any other -- and this module merges
their Deltas into the stream one response is rendered from: prompt ``i``'s
choice ``j`` becomes choice ``i * n + j`` (vLLM's numbering), usage is
summed over the prompts, and the merged stream ends (``finish_reason``)
when the last prompt does.  Until then a prompt's end is told per choice
(``choice_finish``), so the renderers (router.api) need nothing new.

Budgets: the request's k request units are one reservation
(router.tenancy.budgets.Group), taken whole before any prompt's tokens, refused
whole (400 when k is over a ``requests_per_minute`` budget) and given back
whole when any prompt is refused.

Failure: a prompt refused at submit refuses the request (the prompts
already admitted are cancelled, their reservations released); one that
fails later ends the response with its error and cancels the others; the
client leaving cancels them all (``cancel``).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from router.api import CompletionJobs
from router.lifecycle.models import ServedModel
from router.lifecycle.ports import RequestSink
from router.tenancy.budgets import Group
from shared.protocol import Delta, ErrorInfo, Submit


class Submitter(Protocol):
    """What fanning out needs of the core (router.lifecycle.core.RouterCore)."""

    def submit(self, sub: Submit, sink: RequestSink, *, group: Group | None = None) -> int | ErrorInfo: ...

    def cancel(self, handle: int) -> None: ...

    def served_model(self, model: str) -> ServedModel | None: ...


def echo_texts(core: Submitter, jobs: CompletionJobs) -> list[str]:
    """Each prompt's text for ``echo``; token ids decoded as vLLM decodes them
    (on the loop: ~1 us a token, and echo of token ids is rare)."""
    if not jobs.echoes:
        return []
    if all(e is not None for e in jobs.echoes):
        return [e or "" for e in jobs.echoes]
    served = core.served_model(jobs.subs[0].model)
    prompts = served.prompts if served is not None and served.prompts.exact else None
    return [
        e if e is not None else (prompts.decode(sub.prompt_token_ids) if prompts is not None else "")
        for e, sub in zip(jobs.echoes, jobs.subs, strict=True)
    ]


class PromptFanOut:
    """The jobs of one multi-prompt request and the merge of their Deltas."""

    __slots__ = ("core", "sink", "n", "echoes", "handles", "live", "closed", "prompt", "cached", "completion", "told")

    def __init__(self, core: Submitter, sink: RequestSink, n: int, prompts: int, echoes: list[str]) -> None:
        self.core = core
        self.sink = sink  # the response (router.ingress.exchange.Exchange)
        self.n = n  # choices per prompt
        self.echoes = echoes  # per prompt, prepended to each of its choices' text; [] without echo
        self.handles: list[int] = []
        self.live = prompts  # prompts not yet ended
        self.closed = False  # the response ended (or was refused): nothing more is forwarded
        self.prompt = [0] * prompts  # per prompt: the engine's prompt tokens, cached ones, completion tokens
        self.cached = [0] * prompts
        self.completion = [0] * prompts
        self.told = False  # a Delta was forwarded: only the first may name a fallback model

    def submit(self, subs: list[Submit]) -> ErrorInfo | None:
        """Submit every prompt's job, their request units taken whole
        (router.tenancy.budgets.Group); the first refusal cancels those before it."""
        group = Group(len(subs)) if len(subs) > 1 else None
        failed = True
        try:
            for i, sub in enumerate(subs):
                got = self.core.submit(sub, _PromptPart(self, i), group=group)
                if isinstance(got, ErrorInfo):
                    self.cancel()
                    return got
                self.handles.append(got)
            failed = False
        finally:
            if group is not None:
                group.close(failed)
        return None

    def cancel(self) -> None:
        """The response is over (client gone, refused, failed): end every job."""
        if self.closed:
            return
        self.closed = True
        for h in self.handles:
            self.core.cancel(h)  # (a job already ended: nothing to do)

    def forward(self, part: _PromptPart, deltas: list[Delta]) -> None:
        if self.closed:
            return
        i = part.prompt
        base = i * self.n
        echo = self.echoes[i] if self.echoes else ""
        out = []
        ended: Delta | None = None
        for d in deltas:
            if d.prompt_tokens:
                self.prompt[i], self.cached[i] = d.prompt_tokens, d.cached_tokens
            if d.completion_tokens > self.completion[i]:
                self.completion[i] = d.completion_tokens
            index = base + d.index
            text = d.text
            if echo and d.index not in part.echoed:
                part.echoed.add(d.index)
                text = echo + text
            choice_finish = d.choice_finish
            if choice_finish is not None:
                part.finished.add(d.index)
            if d.finish_reason is not None and d.error is None:
                ended = d
                if choice_finish is None:  # the request's last Delta speaks for its own choice
                    choice_finish = d.finish_reason
                    part.finished.add(d.index)
            out.append(
                msgspec.structs.replace(
                    d,
                    index=index,
                    text=text,
                    choice_finish=choice_finish,
                    finish_reason=None,
                    prompt_tokens=sum(self.prompt) if d.prompt_tokens else 0,
                    cached_tokens=sum(self.cached) if d.prompt_tokens else 0,
                    completion_tokens=sum(self.completion) if d.completion_tokens else 0,
                    model="" if self.told else d.model,
                )
            )
            self.told = True
            if d.error is not None:  # this prompt failed: so does the response
                self.sink.on_deltas(out)
                self.cancel()
                return
        if ended is not None:
            reason = ended.finish_reason
            for c in range(self.n):  # choices still open end with their prompt
                if c not in part.finished:
                    out.append(
                        Delta(
                            ended.request_id,
                            index=base + c,
                            choice_finish=reason,
                            text=echo if c not in part.echoed else "",
                        )
                    )
            self.live -= 1
            if self.live == 0:  # the request's last Delta
                out[-1] = msgspec.structs.replace(
                    out[-1],
                    finish_reason=reason,
                    prompt_tokens=sum(self.prompt),
                    cached_tokens=sum(self.cached),
                    completion_tokens=sum(self.completion),
                )
                self.closed = True
        if out:
            self.sink.on_deltas(out)


class _PromptPart:
    """One prompt's job's sink: hands its Deltas to the merge."""

    __slots__ = ("fan", "prompt", "echoed", "finished")

    def __init__(self, fan: PromptFanOut, prompt: int) -> None:
        self.fan = fan
        self.prompt = prompt
        self.echoed: set[int] = set()  # its choices (0..n-1) whose text has the echo
        self.finished: set[int] = set()  # its choices that ended

    def on_deltas(self, deltas: list[Delta]) -> None:
        self.fan.forward(self, deltas)
