"""The direct-client frontend (router.client_frontend) on a real loopback
socket in this process, over the real lifecycle with fake workers: a client
that vanishes (no Cancel) while its request waits gives up its place -- the
router probes waiting clients once per heartbeat."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Callable

import msgspec
import zmq

from router.client_frontend import ClientFrontend
from shared import protocol as p
from shared.transport import SocketPump
from test_lifecycle import Harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spin(h: Harness, done: Callable[[], bool], timeout: float, what: str) -> None:
    """Run the router's loop until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        h.loop.run_until_complete(asyncio.sleep(0.01))


def test_queued_request_of_a_vanished_zeromq_client_is_dropped() -> None:
    h = Harness()  # heartbeat (and client probe) every 0.5 s
    ctx = zmq.Context()
    router_cfg = msgspec.structs.replace(h.core.cfg.router, frontend=f"tcp://127.0.0.1:{_free_port()}")
    frontend = ClientFrontend(router_cfg, h.loop, SocketPump(h.loop), h.core.metrics, ctx)
    frontend.serve(h.core)
    h.join("sim-a", seqs=1)  # one slot

    def submit(sock: zmq.Socket, rid: str) -> None:
        sock.send(p.encoder.encode(p.Submit(
            request_id=rid, model="sim-m", kind=p.RequestKind.COMPLETION, prompt="hold the slot",
            max_tokens=400)))

    def handle(identity: bytes, rid: str) -> int | None:
        return frontend.clients.get(identity, {}).get(rid)

    def queued() -> int:
        return sum(1 for job_id in h.core.jobs if h.workers.where(job_id) is None)

    holder, leaver = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s, identity in ((holder, b"holder"), (leaver, b"leaver")):
            s.setsockopt(zmq.IDENTITY, identity)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(router_cfg.frontend)
        submit(holder, "a")
        _spin(h, lambda: handle(b"holder", "a") is not None and h.workers.where("%x" % handle(b"holder", "a")),
              10, "a never ran")
        a = handle(b"holder", "a")
        h.tokens(a, 1)  # its first output: it holds the slot
        _spin(h, lambda: bool(holder.poll(0)), 10, "the holder never heard its first output")
        submit(leaver, "b")
        _spin(h, lambda: queued() == 1, 10, "b never queued")
        leaver.close()  # gone without a Cancel
        _spin(h, lambda: queued() == 0, 10, "the vanished client's request kept its place")
        # a is still being served: b left the queue, not a
        assert h.workers.where("%x" % a) == "sim-a" and "%x" % a in h.core.jobs
        assert not any(job_id == "%x" % a for _, job_id in h.workers.aborted)
        holder.send(p.encoder.encode(p.Cancel(request_ids=["a"])))
        _spin(h, lambda: not h.core.jobs, 10, "the holder's Cancel never arrived")
        assert h.reserved() == 0
    finally:
        holder.close()
        leaver.close()
        frontend.close()
        ctx.term()
        h.close()
