"""The tokenizer threads and who goes next on them: fair between tenants.

Two kinds of work need a model's tokenizer off the event loop: generation
prompts longer than router.lifecycle.prompts ``INLINE_MAX_CHARS`` (``PROMPT``) and
long /tokenize and /detokenize calls (``CALL``, router.ingress.tokenize).  A
tenant's 1 MiB tokenize calls take ~1 s of a thread each; in one FIFO they
would delay every tenant's prompts by as many seconds as were queued.

``FairQueue`` (pure, no I/O, tested by hypothesis) decides:

  * each tenant has a FIFO per kind; tenants with work are served round
    robin, so one tenant's backlog delays another's next item by at most one
    item of each tenant with work;
  * calls run on at most ``call_threads`` threads (one) of ``threads`` (two),
    so a prompt never waits behind a call: a thread is always left to prompts;
  * calls queued are bounded, per tenant and in all: beyond, ``push`` says no
    and the caller answers 503 ``tokenizer_busy``.  Prompts are not refused
    here (admission bounds them once tokenized; refusing them would fail
    batch lines), they only take their turn.

``TokenizerQueue`` is the thin handoff: it keeps the queue on the event loop
(no locks) and hands the next item to the pool whenever a thread is free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T")
Kind = Literal["prompt", "call"]
PROMPT: Kind = "prompt"
CALL: Kind = "call"
THREADS = 2  # one is always left to prompts (CALL_THREADS = 1)
CALL_THREADS = 1


class FairQueue(Generic[T]):
    """Per-tenant FIFOs of prompts and calls, served round robin by tenant."""

    def __init__(self, threads: int, call_threads: int, calls_per_tenant: int, calls_total: int) -> None:
        assert 1 <= call_threads <= threads
        self.threads, self.call_threads = threads, call_threads
        self.calls_per_tenant, self.calls_total = calls_per_tenant, calls_total
        # tenant -> its FIFO; the dict's order is the round robin's (served: to the back)
        self._queues: dict[Kind, OrderedDict[str, deque[T]]] = {PROMPT: OrderedDict(), CALL: OrderedDict()}
        self.running: dict[Kind, int] = {PROMPT: 0, CALL: 0}
        self.queued: dict[Kind, int] = {PROMPT: 0, CALL: 0}

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

    def pop(self) -> tuple[Kind, T] | None:
        """The next item to run now (it counts as running until ``done``), or None."""
        if self.running[PROMPT] + self.running[CALL] >= self.threads:
            return None
        if self._queues[CALL] and self.running[CALL] < self.call_threads:
            # calls take a thread whenever one of theirs is free (never more:
            # the rest stay the prompts'), so neither kind starves
            kind: Kind = CALL
        elif self._queues[PROMPT]:
            kind = PROMPT
        else:
            return None
        q = self._queues[kind]
        tenant, fifo = q.popitem(last=False)
        item = fifo.popleft()
        if fifo:
            q[tenant] = fifo  # to the back of the round
        self.queued[kind] -= 1
        self.running[kind] += 1
        return kind, item

    def done(self, kind: Kind) -> None:
        self.running[kind] -= 1

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

    def __init__(self, loop: asyncio.AbstractEventLoop, calls_per_tenant: int, calls_total: int) -> None:
        self.loop = loop
        self.queue: FairQueue[_Work] = FairQueue(THREADS, CALL_THREADS, calls_per_tenant, calls_total)
        self.pool = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="tokenize")

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
            kind, w = got
            if w.fut.cancelled() or (w.alive is not None and not w.alive()):
                self.queue.done(kind)
                w.fut.cancel()
                continue
            ran = self.loop.run_in_executor(self.pool, w.fn, *w.args)
            ran.add_done_callback(partial(self._finished, kind, w))

    def _finished(self, kind: Kind, w: _Work, ran: asyncio.Future[Any]) -> None:
        self.queue.done(kind)
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
