"""Fakes of the lifecycle's ports (router.lifecycle.ports) and of its clock, for
in-process tests of router.lifecycle.core: no sockets, no processes, time moved by hand
(after vLLM's MockEngineCore pattern)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import uvloop

from shared import protocol as p

if TYPE_CHECKING:
    from router.policy import WorkerSpec

T = TypeVar("T")


class LoopThread:
    """A uvloop event loop on a thread of its own, as the router runs one, for
    tests that talk to a RouterCore (and its HTTP server) from theirs."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the loop; its result, here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """``fn()`` on the loop (the core's state has one owner: its loop)."""

        async def on_loop() -> T:
            return fn()

        return self.run(on_loop(), timeout)

    def stop(self, *closers: Callable[[], object]) -> None:
        """``closers`` on the loop, in order, then the loop ends."""
        for close in closers:
            self.loop.call_soon_threadsafe(close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeWorkers:
    """The WorkerPort: which worker got which request, and the aborts."""

    def __init__(self) -> None:
        self.linked: set[str] = set()
        self.dispatched: dict[str, list[p.GenerateRequest]] = {}
        self.current: dict[str, str] = {}  # job id -> the worker it was dispatched to last
        self.attempts: dict[str, int] = {}  # job id -> dispatches so far
        self.aborted: list[tuple[str, str]] = []
        self.refuse_next = False  # the next dispatch finds the worker unlinked

    def dispatch(self, worker_id: str, req: p.GenerateRequest) -> bool:
        if self.refuse_next or worker_id not in self.linked:
            self.refuse_next = False
            return False
        self.dispatched.setdefault(worker_id, []).append(req)
        self.current[req.request_id] = worker_id
        self.attempts[req.request_id] = self.attempts.get(req.request_id, 0) + 1
        return True

    def abort(self, worker_id: str, job_id: str) -> None:
        self.aborted.append((worker_id, job_id))

    def flush(self) -> None:
        pass

    def where(self, job_id: str) -> str | None:
        return self.current.get(job_id)


class FakeSink:
    """A RequestSink that records what the client would see, and fails on news after the final Delta."""

    def __init__(self) -> None:
        self.deltas: list[p.Delta] = []

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        assert not self.finals, "news after the final Delta"
        assert deltas and all(not d.finished for d in deltas[:-1])
        self.deltas.extend(deltas)

    @property
    def finals(self) -> list[p.Delta]:
        return [d for d in self.deltas if d.finished]


class FakeClock:
    """A monotonic clock that moves only when a test sets ``t``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def registration(
    worker_id: str,
    model: str,
    *,
    max_model_len: int = 4096,
    kv: int = 8192,
    seqs: int = 4,
    engine: str = "sim",
) -> p.Register:
    """A worker's Register as the in-process tests join one: any pool, 16-token blocks."""
    return p.Register(
        worker_id=worker_id,
        model=model,
        pool=p.Pool.ANY,
        max_model_len=max_model_len,
        kv_capacity_tokens=kv,
        block_size=16,
        max_num_seqs=seqs,
        engine=engine,
    )


def worker_spec(i: int, *, seqs: int = 8, max_len: int = 4096, cap: int = 1 << 20, model: str = "m") -> WorkerSpec:
    """Worker ``w{i}`` of model ``model`` as the policy knows it (router.policy.WorkerSpec), any pool."""
    from router.policy import WorkerSpec

    return WorkerSpec(
        worker_id=f"w{i}",
        model=model,
        pool=p.Pool.ANY,
        capacity_tokens=cap,
        block_size=16,
        max_num_seqs=seqs,
        max_model_len=max_len,
    )
