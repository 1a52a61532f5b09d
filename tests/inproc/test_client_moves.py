"""``shared.client`` with several routers (real loopback sockets, two
lifecycles in this process): a router that drains refuses new requests
with ``router_draining``, and the client sends them to its next router."""

from __future__ import annotations

import asyncio
import socket

import msgspec
import zmq
from fakes import FakeWorkers
from test_lifecycle import Harness, config

from router.ingress.zmq_clients import ClientFrontend
from router.lifecycle.core import RouterCore
from shared.client import AsyncClient
from shared.transport import SocketPump


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_request_refused_by_a_draining_router_is_served_by_the_next_one() -> None:
    h = Harness()  # the router that serves (a fake worker behind it)
    draining = RouterCore(config(), h.loop, FakeWorkers(), clock=h.clock)
    draining.draining = True
    ctx = zmq.Context()
    frontends = []
    for core in (draining, h.core):
        cfg = msgspec.structs.replace(core.cfg.router, frontend=f"tcp://127.0.0.1:{_free_port()}")
        fe = ClientFrontend(cfg, h.loop, SocketPump(h.loop), core.metrics, ctx)
        fe.serve(core)
        frontends.append(fe)
    h.join("w0")

    async def serve_when_dispatched() -> None:
        while not h.workers.dispatched.get("w0"):
            await asyncio.sleep(0.005)
        h.tokens(int(h.workers.dispatched["w0"][0].request_id, 16), 4, "length")

    async def main() -> tuple[str, str | None, str]:
        addresses = [fe.sock.getsockopt(zmq.LAST_ENDPOINT).decode() for fe in frontends if fe.sock is not None]
        async with AsyncClient(addresses) as c:
            feeder = asyncio.ensure_future(serve_when_dispatched())
            done = await asyncio.wait_for(c.complete("sim-m", prompt="hi", max_tokens=4), 10)
            await feeder
            return done.text, done.finish_reason, c.address

    try:
        text, finish, address = h.loop.run_until_complete(main())
        assert (text, finish) == (" t t t t", "length")
        assert address == frontends[1].sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # later ones go there too
        assert not draining.jobs and h.reserved() == 0
    finally:
        for fe in frontends:
            fe.close()
        draining.close()
        h.close()
        ctx.term()
