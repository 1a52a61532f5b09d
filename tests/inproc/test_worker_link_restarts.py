"""A worker that registers again while its routers still run, in-process
with real parts on loopback sockets: the router (RouterCore over a real
WorkerLink), a real engine worker (engine_worker.worker.Worker on the
simulated engine) and a stand-in second worker (a DEALER that records what
it is sent).  The tests order the messages themselves: nothing runs between
two statements that do not await.

* One run per job (several routers make the race likely, one is enough):
  the worker times the router out while the router still counts it alive,
  connects again and registers anew; a Dispatch the router sends before it
  has read that Register arrives on the new link.  On reading the Register
  the router counts every job it had there lost and runs it again
  elsewhere -- so the worker must not run that Dispatch too
  (Register.epoch / Dispatch.epoch).  A router restarted before it read
  that Register learns the worker from one it reads itself, and runs jobs
  there (none dropped as stale, left waiting).
* The engine dies under a live worker (vLLM's EngineCore exits): the worker
  says Drain, reports its jobs Lost, starts the engine again and registers
  anew; the router resumes the jobs elsewhere as a lost worker's."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import zmq
from fakes import FakeSink, registration

from engine_worker.sim_engine import SimEngine
from engine_worker.worker import Worker
from router.fleet.worker_link import WorkerLink
from router.lifecycle.core import RouterCore
from router.observe.metrics import RouterMetrics
from shared import protocol as p
from shared.config import Config, WorkerConfig
from shared.transport import SocketPump


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(port: int) -> Config:
    return msgspec.convert(
        {
            # heartbeats every minute: no tick runs during the test, the test decides who times out whom
            "router": {"backend": f"tcp://127.0.0.1:{port}", "heartbeat_interval_s": 60.0},
            "scheduler": {"generation_deadline_s": 30.0},
            "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}],
        },
        Config,
    )


async def _until(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _port_free(port: int, timeout_s: float = 5.0) -> None:
    """Until a router may bind ``port`` again: a probe binds it in a context
    of its own, whose term returns once the probe has let it go."""
    deadline = time.monotonic() + timeout_s
    while True:
        ctx = zmq.Context()
        probe = ctx.socket(zmq.ROUTER)
        try:
            probe.bind(f"tcp://127.0.0.1:{port}")
            free = True
        except zmq.ZMQError:
            free = False
        probe.close(0)
        ctx.term()
        if free:
            return
        assert time.monotonic() < deadline, "port still bound"
        await asyncio.sleep(0.05)


def _stand_in(ctx: zmq.Context, port: int, worker_id: str) -> zmq.Socket:
    """A second worker of the model with more sequence slots (placement prefers it when both are empty)."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.IDENTITY, worker_id.encode())
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{port}")
    d.send(p.encoder.encode(registration(worker_id, "sim-m", kv=1 << 20, seqs=64)))
    return d


def _dispatched(d: zmq.Socket) -> list[p.GenerateRequest]:
    """The requests in the Dispatches waiting on the stand-in's socket."""
    reqs = []
    while d.poll(0):
        msg = p.to_worker_decoder.decode(d.recv())
        if isinstance(msg, p.Dispatch):
            reqs += msg.requests
    return reqs


@dataclass
class Fleet:
    core: RouterCore
    link: WorkerLink
    worker: Worker  # "w-a", real, on the simulated engine
    engine: SimEngine
    other: zmq.Socket  # "w-b", a stand-in


@contextlib.asynccontextmanager
async def fleet(sim: dict | None = None) -> AsyncIterator[Fleet]:
    """The router with w-a and w-b registered, w-b drained (work goes to w-a first)."""
    loop = asyncio.get_running_loop()
    port = _port()
    cfg = _config(port)
    metrics = RouterMetrics()
    link = WorkerLink(cfg.router, loop, SocketPump(loop), metrics)
    core = RouterCore(cfg, loop, link, metrics=metrics)
    link.serve(core)
    wcfg = msgspec.convert(
        {
            "id": "w-a",
            "model": "sim-m",
            "max_num_seqs": 4,
            "warmup": False,
            "discovery_interval_s": 0,
            "routers": [f"tcp://127.0.0.1:{port}"],
            "sim": sim or {},
        },
        WorkerConfig,
    )
    engine = SimEngine(wcfg.sim, wcfg.max_num_seqs, 4096)
    worker = Worker(cfg, wcfg, engine)
    engine.on_died = worker._engine_died  # (as Worker.run sets it)
    ctx = zmq.Context()
    other = _stand_in(ctx, port, "w-b")
    try:
        worker._registration(await engine.start())
        worker._add_link(f"tcp://127.0.0.1:{port}")
        await _until(lambda: {"w-a", "w-b"} <= set(link.workers))
        link.drain("w-b")
        yield Fleet(core, link, worker, engine, other)
    finally:
        await engine.shutdown()
        for lk in worker.links.values():
            worker._close_socket(lk)
        worker.ctx.term()
        core.close()
        link.close()
        other.close(0)
        ctx.term()


def _run_the_race() -> int:
    """Copies of one job that ran: on the real worker after the router read
    its new Register (still live in its engine) plus the stand-in's."""

    async def scenario() -> int:
        async with fleet() as f:
            core, link, worker, engine = f.core, f.link, f.worker, f.engine
            (wlink,) = worker.links.values()
            known = link.workers["w-a"]

            # The worker times the router out (the router does not know): it
            # forgets what that router ran, connects again and registers anew.
            wlink.backoff = 0.0
            await worker._reconnect(wlink)
            time.sleep(0.3)  # noqa: ASYNC251 -- the loop held: the new connection is up, its Register unread
            assert link.workers["w-a"] is known  # the router has not read the new Register

            # ...and the router, not knowing, dispatches a job there.
            handle = core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=4000), FakeSink())
            assert isinstance(handle, int), handle
            job_id = "%x" % handle
            core.run_policy()
            link.flush()
            assert core.jobs[job_id].worker == "w-a"
            link.undrain("w-b")

            # Now the router reads the Register: the job is lost there and runs again, on w-b.
            await _until(lambda: link.workers["w-a"] is not known)
            await _until(lambda: core.jobs[job_id].worker == "w-b")
            await asyncio.sleep(0.3)  # whatever w-a took has reached its engine
            on_b = [r.request_id for r in _dispatched(f.other)].count(job_id)
            on_a = sum(1 for rid in engine.live_ids() if rid.endswith(":" + job_id))
            core.cancel(handle)
            return on_a + on_b

    return asyncio.run(scenario())


def test_a_dispatch_sent_before_the_router_read_a_new_register_does_not_run():
    assert _run_the_race() == 1


def test_an_engine_that_dies_under_its_jobs_has_them_resumed_elsewhere_and_registers_again():
    async def scenario() -> None:
        async with fleet({"step_fixed_ms": 5.0}) as f:
            core, link, worker, engine = f.core, f.link, f.worker, f.engine
            known = link.workers["w-a"]
            sink = FakeSink()
            handle = core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=2000), sink)
            assert isinstance(handle, int), handle
            job_id = "%x" % handle
            prompt = core.jobs[job_id].prompt_tokens
            await _until(lambda: sum(d.num_tokens for d in sink.deltas) >= 5)
            link.undrain("w-b")

            engine._died(RuntimeError("EngineCore died"))  # as VllmEngine on vLLM's EngineDeadError
            await _until(lambda: core.jobs[job_id].worker == "w-b")
            streamed = sum(d.num_tokens for d in sink.deltas)
            (resumed,) = [r for r in _dispatched(f.other) if r.request_id == job_id]
            assert (resumed.prompt_tokens, resumed.params.max_tokens) == (prompt + streamed, 2000 - streamed)
            assert not sink.finals  # no error: the client's stream goes on
            # The worker started its engine again and registered anew (a new link epoch, accepting work).
            await _until(lambda: link.workers["w-a"] is not known and worker._restarting is None)
            assert link.workers["w-a"].drain_deadline is None and link.workers["w-a"].reg.epoch != known.reg.epoch
            workers = core.policy.workers
            assert workers["w-a"].reserved == 0 and workers["w-b"].reserved == core.policy.cost_of(job_id)

            left = 2000 - streamed  # the continuation ends on w-b: one stream of 2,000 tokens
            end = p.Delta(
                job_id, " tok" * left, left, "length", prompt_tokens=prompt + streamed, completion_tokens=left
            )
            f.other.send(p.encoder.encode(p.Outputs([end])))
            await _until(lambda: bool(sink.finals))
            (final,) = sink.finals
            assert (final.finish_reason, final.completion_tokens, final.prompt_tokens) == ("length", 2000, prompt)
            assert "".join(d.text for d in sink.deltas) == " tok" * 2000

            link.drain("w-b")  # the restarted engine serves
            again = FakeSink()
            assert isinstance(core.submit(p.Submit("c", "sim-m", prompt="hi", max_tokens=3), again), int)
            await _until(lambda: bool(again.finals))
            assert again.finals[0].finish_reason == "length" and again.finals[0].completion_tokens == 3
            assert not core.jobs and all(w.reserved == 0 for w in workers.values())

    asyncio.run(scenario())


def test_a_router_restarted_after_a_worker_timed_it_out_runs_its_jobs_there():
    """The worker times the router out and registers anew; the router process
    is killed before it reads that Register (lost with it) and a new one
    starts on the same address.  The new process knows the worker only by a
    Register it reads itself (the worker's next heartbeat is answered
    Goodbye, and it registers again), so its Dispatches carry the link's
    current epoch and the job runs there -- none is dropped as stale and
    left waiting."""

    async def scenario() -> None:
        async with fleet() as f:
            worker, port = f.worker, f.link.cfg.backend.rsplit(":", 1)[1]
            (wlink,) = worker.links.values()
            wlink.backoff = 0.0
            await worker._reconnect(wlink)
            time.sleep(0.3)  # noqa: ASYNC251 -- the loop held: the new Register sent, unread
            epoch = wlink.epoch
            # SIGKILL: the socket goes with no Goodbye, what it had not read with it.
            super(WorkerLink, f.link).close()
            f.core.close()

            await _port_free(int(port))  # (the closed socket's unbind is asynchronous)
            loop = asyncio.get_running_loop()
            cfg = _config(int(port))
            metrics = RouterMetrics()
            link = WorkerLink(cfg.router, loop, SocketPump(loop), metrics)
            core = RouterCore(cfg, loop, link, metrics=metrics)
            link.serve(core)
            try:
                worker._send(wlink, p.Heartbeat(worker.stats(), worker.prefix_feed.seq))  # its heartbeat tick
                await _until(lambda: "w-a" in link.workers)
                assert link.workers["w-a"].reg.epoch == wlink.epoch != epoch  # registered again, to this process
                sink = FakeSink()
                handle = core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=8), sink)
                assert isinstance(handle, int), handle
                await _until(lambda: bool(sink.finals))
                assert (sink.finals[0].finish_reason, sink.finals[0].completion_tokens) == ("length", 8)
                assert worker._stale_dispatches == 0 and not core.jobs
            finally:
                core.close()
                link.close()

    asyncio.run(scenario())
