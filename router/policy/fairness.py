"""One tenant's turn in a queue, shared among its end users: its entries by
fairness id (``x-llm-d-inference-fairness-id``, ``x-smg-tenant-id``,
``x-smg-routing-key``: one user of a platform tenant), served by deficit
round robin by tokens, so one user flooding cannot starve the tenant's
others.  Only the order inside the tenant changes: what the tenant as a
whole is served is ``queues.TenantQueue``'s DRR across tenants, as without
fairness ids.  Requests without one share the line of the empty id.

Bounded whatever a tenant sends: at most ``EXACT_IDS`` ids have a line of
their own at once in a queue; ids beyond share ``OVERFLOW_LINES`` lines by
a stable hash (requests without an id keep their line).  A line goes when
it is empty, so a tenant's queue holds at most EXACT_IDS + OVERFLOW_LINES + 1
lines, and only while it has work queued."""

from __future__ import annotations

import math
import zlib
from collections import deque

from router.policy.records import WAITING, Entry

EXACT_IDS = 64  # fairness ids with a line of their own, per tenant and queue
OVERFLOW_LINES = 16  # the lines the ids beyond share
WAIT_BUCKETS = 64  # the wait model's queued tokens per tenant and class, by hashed id (totals.AdmissionTotals)
# Where its requests carry fairness ids, a tenant's queued work may reach this
# many times what the wait bound admits of it without them: room for its
# other users' requests once one user has filled the tenant's share
# (router.policy.wait_model).  Served, it still gets only its share.
TENANT_ROOM = 2.0


def wait_bucket(fid: str) -> int:
    return zlib.crc32(fid.encode("utf-8", "surrogatepass")) % WAIT_BUCKETS


def tenant_ahead(own: int, tokens: int, by_id: dict[int, int], fid: str) -> int:
    """Of its tenant's queued tokens in its class (``own``; ``by_id``: those of
    requests with a fairness id, by ``wait_bucket``), what is served before a
    new job of ``tokens`` with fairness id ``fid`` ("": none): its own line's,
    and of every other line at most what its own line gets meanwhile (DRR,
    equal shares).  Ids sharing a bucket count as one line: never less."""
    plain = own - sum(by_id.values())  # the line of the empty id
    mb = wait_bucket(fid) if fid else -1
    mine = by_id.get(mb, 0) if fid else plain
    cap = mine + tokens
    ahead = mine + (min(plain, cap) if fid else 0)
    for b, n in by_id.items():
        if b != mb:
            ahead += min(n, cap)
    return ahead


def line_of(fid: str, lines: dict[str, deque[Entry]]) -> str:
    """The line ``fid`` queues in: its own while fewer than EXACT_IDS lines
    are held (or it has one, or it is the empty id), else an overflow line by a stable hash (ids are
    printable ASCII, so a name with a NUL is never an id's own)."""
    if not fid or fid in lines or len(lines) < EXACT_IDS:  # (no id: always the empty id's own line)
        return fid
    return "\x00%d" % (zlib.crc32(fid.encode("utf-8", "surrogatepass")) % OVERFLOW_LINES)


class FairLines:
    """One tenant's entries in one ``TenantQueue``, by fairness id.  Stands in
    for the tenant's plain deque (``TenantQueue`` converts it at the first
    entry with a fairness id) and reads as that deque does there: true while
    a live entry waits, ``[0]`` the entry DRR serves next (stable until
    ``popleft``), ``popleft()`` that entry was served.  Dead entries (that
    left without being served) are skipped lazily, as in the queue."""

    __slots__ = ("quantum", "lines", "active", "deficit", "visited", "picked")

    def __init__(self, quantum: int, plain: deque[Entry]) -> None:
        self.quantum = quantum
        self.lines: dict[str, deque[Entry]] = {}
        self.active: deque[str] = deque()  # round-robin order of lines with work
        self.deficit: dict[str, float] = {}
        self.visited = False  # the front line got its quantum for this visit
        self.picked: Entry | None = None  # the last pick, while nothing joined or was served since
        if plain:  # what the tenant queued before: the line of the empty id
            self.lines[""] = plain
            self.active.append("")
            self.deficit[""] = 0.0

    def line_for(self, e: Entry) -> deque[Entry]:
        """The line ``e`` joins (active from now on): the caller inserts it."""
        self.picked = None  # (a requeued entry may go ahead of the pick in its line)
        lines = self.lines
        k = line_of(e.job.fairness_id, lines)
        dq = lines.get(k)
        if dq is None:
            dq = lines[k] = deque()
        if k not in self.deficit:
            self.active.append(k)
            self.deficit[k] = 0.0
        return dq

    def _drop_front(self) -> None:
        k = self.active.popleft()
        del self.deficit[k]
        del self.lines[k]
        self.visited = False

    def _live(self, k: str) -> Entry | None:
        dq = self.lines[k]
        while dq and dq[0].state != WAITING:
            dq.popleft()
        return dq[0] if dq else None

    def pick(self) -> Entry | None:
        """The entry served next (advances round state; idempotent until ``popleft``)."""
        e = self.picked
        if e is not None and e.state == WAITING:
            return e  # (the queue asks up to three times per head it serves)
        self.picked = e = self._pick()
        return e

    def _pick(self) -> Entry | None:
        active = self.active
        misses = 0
        while active:
            k = active[0]
            head = self._live(k)
            if head is None:
                self._drop_front()
                continue
            if not self.visited:
                self.deficit[k] += self.quantum
                self.visited = True
            if head.tokens <= self.deficit[k]:
                return head
            self.visited = False
            active.rotate(-1)
            misses += 1
            if misses >= len(active):
                # A whole round served nobody: grant the rounds the closest
                # line still needs in one go (as TenantQueue.peek does).
                need = [
                    math.ceil((h.tokens - self.deficit[u]) / self.quantum)
                    for u in active
                    if (h := self._live(u)) is not None
                ]
                rounds = min(need) if need else 0
                if rounds > 1:
                    for u in active:
                        self.deficit[u] += (rounds - 1) * self.quantum
                misses = 0
        return None

    def __bool__(self) -> bool:
        return self.pick() is not None

    def __getitem__(self, i: int) -> Entry:
        e = self.pick() if i == 0 else None
        if e is None:
            raise IndexError(i)
        return e

    def popleft(self) -> Entry:
        """The entry ``[0]`` names was served: charged to its line."""
        e = self.pick()
        if e is None:
            raise IndexError("popleft from an empty FairLines")
        self.picked = None
        k = self.active[0]
        self.lines[k].popleft()
        self.deficit[k] -= e.tokens
        if self._live(k) is None:
            self._drop_front()  # an emptied line keeps no credit (DRR)
        return e
