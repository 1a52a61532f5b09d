"""Canned-reply servers: the floor under every overhead measurement.

An HTTP server that answers any POST with a fixed 1-token completion, and a
ZeroMQ ROUTER that answers every Submit with one final Delta -- no router,
no worker, no parsing beyond framing.  Measuring the bench client against
them gives what the client and loopback alone cost on each path, so the
overhead scenario can say what weir itself adds.

The relay floor is weir's ZeroMQ topology with nothing in it: a relay
process (a ROUTER for clients, a ROUTER for workers) that forwards frames
unread, and a worker process (a DEALER) that answers each Submit with one
final Delta -- four ZeroMQ hops and two extra processes, as a direct
request to weir takes, with none of weir's work.

    python -m bench.echo --http 127.0.0.1:PORT --zmq tcp://127.0.0.1:PORT
    python -m bench.echo --relay tcp://127.0.0.1:FRONT,tcp://127.0.0.1:BACK
    python -m bench.echo --worker tcp://127.0.0.1:BACK
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import zmq

from shared import protocol as p
from shared.transport import SocketPump

_BODY = (
    b'{"id":"cmpl-echo","object":"text_completion","created":0,"model":"echo",'
    b'"choices":[{"index":0,"text":" tok","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}'
)
_REPLY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)


class _Http(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_message_complete(self):
        self.transport.write(_REPLY)


def _answer(payload: bytes) -> bytes | None:
    """The canned reply to a client message: one final Delta for a Submit."""
    msg = p.client_decoder.decode(payload)
    if not isinstance(msg, p.Submit):
        return None
    d = p.Delta(msg.request_id, text=" tok", num_tokens=1, finish_reason="length", prompt_tokens=8, completion_tokens=1)
    return p.encoder.encode(p.Outputs([d]))


def _zmq_echo(loop, addr: str) -> SocketPump:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(addr)
    pump = SocketPump(loop)

    def on_message(frames):
        reply = _answer(frames[-1])
        if reply is not None:
            pump.send(sock, [frames[0], reply])

    pump.add(sock, on_message)
    return pump


def _relay(loop, front_addr: str, back_addr: str) -> SocketPump:
    """Client frames to the one worker and back, unread: [client, payload]
    -> [worker, client, payload]; [worker, client, reply] -> [client, reply]."""
    ctx = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.bind(front_addr)
    back.bind(back_addr)
    pump = SocketPump(loop)
    workers: list[bytes] = []

    def from_client(frames):
        if workers:
            pump.send(back, [workers[0], *frames])

    def from_worker(frames):
        if len(frames) == 2:  # the worker's hello
            workers[:] = [frames[0]]
        else:
            pump.send(front, frames[1:])

    pump.add(front, from_client)
    pump.add(back, from_worker)
    return pump


def _worker(loop, back_addr: str) -> SocketPump:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(back_addr)
    pump = SocketPump(loop)

    def on_message(frames):
        client, payload = frames
        reply = _answer(payload)
        if reply is not None:
            pump.send(sock, [client, reply])

    pump.add(sock, on_message)
    pump.send(sock, [b"hello"])
    return pump


async def serve(a: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    pumps = []  # kept alive by this frame
    if a.zmq:
        pumps.append(_zmq_echo(loop, a.zmq))
    if a.relay:
        front, back = a.relay.split(",")
        pumps.append(_relay(loop, front, back))
    if a.worker:
        pumps.append(_worker(loop, a.worker))
    if a.http:
        host, _, port = a.http.rpartition(":")
        server = await loop.create_server(_Http, host, int(port))
        async with server:
            await server.serve_forever()
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", help="HOST:PORT for the canned HTTP server")
    ap.add_argument("--zmq", help="the canned ROUTER's endpoint")
    ap.add_argument("--relay", help="FRONT,BACK: the relay floor's two ROUTER endpoints")
    ap.add_argument("--worker", help="BACK: the relay floor's worker, connecting there")
    import uvloop

    uvloop.run(serve(ap.parse_args()))
