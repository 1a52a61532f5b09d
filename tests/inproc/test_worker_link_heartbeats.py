"""The router's heartbeats to its workers, on a real backend socket in this
process with DEALERs as the workers: a tick sends them a slice per loop turn
(a large fleet's heartbeats in one callback held the loop), every linked
worker still gets one, and one that leaves between slices gets none."""

from __future__ import annotations

import asyncio
import socket
import time

import zmq

from router.fleet import worker_link
from router.fleet.worker_link import WorkerLink
from router.observe.metrics import RouterMetrics
from shared.config import RouterConfig
from shared.protocol import Heartbeat, Pool, Register, encoder, to_worker_decoder
from shared.transport import SocketPump


class Events:  # the lifecycle's side: only what a tick and a registration ask
    def serves(self, model):
        return True

    def worker_joined(self, reg):
        pass

    def worker_stats(self, *a, **k):
        pass

    def running_on(self, worker_id):
        return []

    def worker_left(self, *a):
        pass


class CountingPump(SocketPump):
    def __init__(self, loop):
        super().__init__(loop)
        self.sent: list[bytes] = []  # identities, in the order sent

    def send(self, sock, frames):
        self.sent.append(bytes(frames[0]))
        super().send(sock, frames)


def test_a_tick_heartbeats_every_worker_a_slice_per_loop_turn(monkeypatch):
    monkeypatch.setattr(worker_link, "HEARTBEATS_PER_TURN", 4)
    n = 10

    async def scenario():
        loop = asyncio.get_running_loop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pump = CountingPump(loop)
        # a long interval: only the ticks this test runs
        cfg = RouterConfig(backend=f"tcp://127.0.0.1:{port}", heartbeat_interval_s=60)
        link = WorkerLink(cfg, loop, pump, RouterMetrics())
        link.serve(Events())
        ctx = zmq.Context()
        dealers = []
        try:
            for i in range(n):
                dealers.append(registered_worker(ctx, port, f"w-{i}"))
            for _ in range(500):
                if len(link.workers) == n:
                    break
                await asyncio.sleep(0.01)
            assert len(link.workers) == n
            for d in dealers:  # the heartbeat that answers a registration
                assert isinstance(to_worker_decoder.decode(await recv(d)), Heartbeat)
            pump.sent.clear()
            # (the table's order is the order the registrations arrived in, not the connects')
            order = [w.encode() for w in link.workers]
            gone = order[5]

            link._heartbeat_tick()
            assert pump.sent == order[:4]  # one slice in the tick's own turn
            link._remove(link.workers[gone.decode()], "goodbye")  # leaves before its slice goes out
            await asyncio.sleep(0)
            assert pump.sent == order[:5] + order[6:8]  # the next slice, less the one that left
            for _ in range(3):
                await asyncio.sleep(0)
            assert pump.sent == order[:5] + order[6:]
            for i, d in enumerate(dealers):
                if f"w-{i}".encode() != gone:
                    assert isinstance(to_worker_decoder.decode(await recv(d)), Heartbeat)
            await asyncio.sleep(0.05)
            assert not dealers[int(gone[2:])].poll(0)  # a worker that left got no heartbeat
        finally:
            link.close()
            for d in dealers:
                d.close(0)
            ctx.term()

    asyncio.run(scenario())


def registered_worker(ctx: zmq.Context, port: int, worker_id: str) -> zmq.Socket:
    """A stand-in worker: a DEALER on the backend socket that has sent its Register."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.IDENTITY, worker_id.encode())
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{port}")
    reg = Register(
        worker_id=worker_id,
        model="m",
        pool=Pool.ANY,
        max_model_len=64,
        kv_capacity_tokens=64,
        block_size=16,
        max_num_seqs=2,
        engine="sim",
    )
    d.send(encoder.encode(reg))
    return d


async def recv(d: zmq.Socket, timeout_s: float = 5.0) -> bytes:
    for _ in range(int(timeout_s / 0.01)):
        if d.poll(0):
            return d.recv()
        await asyncio.sleep(0.01)
    raise AssertionError("no message")


def test_a_tick_reads_the_socket_before_it_declares_a_worker_lost():
    # A worker's heartbeat waits on the backend socket but its readable edge
    # was consumed elsewhere (here an EVENTS check outside the pump): the FD
    # never fires for it, and the tick must read it rather than drop the worker.
    async def scenario():
        loop = asyncio.get_running_loop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pump = SocketPump(loop)
        cfg = RouterConfig(backend=f"tcp://127.0.0.1:{port}", heartbeat_interval_s=60, heartbeat_liveness=1)
        link = WorkerLink(cfg, loop, pump, RouterMetrics())
        link.serve(Events())
        ctx = zmq.Context()
        d = registered_worker(ctx, port, "w-0")
        try:
            assert isinstance(to_worker_decoder.decode(await recv(d)), Heartbeat)  # registered
            link._heartbeat_tick()  # the tick the next one judges from
            assert isinstance(to_worker_decoder.decode(await recv(d)), Heartbeat)
            await asyncio.sleep(0.05)  # the drain its send scheduled has run
            d.send(encoder.encode(Heartbeat()))
            time.sleep(0.2)  # noqa: ASYNC251 -- the loop blocked on purpose: the heartbeat arrives meanwhile
            assert link.sock is not None and link.sock.get(zmq.EVENTS) & zmq.POLLIN  # ... its edge consumed
            await asyncio.sleep(0.1)
            assert link.workers["w-0"].last_seen < link._last_tick  # unheard: the FD never fired
            link._heartbeat_tick()
            assert "w-0" in link.workers  # read at the tick: heard, not lost
        finally:
            link.close()
            d.close(0)
            ctx.term()

    asyncio.run(scenario())
