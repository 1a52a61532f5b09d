"""Router drain: stop taking work, let what was admitted finish, then go.

SIGTERM (or ``POST /admin/drain``) starts it.  From that moment the core
refuses every new request with 503 ``router_draining`` + Retry-After before
starting anything (router.lifecycle.intake.Intake.submit), and readiness fails, so
Envoy's health check stops sending here and Envoy retries such a 503 on
another router (deploy/envoy_config.py: the ``x-weir-draining`` header).
What was admitted -- queued or streaming, HTTP or direct ZeroMQ -- runs on
until ``router.drain_timeout_s``, except that a request still waiting for
its first token is refused (the same 503) as soon as it could no longer
finish in the time left (``worth_starting``): a client is better served by
a retry on another router now than by a stream cut at the deadline.  At
the deadline (or a second SIGTERM / a SIGINT) whatever still runs ends with
a clean error -- an SSE error event and ``[DONE]``, a typed ErrorInfo for a
ZeroMQ client, a plain 503 where nothing was sent yet -- never a cut body.

The decisions (``worth_starting``, ``token_time``) are pure; ``RouterDrain`` only
applies them to the core's job table on a timer.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Callable, Iterable
from typing import Protocol

from shared import protocol as p
from shared.errors import Code, error

log = logging.getLogger("weir.router")

TICK_S = 0.1  # how often a drain re-checks what is left (cheap: one pass over the job table)
DRAINING_RETRY_AFTER_S = 1.0  # Retry-After of a draining router's 503: another router (or this one, restarted) soon


def draining_error() -> p.ErrorInfo:
    """The refusal of a draining router: nothing of the request was started."""
    return error(
        Code.ROUTER_DRAINING,
        "This router is shutting down and takes no new requests; retry (another router will serve it).",
        retry_after=DRAINING_RETRY_AFTER_S,
    )


def drain_deadline_error() -> p.ErrorInfo:
    """What ends a request still running when the drain's time is up."""
    return error(
        Code.ROUTER_DRAINING,
        "This router shut down before the request finished (its drain timeout passed); retry it.",
        retry_after=DRAINING_RETRY_AFTER_S,
    )


def worth_starting(now: float, deadline: float, max_tokens: int, token_s: float) -> bool:
    """Whether a request that has produced nothing yet should stay queued on
    a draining router: only if its whole generation (``max_tokens`` at
    ``token_s`` seconds a token, an upper bound: it may stop earlier) can
    still end before ``deadline``.  ``token_s`` 0 (nothing measured): it
    stays until the deadline itself."""
    return now < deadline and now + max_tokens * token_s <= deadline


def token_time(samples: Iterable[tuple[float, int]]) -> float:
    """Seconds per generated token, the median over streams now running:
    each sample (seconds since its first token, tokens since).  0: none yet."""
    rates = [elapsed / (tokens - 1) for elapsed, tokens in samples if tokens > 1 and elapsed > 0]
    return statistics.median(rates) if rates else 0.0


class Drained(Protocol):
    """What a drain needs of the lifecycle (router.lifecycle.core.RouterCore)."""

    draining: bool

    def drain_view(self, now: float) -> tuple[list[tuple[str, int]], list[tuple[float, int]]]: ...

    def job_ids(self) -> list[str]: ...

    def end_job(self, job_id: str, err: p.ErrorInfo) -> None: ...

    def live_jobs(self) -> int: ...


class RouterDrain:
    """One router's drain: ``start`` (idempotent), ``finish_now``, and
    ``done`` set once nothing is left to wait for."""

    def __init__(
        self, core: Drained, loop: asyncio.AbstractEventLoop, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.core = core
        self.loop = loop
        self.timeout_s = timeout_s
        self.clock = clock
        self.deadline: float | None = None
        self.done = asyncio.Event()
        self.shed = 0  # refused while queued: could not finish in time
        self.cut_at_deadline = 0  # ended by the deadline (an error event, never a cut body)
        self._timer: asyncio.TimerHandle | None = None

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def start(self, why: str) -> None:
        if self.started:
            return
        self.core.draining = True
        self.deadline = self.clock() + self.timeout_s
        log.info(
            "draining (%s): no new requests; %d admitted run on for up to %.1f s",
            why,
            self.core.live_jobs(),
            self.timeout_s,
        )
        self._tick()

    def finish_now(self, why: str) -> None:
        """End what is left at once (a second signal), with error events."""
        self.start(why)
        self.deadline = self.clock()
        self._tick()

    def _tick(self) -> None:
        self._timer = None
        if self.done.is_set():
            return
        deadline = self.deadline
        assert deadline is not None  # started
        now = self.clock()
        core = self.core
        waiting, running = core.drain_view(now)
        if now >= deadline:
            left = core.job_ids()
            for job_id in left:
                core.end_job(job_id, drain_deadline_error())
            self.cut_at_deadline += len(left)
        else:
            token_s = token_time(running)
            for job_id, max_tokens in waiting:
                if not worth_starting(now, deadline, max_tokens, token_s):
                    core.end_job(job_id, draining_error())
                    self.shed += 1
        if core.live_jobs() == 0:
            log.info(
                "drained: %d refused while queued (no time left), %d ended by the drain timeout",
                self.shed,
                self.cut_at_deadline,
            )
            self.done.set()
            return
        self._timer = self.loop.call_later(min(TICK_S, max(0.0, deadline - now)), self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
