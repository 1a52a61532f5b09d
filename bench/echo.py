"""Canned-reply servers: the floor under every overhead measurement.

An HTTP server that answers any POST with a fixed 1-token completion, and a
ZeroMQ ROUTER that answers every Submit with one final Delta -- no router,
no worker, no parsing beyond framing.  Measuring the bench client against
them gives what the client and loopback alone cost on each path, so the
overhead scenario can say what weir itself adds.

    python -m bench.echo --http 127.0.0.1:PORT --zmq tcp://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import zmq

from shared import protocol as p
from shared.transport import SocketPump

_BODY = (b'{"id":"cmpl-echo","object":"text_completion","created":0,"model":"echo",'
         b'"choices":[{"index":0,"text":" tok","finish_reason":"length"}],'
         b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}')
_REPLY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)


class _Http(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_message_complete(self):
        self.transport.write(_REPLY)


def _zmq_echo(loop, addr: str) -> SocketPump:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(addr)
    pump = SocketPump(loop)

    def on_message(frames):
        msg = p.client_decoder.decode(frames[-1])
        if isinstance(msg, p.Submit):
            d = p.Delta(msg.request_id, text=" tok", num_tokens=1, finish_reason="length",
                        prompt_tokens=8, completion_tokens=1)
            pump.send(sock, [frames[0], p.encoder.encode(p.Outputs([d]))])

    pump.add(sock, on_message)
    return pump


async def serve(http: str, zmq_addr: str) -> None:
    loop = asyncio.get_running_loop()
    host, _, port = http.rpartition(":")
    server = await loop.create_server(_Http, host, int(port))
    pump = _zmq_echo(loop, zmq_addr)  # noqa: F841 (kept alive by this frame)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True)
    ap.add_argument("--zmq", required=True)
    a = ap.parse_args()
    import uvloop

    uvloop.run(serve(a.http, a.zmq))
