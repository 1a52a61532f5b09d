"""The whole intake of one request: submit -> TOKENIZING -> [AWAITING_BUDGET] -> QUEUED.

``submit`` (``RouterCore.submit`` delegates here) refuses a draining
router's, an unknown key's and a malformed request's, or one for a model not
served, before anything is started; otherwise it puts the job in the job
table and tokenizes its prompt (inline, or on the tokenizing thread if long:
``tokenized``).  ``admit`` resolves ``max_tokens``, reserves the budget (a
store that answers later resumes at ``_reserved``), and queues the job in the
policy; a refusal for want of workers or room tries the request's fallback
models (``fall_back``, also on a refusal while queued) and otherwise gives
the budget reservation back in full.  A refusal while ``submit`` runs is its
return value (``_refused_at_submit``: the sink hears nothing); every end
after it goes through the core's one exit (``CoreParts.end``).  The state
changes go through router.lifecycle.jobs.advance.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import cast

import msgspec

from router.api.aliases import AliasTable
from router.api.checks import check_shape, resolve_max_tokens
from router.lifecycle.drain import draining_error
from router.lifecycle.jobs import AWAITING_BUDGET, ENDED, QUEUED, JobMetrics, JobRecord, advance, job_id_of
from router.lifecycle.models import HashedPrompt, tokenize_hashed
from router.lifecycle.parts import CoreParts
from router.lifecycle.ports import RequestSink
from router.lifecycle.tokenizer_queue import PROMPT, SHORT, TokenizerQueue
from router.observe.tracing import RouterTracer
from router.policy import Job
from router.policy.job_routing import with_routing
from router.tenancy.buckets import BudgetAnswer, Hold
from router.tenancy.budgets import Group
from router.tenancy.identity import Identity, Keys
from shared import protocol as p
from shared.config import ModelConfig
from shared.errors import Code, error, label

log = logging.getLogger("weir.router")

_DEFAULT_PARAMS = p.SamplingParams()
# Refusals for want of workers or room, which a fallback model may answer instead.
FALLBACK_ON = frozenset((Code.NO_WORKER, Code.QUEUE_FULL, Code.QUEUE_WAIT_EXCEEDED, Code.QUEUE_DEADLINE))


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
        lora_id=j.lora.lora_id if j.lora is not None else 0,
    )
    return job if sub.routing is None else with_routing(job, sub.routing)


class Intake:
    """The intake, for the core: its parts (``CoreParts``), the API keys in
    use (replaced on a reload) and the tokenizing thread."""

    def __init__(self, parts: CoreParts, keys: Keys, aliases: AliasTable, tokenizer: TokenizerQueue) -> None:
        self.parts = parts
        self.jobs = parts.jobs  # (read on every request)
        self.keys = keys
        self.aliases = aliases  # [[aliases]]: reloaded with the keys (RouterCore.reload_keys)
        self.tokenizer = tokenizer
        self.draining = False  # router.lifecycle.drain: every new request is refused (503 router_draining)
        self._next_handle = 1
        self._job_metrics: dict[tuple[str, str], JobMetrics] = {}
        self.tracer: RouterTracer | None = None  # [tracing] on: set by RouterCore (router.observe.tracing)

    def submit(
        self, sub: p.Submit, sink: RequestSink, who: Identity | p.ErrorInfo | None, group: Group | None
    ) -> int | p.ErrorInfo:
        """The job's handle, or the refusal (the sink hears nothing of it): router.lifecycle.core.RouterCore.submit."""
        if self.draining:  # before anything is started: safe for Envoy (or a client) to retry elsewhere
            return self._rejected(draining_error(), self.keys.default_tier)
        parts = self.parts
        now = parts.clock()
        if who is None:
            who = self.keys.identify(sub)
        if not isinstance(who, Identity):
            return self._rejected(who, self.keys.default_tier)
        err = check_shape(sub)
        chain = None
        if sub.model in self.aliases:  # a public name over served models: the one drawn, then its fallbacks
            routing = sub.routing
            key = (routing.session if routing is not None else "") or sub.trace_id or sub.request_id
            chain = self.aliases.resolve(sub.model, key, parts.registry.serves)
            if not chain:
                why = f"No model behind the alias `{sub.model}` is served now; try again shortly."
                return self._rejected(error(Code.NO_WORKER, why, param="model", retry_after=1.0), who.klass)
            sub = msgspec.structs.replace(sub, model=chain[0], allow_fallback=True)
        adapter = parts.registry.adapters.get(sub.model)
        if adapter is not None and who.adapters is not None and adapter.name not in who.adapters:
            # not this key's or tenant's: as if it did not exist (nothing told about others' adapters)
            return self._rejected(
                error(Code.MODEL_NOT_FOUND, f"The model `{sub.model}` does not exist.", param="model"), who.klass
            )
        if adapter is not None:  # runs as its base model's job, the adapter applied on the worker
            sub = msgspec.structs.replace(sub, model=adapter.base, allow_fallback=False)
        model = parts.registry.get(sub.model)
        if model is None:
            if err is None:
                err = error(Code.MODEL_NOT_FOUND, f"The model `{sub.model}` does not exist.", param="model")
            return self._rejected(err, who.klass)
        if err is None:
            err = task_mismatch(sub, model.config)
            if err is None and model.unloading:
                err = unloading_error(sub.model, parts.cfg.heartbeat_interval_s)
        if err is None and group is not None and parts.quota.active:
            # a fan-out's job: its first one reserves the request's units, all or none
            err = parts.quota.open_group(who, group) if group.quota is None else group.refusal
        else:
            group = None
        if err is not None:
            return self._rejected(err, who.klass)
        if sub.user:
            parts.metrics.saw_user(who.tenant, sub.user)
        handle = self._next_handle
        self._next_handle += 1
        j = JobRecord(job_id_of(handle), sub, sink, who, now, group=group)
        if adapter is not None:
            j.lora = adapter.ref
        if chain is not None:  # the client learns the model that serves it (as a fallback's)
            j.served_by, j.fallbacks = chain[0], chain[1:]
        if group is not None:
            group.joined()
        self.jobs[j.job_id] = j  # its one entry into the table: TOKENIZING, cancellable like any job
        if self.tracer is not None:
            j.otel = self.tracer.start(sub.trace_context)
        # (hashed even without affinity: the simulated engine names its cached blocks by them)
        hasher = parts.policy.prefix.hasher(sub.model)
        if model.prompts.inline(sub):
            try:
                tokens = tokenize_hashed(model.prompts, sub, hasher, j.lora)
            except Exception as e:
                err = self._tokenizing_failed(j, e)
            else:
                j.tokenized_at = parts.clock()
                err = self.admit(j, tokens, now)
            return handle if err is None else self._refused_at_submit(j, err)
        alive = functools.partial(self._live, j.job_id)  # (a job cancelled meanwhile is not tokenized)
        kind = SHORT if model.prompts.short(sub) else PROMPT  # (short ones never wait for long ones)
        fut = self.tokenizer.run(kind, who.tenant, tokenize_hashed, model.prompts, sub, hasher, j.lora, alive=alive)
        assert fut is not None  # (prompts are never refused there)
        fut.add_done_callback(functools.partial(self.tokenized, j.job_id))
        return handle

    def _live(self, job_id: str) -> bool:
        return job_id in self.jobs

    def tokenized(self, job_id: str, fut: asyncio.Future[HashedPrompt]) -> None:
        """The tokenizing thread's answer for a long prompt."""
        j = self.jobs.get(job_id)
        if j is None or fut.cancelled():
            return  # cancelled while tokenizing
        err: p.ErrorInfo | None
        try:
            tokens = fut.result()
        except Exception as e:
            err = self._tokenizing_failed(j, e)
        else:
            j.tokenized_at = now = self.parts.clock()
            err = self.admit(j, tokens, now)
        if err is not None:
            self.parts.end(j, label(err), error=err)

    @staticmethod
    def _tokenizing_failed(j: JobRecord, e: Exception) -> p.ErrorInfo:
        """The refusal for a prompt that could not be tokenized, inline or on the thread."""
        if isinstance(e, ValueError):  # router.lifecycle.prompts.BadInput names the field
            return error(Code.BAD_REQUEST, str(e), param=getattr(e, "param", None))
        # a defect: the job must still leave the table
        log.error("tokenizing request %s (job %s) failed", j.trace, j.job_id, exc_info=e, extra={"request_id": j.trace})
        return error(Code.INTERNAL, "Tokenizing the prompt failed.")

    def _rejected(self, err: p.ErrorInfo, klass: str) -> p.ErrorInfo:
        metrics = self.parts.metrics
        metrics.child(metrics.rejected, klass, "-", label(err)).inc()
        return err

    def _refused_at_submit(self, j: JobRecord, err: p.ErrorInfo) -> p.ErrorInfo:
        """Refused before ``submit`` returned: the error is its answer, the sink hears nothing."""
        advance(j, ENDED)
        del self.jobs[j.job_id]
        if j.group is not None:
            j.group.left(queued=False)
        return self._rejected(err, j.who.klass)

    def admit(self, j: JobRecord, tokens: HashedPrompt, now: float) -> p.ErrorInfo | None:
        """Price the prompt, queue the job in the policy; an error if refused."""
        sub = j.sub
        parts = self.parts
        max_tokens = resolve_max_tokens(sub, tokens.count, parts.registry.of(sub.model).config.max_model_len)
        if not isinstance(max_tokens, int):
            return max_tokens
        quota = parts.quota
        if quota.active:
            # usage sums the completion tokens of all n choices: reserve for all of them
            n = sub.params.n if sub.params is not None else 1

            def answered(got: BudgetAnswer) -> None:
                self._reserved(j, got, tokens, max_tokens)

            if j.group is not None and j.group.refusal is not None:
                return j.group.refusal  # its request was refused whole meanwhile
            advance(j, AWAITING_BUDGET)  # (before asking: a store may answer at once, either way)
            # a fan-out's job: its request units are its group's (router.tenancy.budgets.Group)
            got = quota.reserve(j.who, tokens.count + max_tokens * n, answered, 0 if j.group else 1)
            if got is None:  # the budget store answers later: _reserved
                return None
            if not isinstance(got, Hold):
                return got
            j.hold, j.rl = got, got.ratelimit
        return self._enqueue(j, tokens, max_tokens, now)

    def _reserved(self, j: JobRecord, got: BudgetAnswer, tokens: HashedPrompt, max_tokens: int) -> None:
        """The budget store's answer for a job that waited for it."""
        if j.state is ENDED:  # cancelled meanwhile: give it back at once
            if isinstance(got, Hold):
                self.parts.quota.release(got, 0, refund_request=True)
            return
        if not isinstance(got, Hold):
            return self.parts.end(j, label(got), error=got)
        group = j.group
        if group is not None and group.refusal is not None:  # its request was refused whole meanwhile
            self.parts.quota.release(got, 0, refund_request=True)
            return self.parts.end(j, label(group.refusal), error=group.refusal)
        j.hold, j.rl = got, got.ratelimit
        err = self._enqueue(j, tokens, max_tokens, self.parts.clock())
        if err is not None:
            self.parts.end(j, label(err), error=err)

    def _enqueue(self, j: JobRecord, tokens: HashedPrompt, max_tokens: int, now: float) -> p.ErrorInfo | None:
        sub = j.sub
        job = policy_job(j, sub.model, tokens.count, max_tokens, j.arrival, tokens.hashes)
        refusal = self.parts.policy.submit(job, now)
        if refusal is not None:
            if sub.allow_fallback and refusal.kind in FALLBACK_ON:
                if self.fall_back(j, now):
                    return None  # (its budget reservation stands: the job goes on)
            if j.hold is not None:  # never queued: everything goes back
                self.parts.quota.release(j.hold, 0, refund_request=True)
                j.hold = None
            return refusal.render() if j.rl is None else msgspec.structs.replace(refusal.render(), ratelimit=j.rl)
        self._queued(j, sub.model, tokens, max_tokens, j.arrival)
        return None

    def _queued(self, j: JobRecord, model: str, tokens: HashedPrompt, max_tokens: int, since: float) -> None:
        """The policy queued ``j`` for ``model``: what its worker gets, and the record's attempt."""
        # The client's message is left as it came; the worker gets the resolution.
        params = msgspec.structs.replace(j.sub.params or _DEFAULT_PARAMS, max_tokens=max_tokens)
        # (a long prompt's ids come encoded from the tokenizer thread: msgpack writes them as they are)
        ids = tokens.ids if tokens.wire is None else cast("list[int]", tokens.wire)
        j.request = p.GenerateRequest(j.job_id, ids, tokens.count, params, trace_id=j.trace, lora=j.lora)
        if j.sub.kind == p.RequestKind.EMBEDDING:  # prefill only (max_tokens 0); the vector comes back
            j.request.embed, j.request.dimensions = True, j.sub.dimensions or 0
        if tokens.hashes and not tokens.ids:  # the simulated engine names its cached blocks by them
            j.request.block_hashes = list(tokens.hashes)
        j.prompt_ids, j.prompt_tokens, j.max_tokens = tokens.ids, tokens.count, max_tokens
        j.queued_since, j.attempt_prompt_tokens, j.block_hashes = since, tokens.count, tokens.hashes
        j.mx = self._metrics_for(model, j.who.klass)
        if j.otel is not None:  # a traced job: when it was queued, and the wait admission predicted
            entry = self.parts.policy.entries.get(j.job_id)
            j.otel.queued_at, j.otel.predicted = self.parts.clock(), entry.predicted if entry is not None else -1.0
        advance(j, QUEUED)
        self.parts.schedule()

    def _metrics_for(self, model: str, klass: str) -> JobMetrics:
        mx = self._job_metrics.get((model, klass))
        if mx is None:
            mx = self._job_metrics[(model, klass)] = JobMetrics(self.parts.metrics, model, klass)
        return mx

    def fall_back(self, j: JobRecord, now: float) -> bool:
        """Queue ``j`` for the first of its model's fallbacks that takes it."""
        registry, policy = self.parts.registry, self.parts.policy
        asked = registry.get(j.sub.model)
        if asked is None:  # removed at run time while a fallback served the job
            return False
        for name in asked.config.fallbacks if j.fallbacks is None else j.fallbacks:  # (never the model itself: config)
            model = registry.get(name)
            if name == j.served_by or model is None or model.unloading:
                continue  # the one that just refused it; one being (or already) removed at run time
            try:
                # (a rare path: inline whatever its length)
                tokens = tokenize_hashed(model.prompts, j.sub, policy.prefix.hasher(name))
            except ValueError:
                continue
            max_tokens = resolve_max_tokens(j.sub, tokens.count, model.config.max_model_len)
            if not isinstance(max_tokens, int):
                continue
            if policy.submit(policy_job(j, name, tokens.count, max_tokens, now, tokens.hashes), now) is not None:
                continue
            j.served_by = name
            self._queued(j, name, tokens, max_tokens, now)
            metrics = self.parts.metrics
            metrics.child(metrics.fallbacks, j.sub.model, name).inc()
            return True
        return False
