"""SocketPump and Outbox on real ZeroMQ sockets and a real uvloop loop.

The pump's correctness hinges on ZeroMQ's edge-triggered FD: a send (or an
EVENTS check) can consume the "readable" signal, and a pump that then waits on
the FD waits forever.  These tests would hang -- and time out -- on a lost
wake-up, and check order, back-pressure and unreachable peers.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
import zmq

from shared.transport import Outbox, SocketPump

pytestmark = pytest.mark.timeout(60)


def _pair(ctx: zmq.Context, router_opts: dict | None = None, **opts) -> tuple[zmq.Socket, zmq.Socket]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    for k, v in (router_opts or {}).items():
        router.setsockopt(getattr(zmq, k), v)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        dealer.setsockopt(getattr(zmq, k), v)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def _run(coro):
    return uvloop.run(asyncio.wait_for(coro, 30))


def test_ping_pong_never_loses_a_wakeup():
    """Thousands of strictly sequential round trips, each answered from inside
    the receive handler (the send that can eat the readable edge), then a burst
    larger than one drain budget."""

    async def main():
        ctx = zmq.Context()
        router, dealer = _pair(ctx)
        loop = asyncio.get_running_loop()
        pump = SocketPump(loop)
        got: asyncio.Queue = asyncio.Queue()
        pump.add(router, lambda frames: pump.send(router, frames))  # echo at once
        pump.add(dealer, lambda frames: got.put_nowait(frames[0]))
        for i in range(3000):
            pump.send(dealer, [b"%d" % i])
            assert await got.get() == b"%d" % i
        for i in range(5000):
            pump.send(dealer, [b"burst %d" % i])
        assert [await got.get() for _ in range(5000)] == [b"burst %d" % i for i in range(5000)]
        pump.remove(router)
        pump.remove(dealer)
        ctx.destroy(linger=0)

    _run(main())


def test_backlog_keeps_order_until_the_peer_reads():
    """Past the high-water mark sends queue in the pump (never block the loop)
    and leave in order as room appears -- which ZeroMQ signals with the same
    edge-triggered FD, so a pump that misses one such edge stalls for good."""

    async def main():
        ctx = zmq.Context()
        router, dealer = _pair(ctx, {"RCVHWM": 10, "RCVBUF": 4096}, SNDHWM=10, SNDBUF=4096)
        loop = asyncio.get_running_loop()
        pump = SocketPump(loop)
        pump.add(dealer, lambda frames: None)
        n = 1000
        payloads = [b"%06d" % i + b"x" * 4090 for i in range(n)]
        for payload in payloads:
            pump.send(dealer, [payload])  # returns at once, the peer not reading
        await asyncio.sleep(0.2)
        assert len(pump._backlog[dealer]) > n // 2, "small buffers and HWMs should hold most of it back"
        received = []
        while len(received) < n:  # the peer reads; the pump flushes its backlog as room appears
            try:
                received.append(router.recv_multipart(zmq.NOBLOCK)[1])
            except zmq.Again:
                await asyncio.sleep(0.001)
        assert received == payloads
        assert not pump._backlog[dealer]
        pump.remove(dealer)
        ctx.destroy(linger=0)

    _run(main())


def test_backlog_drains_when_room_opens_during_a_flush():
    """A burst far past SNDHWM: ZeroMQ's I/O thread frees room while the pump
    is still flushing, and the "room again" command is then consumed by the
    pump's own send/EVENTS calls -- the FD never fires for it.  The pump must
    notice by itself, or the backlog stays stuck forever (it did)."""

    async def main():
        ctx = zmq.Context()
        router, dealer = _pair(ctx, SNDHWM=10)
        loop = asyncio.get_running_loop()
        pump = SocketPump(loop)
        pump.add(dealer, lambda frames: None)
        await asyncio.sleep(0.1)  # connected: the I/O thread drains the pipe as fast as we fill it
        n = 5000
        for i in range(n):
            pump.send(dealer, [b"%d" % i])
        for _ in range(500):
            if not pump._backlog[dealer]:
                break
            await asyncio.sleep(0.01)
        assert not pump._backlog[dealer], f"{len(pump._backlog[dealer])} messages stuck in the backlog"
        received = [router.recv_multipart()[1] for _ in range(n)]
        assert received == [b"%d" % i for i in range(n)]
        pump.remove(dealer)
        ctx.destroy(linger=0)

    _run(main())


def test_router_reports_an_unknown_peer_instead_of_dropping():
    async def main():
        ctx = zmq.Context()
        router, dealer = _pair(ctx)
        pump = SocketPump(asyncio.get_running_loop())
        gone = []
        pump.add(router, lambda frames: None, on_unreachable=gone.append)
        pump.send(router, [b"nobody", b"hello"])
        assert gone == [b"nobody"]
        pump.remove(router)
        ctx.destroy(linger=0)

    _run(main())


def test_a_peer_that_stops_reading_is_dropped_not_queued_ahead_of_others():
    """On a ROUTER with an ``on_full`` callback, a peer at its high-water mark has its
    messages dropped (and reported), so the next peer's go out at once; with
    the default backlog they would wait behind the stuck peer's forever."""

    async def main():
        ctx = zmq.Context()
        router, stuck = _pair(ctx, {"SNDHWM": 10, "SNDBUF": 4096}, RCVHWM=1, RCVBUF=4096, IDENTITY=b"stuck")
        reader = ctx.socket(zmq.DEALER)
        reader.setsockopt(zmq.LINGER, 0)
        reader.setsockopt(zmq.IDENTITY, b"reader")
        reader.connect(router.getsockopt(zmq.LAST_ENDPOINT).decode())
        for d in (stuck, reader):  # the ROUTER learns both identities
            d.send(b"hello")
            router.recv_multipart()
        pump = SocketPump(asyncio.get_running_loop())
        full = []
        pump.add(router, lambda frames: None, on_full=full.append)
        for _ in range(1000):
            pump.send(router, [b"stuck", b"x" * 4096])
        assert full and set(full) == {b"stuck"}
        assert not pump._backlog[router]
        pump.send(router, [b"reader", b"still served"])
        assert reader.poll(5000) and reader.recv() == b"still served"
        pump.remove(router)
        ctx.destroy(linger=0)

    _run(main())


def test_read_now_handles_a_message_whose_readable_edge_was_lost():
    """A liveness check reads the socket before it judges the peer silent: a
    message whose FD edge something else consumed (here an EVENTS check made
    outside the pump) waits unannounced until then, and is handled then."""

    async def main():
        ctx = zmq.Context()
        router, dealer = _pair(ctx)
        loop = asyncio.get_running_loop()
        pump = SocketPump(loop)
        got: list[bytes] = []
        pump.add(dealer, lambda frames: got.append(frames[0]))
        await asyncio.sleep(0.05)  # the pump's first drain ran; the connection is up
        assert pump.read_now(dealer) == 0
        pump.send(dealer, [b"hello"])
        await asyncio.sleep(0.05)
        peer = router.recv_multipart()[0]
        router.send_multipart([peer, b"news"])
        time.sleep(0.2)  # noqa: ASYNC251  the loop blocked on purpose: the message arrives meanwhile, its FD signalled
        assert dealer.get(zmq.EVENTS) & zmq.POLLIN  # ... and this consumes the signal
        await asyncio.sleep(0.3)
        assert got == []  # the FD never fired: the edge is lost
        assert pump.read_now(dealer) == 1
        assert got == [b"news"]
        pump.remove(dealer)
        ctx.destroy(linger=0)

    _run(main())


def test_outbox_flushes_each_destination_once_per_turn():
    async def main():
        loop = asyncio.get_running_loop()
        flushed = []
        box = Outbox(loop, lambda dest, items: flushed.append((dest, list(items))))
        for item in ("a1", "a2", "a3"):
            box.put("A", item)
        box.put("B", "b1")
        box.put("B", "b2")
        assert flushed == []  # nothing before the turn ends
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sorted(flushed) == [("A", ["a1", "a2", "a3"]), ("B", ["b1", "b2"])]
        box.put("A", "a4")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert flushed[-1] == ("A", ["a4"])

    _run(main())
