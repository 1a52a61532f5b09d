"""Session affinity: an agent's turns go back to the worker that holds its
context, sticky until that worker is saturated.

``SessionTable`` maps (tenant, session id) -> worker, bounded (LRU beyond
``session_max_per_tenant`` within a tenant, and beyond ``session_max`` in
all, the tenant holding the most giving up its oldest) and forgotten ``session_ttl_s`` after a session's last turn
or at once after a turn marked final.  A session the table does not know
whose parent it does (a sub-agent, fanned out from its parent's context)
starts on the parent's worker.  Placement (router.policy.placement.strategy) asks
``home`` for the worker a job prefers and scores it ahead of every other
while it is below ``session_load_bound`` of its sequence slots and KV budget
(``sticky``); above it, the job goes where placement would send it anyway,
and the session moves there (``placed``).  A new session's first turn is
scored down on workers by their share of the sessions (``spread``), so
sessions, and the contexts their workers' caches must keep, spread evenly.
Pure: no I/O, one owner (the policy).

Each router keeps its own table: with several routers a session's turns
that reach another router, or a restarted one, start without it and are
placed by the prefix index (the workers' KV events reach every router), and
that router's table learns the session from then on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.policy.types import Job

if TYPE_CHECKING:
    from router.policy.placement.ask import Ask, Candidate

# Score added to the home worker (placement scores are a few units at most,
# RoundRobin's down to minus the fleet's size): the home wins while it may.
STICKY_BONUS = 1e9

# A load scorer of the placement pipeline (router.policy.placement.scorers.Scorer)
Scorer = Callable[["Ask", "list[Candidate]"], list[float]]


class SessionTable:
    __slots__ = ("max_sessions", "max_per_tenant", "ttl_s", "bound", "tenants", "count", "counters", "per_worker")

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        load_bound: float,
        counters: dict[str, int],
        max_per_tenant: int | None = None,
    ) -> None:
        self.max_sessions = max(1, max_sessions)
        # A tenant's own sessions beyond this evict its own oldest: a tenant
        # sending many session ids cannot push another tenant's out.
        self.max_per_tenant = max(1, max_per_tenant if max_per_tenant is not None else max_sessions)
        self.ttl_s = ttl_s
        self.bound = load_bound
        # tenant -> session -> (worker id, last turn's dispatch time), oldest first
        self.tenants: dict[str, OrderedDict[str, tuple[str, float]]] = {}
        self.count = 0
        self.per_worker: dict[str, int] = {}  # sessions on each worker (those in the table)
        self.counters = counters
        for k in ("session_new", "session_sticky", "session_moved", "session_from_parent", "session_ended"):
            counters.setdefault(k, 0)

    def __len__(self) -> int:
        return self.count

    def _get(self, tenant: str, session: str, now: float) -> str | None:
        table = self.tenants.get(tenant)
        got = table.get(session) if table is not None else None
        if got is None:
            return None
        worker, seen = got
        if now - seen > self.ttl_s:
            self._drop(tenant, session, worker)
            return None
        return worker

    def _drop(self, tenant: str, session: str, worker: str) -> None:
        table = self.tenants[tenant]
        del table[session]
        if not table:
            del self.tenants[tenant]
        self.count -= 1
        left = self.per_worker[worker] - 1
        if left:
            self.per_worker[worker] = left
        else:
            del self.per_worker[worker]

    def _oldest(self, tenant: str) -> tuple[str, str, float]:
        session, (worker, seen) = next(iter(self.tenants[tenant].items()))
        return session, worker, seen

    def home(self, job: Job, now: float) -> str | None:
        """The worker ``job``'s session (else its parent's) is on, if any."""
        if not job.session:
            return None
        worker = self._get(job.tenant, job.session, now)
        if worker is None and job.parent_session:
            worker = self._get(job.tenant, job.parent_session, now)
        return worker

    def placed(self, job: Job, worker_id: str, now: float) -> None:
        """``job`` was dispatched to ``worker_id``: its session is there now
        (ended, if this was its final turn)."""
        tenant, session = job.tenant, job.session
        before = self._get(tenant, session, now)
        c = self.counters
        if before is None:
            parent = self._get(tenant, job.parent_session, now) if job.parent_session else None
            c["session_from_parent" if parent == worker_id else "session_new"] += 1
        else:
            c["session_sticky" if before == worker_id else "session_moved"] += 1
            self._drop(tenant, session, before)
        if job.session_final:
            c["session_ended"] += 1
            return
        table = self.tenants.get(tenant)
        if table is None:
            table = self.tenants[tenant] = OrderedDict()
        table[session] = (worker_id, now)  # (the newest: at the end)
        self.count += 1
        self.per_worker[worker_id] = self.per_worker.get(worker_id, 0) + 1
        # its tenant's least recently placed first: past the TTL or beyond the tenant's bound, forgotten
        while True:
            oldest, w, seen = self._oldest(tenant)
            if len(table) <= self.max_per_tenant and now - seen <= self.ttl_s:
                break
            self._drop(tenant, oldest, w)
        if self.count > self.max_sessions:  # the whole table: the tenant with the most gives up its oldest
            most = max(self.tenants, key=lambda t: len(self.tenants[t]))
            oldest, w, _ = self._oldest(most)
            self._drop(most, oldest, w)

    def sticky(self, home: str) -> Scorer:
        """A load scorer that puts the home worker ahead of every other while
        it is below the load bound (its sequences and its KV once placed)."""
        bound = self.bound

        def session_home(ask: Ask, cands: list[Candidate]) -> list[float]:
            return [
                STICKY_BONUS
                if w.spec.worker_id == home and n + 1 <= w.slots * bound and after <= w.budget * bound
                else 0.0
                for w, _, after, n in cands
            ]

        return session_home

    def spread(self, n_workers: int) -> Scorer | None:
        """A load scorer less each worker's share of the sessions (a new
        session's first turn): sessions spread over the fleet, so no worker's
        cache has to hold more of their contexts than the others'."""
        per = self.per_worker
        if not per:
            return None
        scale = 1.0 / (self.count / max(1, n_workers) + 1.0)

        def fewer_sessions(ask: Ask, cands: list[Candidate]) -> list[float]:
            return [-per.get(w.spec.worker_id, 0) * scale for w, _, _, _ in cands]

        return fewer_sessions
