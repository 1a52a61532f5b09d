"""The tokenizer threads and who goes next on them: short prompts first, fair between tenants.

Three kinds of work need a model's tokenizer off the event loop: generation
prompts longer than router.lifecycle.prompts ``INLINE_MAX_CHARS``, split by
size into ``SHORT`` (at most ``SHORT_MAX_CHARS``: a few ms each) and
``PROMPT`` (up to ~150 ms for a 220 KB prompt), and long /tokenize and
/detokenize calls (``CALL``, router.ingress.tokenize: ~1 s for 1 MiB).  In
one FIFO a short prompt would wait behind every long one queued: 150 agent
prompts of 220 KB are ~11 s of two cores.

``FairQueue`` (pure, no I/O, tested by hypothesis) decides:

  * long prompts and calls (the heavy kinds) run on ``threads`` threads;
    short prompts have ``spare`` threads of their own (one), so a short
    prompt never waits for a long one or a call to finish -- only for the
    short prompts ahead of it (milliseconds each);
  * a short prompt takes a heavy thread only when no heavy work waits for
    it: a tenant's stream of short prompts never holds back any tenant's
    long prompts or calls;
  * calls run on at most ``call_threads`` (fewer than ``threads``), so a
    long prompt never waits behind calls: a heavy thread is always left to prompts;
  * within a kind, each tenant has a FIFO and tenants with work are served
    round robin, so one tenant's backlog delays another's next item by at
    most one item of each tenant with work;
  * calls queued are bounded, per tenant and in all: beyond, ``push`` says no
    and the caller answers 503 ``tokenizer_busy``.  Prompts are not refused
    here (admission bounds them once tokenized; refusing them would fail
    batch lines), they only take their turn.

``threads`` is ``[router] tokenize_threads``, by default the cores this
process may run on (``pool_threads``): ``tokenizers`` releases the GIL while
it encodes, so long prompts are tokenized on every core at once.  So that
this never starves the event loop, the short prompts' thread or the other
processes of the host (Envoy, workers) of CPU, the heavy threads run at a
lower scheduling priority (nice ``HEAVY_NICE``, Linux: per thread): they
take every cycle nothing else wants, and yield the core whenever the loop
wakes (measured: bench/results/2026-12-05-long-prompts.md).

``TokenizerQueue`` is the thin handoff: it keeps the queue on the event loop
(no locks) and hands the next item to the pool whenever a thread is free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T")
Kind = Literal["short", "prompt", "call"]
SHORT: Kind = "short"  # a prompt of at most router.lifecycle.prompts.SHORT_MAX_CHARS
PROMPT: Kind = "prompt"  # a longer one
CALL: Kind = "call"
KINDS: tuple[Kind, ...] = (SHORT, PROMPT, CALL)
MIN_THREADS = 2  # calls on one at most: one is always left to long prompts
SPARE_THREADS = 1  # short prompts' own
HEAVY_NICE = 10  # a nice-0 thread (the loop) gets ~9x the CPU of one at nice 10 when both want it


CGROUP_ROOT = "/sys/fs/cgroup"


def cores(read: Callable[[str], str | None] | None = None) -> int:
    """The cores this process may run on: its affinity mask (a container's
    cpuset), and no more than its cgroup's CPU quota (``docker --cpus``, a
    Kubernetes CPU limit), rounded up.  ``read``: a file's text (tests)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on Linux)
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(read or _read_text)
    return n if quota is None else min(n, quota)


def cgroup_cpu_quota(read: Callable[[str], str | None], root: str = CGROUP_ROOT) -> int | None:
    """The CPU quota, in whole cores rounded up, of this process's cgroup: the smallest of its own
    and its ancestors' (each caps its children), found from /proc/self/cgroup -- cgroup v2's
    ``0::/path`` (``cpu.max``) and cgroup v1's ``cpu`` controller line (``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us`` under the controller's mount, ``cpu,cpuacct`` where they share one).
    Walking up to the root also finds a container's own quota where /proc/self/cgroup names the
    host's path.  None: no quota (or nothing readable).  ``read``: a file's text, None when it
    cannot be read (pure: no I/O of its own)."""
    lines = (read("/proc/self/cgroup") or "0::/").splitlines()
    found: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2
            for d in _up(root, path):
                found += _quota(_v2_limit(read(d + "/cpu.max")))
        elif "cpu" in controllers.split(","):  # v1
            for mount in dict.fromkeys((controllers, "cpu,cpuacct", "cpu")):
                for d in _up(f"{root}/{mount}", path):
                    found += _quota(_v1_limit(read(d + "/cpu.cfs_quota_us"), read(d + "/cpu.cfs_period_us")))
    return min(found) if found else None


def _up(base: str, path: str) -> list[str]:
    """``base`` + the cgroup's ``path``, then each ancestor's up to ``base`` itself."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return [base + "".join("/" + p for p in parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(cpu_max: str | None) -> tuple[int, int] | None:
    """cgroup v2 ``cpu.max`` ("<quota> <period>", quota "max": none) -> (quota, period)."""
    fields = (cpu_max or "").split()
    if len(fields) < 2 or fields[0] == "max":
        return None
    return _ints(fields[0], fields[1])


def _v1_limit(quota: str | None, period: str | None) -> tuple[int, int] | None:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us`` -> (quota, period)."""
    if quota is None or period is None:
        return None
    return _ints(quota.strip(), period.strip())


def _ints(quota: str, period: str) -> tuple[int, int] | None:
    try:
        return int(quota), int(period)
    except ValueError:
        return None


def _quota(limit: tuple[int, int] | None) -> list[int]:
    """A (quota, period) as whole cores rounded up ([]: none, or not a limit: v1's -1)."""
    if limit is None or limit[0] <= 0 or limit[1] <= 0:
        return []
    return [max(1, -(-limit[0] // limit[1]))]


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # no such cgroup file here, or unreadable
        return None


def pool_threads(configured: int) -> tuple[int, int]:
    """(threads for heavy work, of which for calls) for ``[router] tokenize_threads``
    (0: one per core, at least ``MIN_THREADS``).  Calls get half, at least one
    and always fewer than all."""
    threads = max(MIN_THREADS, configured or cores())
    return threads, max(1, threads // 2)


class FairQueue(Generic[T]):
    """Per-kind, per-tenant FIFOs, served short prompts first, tenants round robin."""

    def __init__(
        self, threads: int, call_threads: int, calls_per_tenant: int, calls_total: int, spare: int = SPARE_THREADS
    ) -> None:
        assert 1 <= call_threads <= threads and spare >= 1
        self.threads, self.call_threads, self.spare = threads, call_threads, spare
        self.calls_per_tenant, self.calls_total = calls_per_tenant, calls_total
        # tenant -> its FIFO; the dict's order is the round robin's (served: to the back)
        self._queues: dict[Kind, OrderedDict[str, deque[T]]] = {k: OrderedDict() for k in KINDS}
        self.running: dict[Kind, int] = dict.fromkeys(KINDS, 0)
        self.queued: dict[Kind, int] = dict.fromkeys(KINDS, 0)
        self.on_spare = 0  # short prompts running on the spare threads (the rest on heavy ones)

    def push(self, kind: Kind, tenant: str, item: T) -> bool:
        """Queue ``item``; False (nothing queued) for a call over a bound."""
        q = self._queues[kind]
        fifo = q.get(tenant)
        if kind == CALL and (
            self.queued[CALL] >= self.calls_total or (fifo is not None and len(fifo) >= self.calls_per_tenant)
        ):
            return False
        if fifo is None:
            fifo = q[tenant] = deque()
        fifo.append(item)
        self.queued[kind] += 1
        return True

    def pop(self) -> tuple[Kind, T, bool] | None:
        """The next item to run now, and whether on a spare thread (it counts
        as running there until ``done``), or None."""
        running = self.running
        busy = running[PROMPT] + running[CALL] + running[SHORT] - self.on_spare  # heavy threads in use
        queues = self._queues
        spare = False
        if queues[SHORT] and self.on_spare < self.spare:
            kind: Kind = SHORT  # milliseconds each: first, on their own thread
            spare = True
        elif busy >= self.threads:
            return None
        elif queues[CALL] and running[CALL] < self.call_threads:
            # calls take a thread whenever one of theirs is free (never more:
            # the rest stay the prompts'), so neither kind starves
            kind = CALL
        elif queues[PROMPT]:
            kind = PROMPT
        elif queues[SHORT]:
            # a heavy thread no heavy work waits for: never ahead of it, or one tenant's
            # stream of short prompts would keep every tenant's long ones waiting
            kind = SHORT
        else:
            return None
        q = queues[kind]
        tenant, fifo = q.popitem(last=False)
        item = fifo.popleft()
        if fifo:
            q[tenant] = fifo  # to the back of the round
        self.queued[kind] -= 1
        running[kind] += 1
        self.on_spare += spare
        return kind, item, spare

    def done(self, kind: Kind, spare: bool = False) -> None:
        self.running[kind] -= 1
        self.on_spare -= spare

    def waiting(self, kind: Kind, tenant: str) -> int:
        fifo = self._queues[kind].get(tenant)
        return len(fifo) if fifo is not None else 0


class _Work:
    __slots__ = ("fn", "args", "fut", "alive")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], fut: asyncio.Future[Any], alive: Callable[[], bool] | None
    ) -> None:
        self.fn, self.args, self.fut, self.alive = fn, args, fut, alive


class TokenizerQueue:
    """The tokenizer threads behind a ``FairQueue``; used on the event loop only."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, calls_per_tenant: int, calls_total: int, threads: int = 0
    ) -> None:
        """``threads``: ``[router] tokenize_threads`` (0: one per core, ``pool_threads``)."""
        self.loop = loop
        heavy, calls = pool_threads(threads)
        self.queue: FairQueue[_Work] = FairQueue(heavy, calls, calls_per_tenant, calls_total)
        self.pool = concurrent.futures.ThreadPoolExecutor(heavy, "tokenize", initializer=_lower_priority)
        self.spare = concurrent.futures.ThreadPoolExecutor(SPARE_THREADS, "tokenize-short")

    def run(
        self, kind: Kind, tenant: str, fn: Callable[..., Any], *args: Any, alive: Callable[[], bool] | None = None
    ) -> asyncio.Future[Any] | None:
        """``fn(*args)`` on a tokenizer thread in its tenant's turn; None: a
        call over the queue's bound.  ``alive``: asked when its turn comes
        (False: dropped unrun, its future cancelled -- a client gone)."""
        fut: asyncio.Future[Any] = self.loop.create_future()
        if not self.queue.push(kind, tenant, _Work(fn, args, fut, alive)):
            return None
        self._pump()
        return fut

    def _pump(self) -> None:
        while (got := self.queue.pop()) is not None:
            kind, w, spare = got
            if w.fut.cancelled() or (w.alive is not None and not w.alive()):
                self.queue.done(kind, spare)
                w.fut.cancel()
                continue
            ran = self.loop.run_in_executor(self.spare if spare else self.pool, w.fn, *w.args)
            ran.add_done_callback(partial(self._finished, kind, spare, w))

    def _finished(self, kind: Kind, spare: bool, w: _Work, ran: asyncio.Future[Any]) -> None:
        self.queue.done(kind, spare)
        if not w.fut.cancelled():
            if ran.cancelled():
                w.fut.cancel()
            elif (exc := ran.exception()) is not None:
                w.fut.set_exception(exc)
            else:
                w.fut.set_result(ran.result())
        self._pump()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.spare.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """A heavy tokenizer thread's start: nice ``HEAVY_NICE`` (Linux sets it per thread)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # (never fatal: it only yields less)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HEAVY_NICE)
