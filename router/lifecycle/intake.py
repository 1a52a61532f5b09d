"""The admission flow of one job: TOKENIZING -> [AWAITING_BUDGET] -> QUEUED.

``RouterCore.submit`` puts a job in the job table and hands it here with its
prompt's tokens (tokenized inline, or on the tokenizing thread: ``tokenized``).
``admit`` resolves ``max_tokens``, reserves the budget (a store that answers
later resumes at ``_reserved``), and queues the job in the policy; a refusal
for want of workers or room tries the request's fallback models
(``fall_back``, also on a refusal while queued) and otherwise gives the
budget reservation back in full.  Every end goes through the core's one exit
(``end``); the state changes go through router.lifecycle.jobs.advance.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from router.api.checks import resolve_max_tokens
from router.lifecycle.jobs import AWAITING_BUDGET, ENDED, QUEUED, JobMetrics, JobRecord, advance
from router.lifecycle.models import ModelRegistry, PromptTokens, tokenize_hashed
from router.observe.metrics import RouterMetrics
from router.policy import Job, Policy
from router.policy.job_routing import with_routing
from router.tenancy.budgets import Answer, Hold, Quota
from shared import protocol as p
from shared.config import ModelConfig
from shared.errors import Code, error, label

log = logging.getLogger("weir.router")

_DEFAULT_PARAMS = p.SamplingParams()
# Refusals for want of workers or room, which a fallback model may answer instead.
FALLBACK_ON = frozenset((Code.NO_WORKER, Code.QUEUE_FULL, Code.QUEUE_WAIT_EXCEEDED, Code.QUEUE_DEADLINE))


class EndJob(Protocol):
    """The core's one exit (router.lifecycle.core.RouterCore._end)."""

    def __call__(
        self,
        j: JobRecord,
        outcome: str,
        *,
        error: p.ErrorInfo | None = None,
        deltas: list[p.Delta] | None = None,
        abort_worker: str | None = None,
    ) -> None: ...


def unloading_error(name: str, retry_after: float) -> p.ErrorInfo:
    """The refusal for a model being removed at run time (router.lifecycle.core.RouterCore.remove_model)."""
    return error(
        Code.MODEL_UNLOADING,
        f"The model `{name}` is being removed; it takes no new requests.",
        param="model",
        retry_after=retry_after,
    )


def task_mismatch(sub: p.Submit, model: ModelConfig) -> p.ErrorInfo | None:
    """An embedding request for a generation model, or the reverse: refused before anything is reserved."""
    embedding = sub.kind == p.RequestKind.EMBEDDING
    if embedding == (model.task == "embed"):
        return None
    if embedding:
        why = f"The model `{model.name}` is a generation model; it does not serve embeddings."
    else:
        why = f"The model `{model.name}` is an embedding model; it serves /v1/embeddings only."
    return error(Code.BAD_REQUEST, why, param="model")


def policy_job(
    j: JobRecord, model: str, prompt_tokens: int, max_tokens: int, arrival: float, hashes: Sequence[int]
) -> Job:
    """A fresh value of what the policy is told of an attempt (it keeps its own copy)."""
    sub, who = j.sub, j.who
    job = Job(
        j.job_id,
        model,
        who.tenant,
        who.klass,
        prompt_tokens,
        max_tokens,
        sub.task_type,
        arrival,
        who.weight,
        sub.params.n if sub.params is not None else 1,
        hashes,
    )
    return job if sub.routing is None else with_routing(job, sub.routing)


class Intake:
    """Admission after submit, for the core: its job table, registry, policy,
    budgets and metrics, its one exit (``end``) and its policy pass (``schedule``)."""

    def __init__(
        self,
        jobs: dict[str, JobRecord],
        registry: ModelRegistry,
        policy: Policy,
        quota: Quota,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        end: EndJob,
        schedule: Callable[[], None],
    ) -> None:
        self.jobs = jobs
        self.registry = registry
        self.policy = policy
        self.quota = quota
        self.metrics = metrics
        self.clock = clock
        self._end = end
        self._schedule = schedule
        self._job_metrics: dict[tuple[str, str], JobMetrics] = {}

    def tokenized(self, job_id: str, fut: asyncio.Future[PromptTokens]) -> None:
        """The tokenizing thread's answer for a long prompt."""
        j = self.jobs.get(job_id)
        if j is None or fut.cancelled():
            return  # cancelled while tokenizing
        try:
            tokens = fut.result()
        except ValueError as e:
            return self._end(j, "bad_request", error=error(Code.BAD_REQUEST, str(e), param=getattr(e, "param", None)))
        except Exception:
            log.exception("tokenizing request %s (job %s) failed", j.trace, job_id, extra={"request_id": j.trace})
            return self._end(j, "internal", error=error(Code.INTERNAL, "Tokenizing the prompt failed."))
        err = self.admit(j, tokens, self.clock())
        if err is not None:
            self._end(j, label(err), error=err)

    def admit(self, j: JobRecord, tokens: PromptTokens, now: float) -> p.ErrorInfo | None:
        """Price the prompt, queue the job in the policy; an error if refused."""
        sub = j.sub
        max_tokens = resolve_max_tokens(sub, tokens.count, self.registry.of(sub.model).config.max_model_len)
        if not isinstance(max_tokens, int):
            return max_tokens
        if self.quota.active:
            # usage sums the completion tokens of all n choices: reserve for all of them
            n = sub.params.n if sub.params is not None else 1

            def answered(got: Answer) -> None:
                self._reserved(j, got, tokens, max_tokens)

            if j.group is not None and j.group.refusal is not None:
                return j.group.refusal  # its request was refused whole meanwhile
            advance(j, AWAITING_BUDGET)  # (before asking: a store may answer at once, either way)
            # a fan-out's job: its request units are its group's (router.tenancy.budgets.Group)
            got = self.quota.reserve(j.who, tokens.count + max_tokens * n, answered, 0 if j.group else 1)
            if got is None:  # the budget store answers later: _reserved
                return None
            if not isinstance(got, Hold):
                return got
            j.hold, j.rl = got, got.ratelimit
        return self._enqueue(j, tokens, max_tokens, now)

    def _reserved(self, j: JobRecord, got: Answer, tokens: PromptTokens, max_tokens: int) -> None:
        """The budget store's answer for a job that waited for it."""
        if j.state is ENDED:  # cancelled meanwhile: give it back at once
            if isinstance(got, Hold):
                self.quota.release(got, 0, refund_request=True)
            return
        if not isinstance(got, Hold):
            return self._end(j, label(got), error=got)
        group = j.group
        if group is not None and group.refusal is not None:  # its request was refused whole meanwhile
            self.quota.release(got, 0, refund_request=True)
            return self._end(j, label(group.refusal), error=group.refusal)
        j.hold, j.rl = got, got.ratelimit
        err = self._enqueue(j, tokens, max_tokens, self.clock())
        if err is not None:
            self._end(j, label(err), error=err)

    def _enqueue(self, j: JobRecord, tokens: PromptTokens, max_tokens: int, now: float) -> p.ErrorInfo | None:
        sub = j.sub
        job = policy_job(j, sub.model, tokens.count, max_tokens, j.arrival, tokens.hashes)
        refusal = self.policy.submit(job, now)
        if refusal is not None:
            if sub.allow_fallback and refusal.kind in FALLBACK_ON:
                if self.fall_back(j, now):
                    return None  # (its budget reservation stands: the job goes on)
            if j.hold is not None:  # never queued: everything goes back
                self.quota.release(j.hold, 0, refund_request=True)
                j.hold = None
            return refusal.render() if j.rl is None else msgspec.structs.replace(refusal.render(), ratelimit=j.rl)
        self._queued(j, sub.model, tokens, max_tokens, j.arrival)
        return None

    def _queued(self, j: JobRecord, model: str, tokens: PromptTokens, max_tokens: int, since: float) -> None:
        """The policy queued ``j`` for ``model``: what its worker gets, and the record's attempt."""
        # The client's message is left as it came; the worker gets the resolution.
        params = msgspec.structs.replace(j.sub.params or _DEFAULT_PARAMS, max_tokens=max_tokens)
        j.request = p.GenerateRequest(j.job_id, tokens.ids, tokens.count, params, trace_id=j.trace)
        if j.sub.kind == p.RequestKind.EMBEDDING:  # prefill only (max_tokens 0); the vector comes back
            j.request.embed, j.request.dimensions = True, j.sub.dimensions or 0
        if tokens.hashes and not tokens.ids:  # the simulated engine names its cached blocks by them
            j.request.block_hashes = list(tokens.hashes)
        j.prompt_ids, j.prompt_tokens, j.max_tokens = tokens.ids, tokens.count, max_tokens
        j.queued_since, j.attempt_prompt_tokens, j.block_hashes = since, tokens.count, tokens.hashes
        j.mx = self._metrics_for(model, j.who.klass)
        advance(j, QUEUED)
        self._schedule()

    def _metrics_for(self, model: str, klass: str) -> JobMetrics:
        mx = self._job_metrics.get((model, klass))
        if mx is None:
            mx = self._job_metrics[(model, klass)] = JobMetrics(self.metrics, model, klass)
        return mx

    def fall_back(self, j: JobRecord, now: float) -> bool:
        """Queue ``j`` for the first of its model's fallbacks that takes it."""
        registry = self.registry
        asked = registry.get(j.sub.model)
        if asked is None:  # removed at run time while a fallback served the job
            return False
        for name in asked.config.fallbacks if j.fallbacks is None else j.fallbacks:  # (never the model itself: config)
            model = registry.get(name)
            if name == j.served_by or model is None or model.unloading:
                continue  # the one that just refused it; one being (or already) removed at run time
            try:
                # (a rare path: inline whatever its length)
                tokens = tokenize_hashed(model.prompts, j.sub, self.policy.prefix.hasher(name))
            except ValueError:
                continue
            max_tokens = resolve_max_tokens(j.sub, tokens.count, model.config.max_model_len)
            if not isinstance(max_tokens, int):
                continue
            if self.policy.submit(policy_job(j, name, tokens.count, max_tokens, now, tokens.hashes), now) is not None:
                continue
            j.served_by = name
            self._queued(j, name, tokens, max_tokens, now)
            self.metrics.child(self.metrics.fallbacks, j.sub.model, name).inc()
            return True
        return False
