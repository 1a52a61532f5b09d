"""The ports the request lifecycle (router.lifecycle.core) calls out through.

Declared by their consumer: the lifecycle owns no socket, so whatever
reaches engine workers (router.fleet.worker_link) or a client (router.ingress.http_server,
router.ingress.zmq_clients) implements one of these.  tests/fakes.py fakes
both, for in-process tests.
"""

from __future__ import annotations

from typing import Protocol

from shared import protocol as p


class RequestSink(Protocol):
    """Where one request's news goes (its client's connection)."""

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        """This request's news since the last call; the last call ends with a
        Delta whose ``finished`` is true, and no call follows it."""


class WorkerPort(Protocol):
    """How the lifecycle reaches engine workers (router.fleet.worker_link)."""

    def dispatch(self, worker_id: str, req: p.GenerateRequest) -> bool:
        """Queue ``req`` for the worker; False if no such worker is linked."""

    def abort(self, worker_id: str, job_id: str) -> None: ...

    def flush(self) -> None:
        """Send what is queued now, one message per worker."""
