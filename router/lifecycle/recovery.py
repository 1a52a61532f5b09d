"""Recovery: the jobs of a lost worker, and single jobs taken off theirs.

Losing a worker loses no request: one that produced nothing yet is queued
again; one that streamed output is *resumed* -- queued again as a
continuation whose prompt is the original prompt's token ids plus those
generated so far, with ``max_tokens`` reduced by as many and the same
sampling parameters -- and its Deltas are rewritten (cumulative counts,
the original prompt count) so the client sees one uninterrupted stream.

A lost worker's jobs, already released by the policy, are sorted here
(``after_loss``): nothing streamed yet, queued again as it was (``requeue``);
output streamed, resumed while ``router.max_resumes`` allows; else ended with
``worker_lost``.  A stalled job (``check_stalls``) and one a drain timed out
(``move``) are sorted the same way; one a worker's own ledger refused is
queued again (``requeue``).  Every end goes through the core's one exit (``end``).
"""

from __future__ import annotations

import logging

import msgspec

from router.lifecycle.intake import policy_job, unloading_error
from router.lifecycle.jobs import QUEUED, RUNNING, JobRecord, advance
from router.lifecycle.parts import CoreParts
from shared import protocol as p
from shared.errors import Code, error

log = logging.getLogger("weir.router")


class Recovery:
    """Moving jobs off workers, for the core: its parts (``CoreParts``)."""

    def __init__(self, parts: CoreParts) -> None:
        self.parts = parts
        self.jobs = parts.jobs
        self.cfg = parts.cfg

    def after_loss(self, job_ids: list[str], why: str, now: float) -> None:
        """Jobs of a lost worker, already released by the policy."""
        for job_id in job_ids:
            j = self.jobs.get(job_id)
            if j is None:
                continue
            if j.completion_tokens == 0:
                self.requeue(j, now)  # nothing streamed yet: nobody can tell it moved
            elif j.resumes < self.cfg.max_resumes:
                self._resume(j, why, now)
            else:
                self.parts.end(j, "worker_lost", error=self.lost_error(f"{why}, after {j.resumes} resumes"))

    def requeue(self, j: JobRecord, now: float) -> None:
        """Queue a job again whose worker went: it waits for a worker of its
        model (even while none is left) up to its queue deadline."""
        if not self.parts.registry.serves(j.model):  # unloading: no worker of it will come back
            return self.parts.end(
                j, Code.MODEL_UNLOADING.label, error=unloading_error(j.model, self.cfg.heartbeat_interval_s)
            )
        req = j.request
        assert req is not None  # it was queued before
        job = policy_job(j, j.model, j.attempt_prompt_tokens, req.params.max_tokens, j.queued_since, j.block_hashes)
        refusal = self.parts.policy.submit(job, now, requeue=True)
        if refusal is not None:
            self.parts.end(j, refusal.label, error=refusal.render())
        else:
            advance(j, QUEUED)
            self.parts.schedule()

    def _resume(self, j: JobRecord, why: str, now: float) -> None:
        """Continue a job that streamed output, from where it got, elsewhere."""
        n = j.completion_tokens
        remaining = j.max_tokens - n
        if remaining < 1:  # all of it was generated; only the last word was lost
            self.parts.end(
                j,
                "length",
                deltas=[p.Delta(j.job_id, finish_reason="length", prompt_tokens=j.prompt_tokens, completion_tokens=n)],
            )
            return
        req = j.request
        assert req is not None  # it ran
        sp = req.params
        if sp.n > 1 or sp.structured is not None or (j.prompt_ids and len(j.generated) != n):
            # Not continued: n choices interleave in one stream, a grammar's
            # state is not in the tokens, ids missing would not be exact.
            self.parts.end(j, "worker_lost", error=self.lost_error(why))
            return
        j.attempt_prompt_tokens = j.prompt_tokens + n
        j.queued_since = now  # its queue deadline counts from now
        ids = j.prompt_ids + j.generated if j.prompt_ids else []
        params = msgspec.structs.replace(sp, max_tokens=remaining, min_tokens=max(0, sp.min_tokens - n))
        j.request = p.GenerateRequest(
            j.job_id,
            ids,
            j.attempt_prompt_tokens,
            params,
            trace_id=j.trace,
            block_hashes=req.block_hashes,
            lora=req.lora,
        )
        j.done_before = n
        j.resumes += 1
        self.parts.metrics.child(self.parts.metrics.resumed, j.model, why).inc()
        log.info(
            "request %s (job %s) resumes after %d tokens (%s), attempt %d",
            j.trace,
            j.job_id,
            n,
            why,
            j.resumes + 1,
            extra={"request_id": j.trace},
        )
        self.requeue(j, now)

    def lost_error(self, why: str) -> p.ErrorInfo:
        return error(
            Code.WORKER_LOST,
            f"The worker serving this request was lost ({why}) and it could not be resumed.",
            retry_after=self.cfg.heartbeat_interval_s,
        )

    def check_stalls(self) -> list[str]:
        """The hang watchdog: a running job that heard nothing from its worker
        for ``stall_timeout_s`` is taken off it and resumed elsewhere.  (A
        worker silent as a whole is lost by its missed heartbeats first.)"""
        bound = self.cfg.stall_timeout_s
        now = self.parts.clock()
        stalled = [
            job_id
            for job_id, j in self.jobs.items()
            if j.state is RUNNING and j.last_news and now - j.last_news > bound
        ]
        for job_id in stalled:
            j = self.jobs[job_id]
            log.warning(
                "request %s (job %s): nothing from worker %s for %.1f s: moving it",
                j.trace,
                job_id,
                j.worker,
                now - j.last_news,
                extra={"request_id": j.trace},
            )
            self.move(job_id, "stalled")
        return stalled

    def move(self, job_id: str, why: str) -> None:
        """Take a running job off its worker (stalled, drain timed out) and
        resume it elsewhere."""
        j = self.jobs.get(job_id)
        if j is None or j.worker is None:
            return
        self.parts.workers.abort(j.worker, job_id)
        now = self.parts.clock()
        self.parts.policy.taken_off(job_id, now)
        self.after_loss([job_id], why, now)
        self.parts.workers.flush()
