"""Direct ZeroMQ clients (``shared.client``): the frontend ROUTER socket.

A client sends Submit / Cancel; it gets Outputs carrying its own request
ids.  This adapter owns the socket and the table of clients' live requests
(identity -> client request id -> lifecycle handle), and finds out when a
client is gone:
  * its Cancel, or a send to it that fails (ROUTER_MANDATORY);
  * while its requests produce nothing yet (queued, prefilling), an empty
    Outputs once per heartbeat -- a probe that fails for a peer that left;
  * a client that stops reading until ZeroMQ's high-water mark (100,000
    messages) is treated as gone rather than left to hold every other
    client's output behind its own.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Protocol

import msgspec
import zmq

from router.fleet.router_socket import RouterSocket
from router.observe.metrics import RouterMetrics
from shared import protocol as p
from shared.config import Config, RouterConfig, SecurityConfig
from shared.errors import Code, error
from shared.transport import Outbox, SocketPump

if TYPE_CHECKING:  # (router.lifecycle.core imports the policy and the rest: not at run time)
    from router.lifecycle.core import RouterCore
    from router.lifecycle.ports import RequestSink

log = logging.getLogger("weir.router.clients")

# Sent to a client whose requests have produced nothing yet: a send to a peer
# that has gone fails (ROUTER_MANDATORY), and its requests are cancelled.
_PROBE = p.encoder.encode(p.Outputs(deltas=[]))
_SUBMIT_TAG = 1
_SUBMIT_FIELDS = msgspec.structs.fields(p.Submit)
_PARAM_FIELDS = msgspec.structs.fields(p.SamplingParams)
_AT = re.compile(r" - at `\$((?:\[\d+\])+)`$")


class ClientJobs(Protocol):
    """What this frontend needs of the lifecycle for its clients' requests
    (router.lifecycle.core.RouterCore): submit, cancel, and whether one has
    produced nothing yet (probed for a client that left)."""

    def submit(self, sub: p.Submit, sink: RequestSink) -> int | p.ErrorInfo: ...

    def cancel(self, handle: int) -> None: ...

    def awaiting_output(self, handle: int) -> bool: ...


def client_message_bytes(cfg: Config) -> int:
    """The largest message a direct client may send: twice an HTTP request's
    body limit (``envoy.max_request_bytes``; msgpack may spell a field longer
    than JSON), and 64 KiB at least."""
    return max(2 * cfg.envoy.max_request_bytes, 64 << 10)


class ClientFrontend(RouterSocket):
    side = "frontend"
    # A client's identity is all that binds it to its replies and Cancels, and
    # libzmq generates them predictably (0x00 + a counter from random()'s
    # unseeded first value): with handover, a peer setting one as its own
    # would take over another tenant's outputs.  Clients do not choose theirs
    # (shared.client), so a reconnecting one gets a fresh identity anyway.
    handover = False

    def __init__(
        self,
        cfg: RouterConfig,
        loop: asyncio.AbstractEventLoop,
        pump: SocketPump,
        metrics: RouterMetrics,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        *,
        security: SecurityConfig | None = None,
        base_dir: str = "",
        max_message_bytes: int = -1,
    ) -> None:
        super().__init__(cfg, loop, pump, metrics, ctx, security=security, base_dir=base_dir)
        # libzmq reads a message whole before it hands it over: without a bound one
        # client's multi-GB Submit would be in router memory (HTTP bodies stop at
        # envoy.max_request_bytes); a peer sending more is disconnected unread.
        self.max_message_bytes = max_message_bytes
        self.core: ClientJobs  # set by serve(), before the socket can deliver anything
        self.clients: dict[bytes, dict[str, int]] = {}  # identity -> client request id -> handle
        self.outbox = Outbox(loop, self._flush_to)

    def serve(self, core: ClientJobs) -> None:
        self.core = core
        self._bind(self._on_message, self._probe_tick, on_unreachable=self._lose_client, on_full=self._on_full)

    # ------------------------------------------------------------ input

    def _on_message(self, frames: list[bytes]) -> None:
        decoded = self._decode(frames, p.client_decoder, self._answer_invalid_submit)
        if decoded is None:
            return
        identity, msg = decoded
        if isinstance(msg, p.Submit):
            self._submit(identity, msg)
        else:  # Cancel
            live = self.clients.get(identity)
            if live:
                for rid in msg.request_ids:
                    handle = live.pop(rid, None)
                    if handle is not None:
                        self.core.cancel(handle)

    def _submit(self, identity: bytes, sub: p.Submit) -> None:
        live = self.clients.setdefault(identity, {})
        client_rid = sub.request_id
        if client_rid in live:
            err = error(Code.BAD_REQUEST, f"request_id {client_rid!r} is already in flight", param="request_id")
        else:
            result = self.core.submit(sub, _ClientSink(self, identity, client_rid))
            if isinstance(result, int):
                live[client_rid] = result
                return
            err = result
        if not live:
            del self.clients[identity]
        self.outbox.put(identity, p.Delta(request_id=client_rid, error=err))

    def _answer_invalid_submit(self, frames: list[bytes], e: msgspec.ValidationError) -> None:
        """A Submit that fails validation (a value out of range, a wrong type)
        but still names its request id gets a 400 naming the field, not silence."""
        identity, payload = bytes(frames[0]), frames[1]
        try:
            raw = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            return
        if not (isinstance(raw, list) and len(raw) > 1 and raw[0] == _SUBMIT_TAG and isinstance(raw[1], str)):
            return
        message, param = _explain(str(e))
        self.outbox.put(identity, p.Delta(request_id=raw[1], error=error(Code.BAD_REQUEST, message, param=param)))

    # ------------------------------------------------------------ output

    def _flush_to(self, identity: bytes, deltas: list[p.Delta]) -> None:
        if self.sock is not None:
            self.pump.send(self.sock, [identity, p.encoder.encode(p.Outputs(deltas=deltas))])

    def _probe_tick(self) -> None:
        """A client hears nothing while its requests queue or prefill, so one
        that died meanwhile (no Cancel) would keep its place and, later, a
        worker busy: probe each such client once per heartbeat."""
        sock = self.sock
        if sock is None:  # (never: the timer runs while the socket is bound)
            return
        awaiting = self.core.awaiting_output
        for identity, live in list(self.clients.items()):
            if any(awaiting(h) for h in live.values()):
                self.pump.send(sock, [identity, _PROBE])

    def _on_full(self, identity: bytes) -> None:
        if identity in self.clients:
            log.warning("client %r stopped reading (send queue full): cancelling its requests", identity[:16])
            self._lose_client(identity)

    def _lose_client(self, identity: bytes) -> None:
        live = self.clients.pop(identity, {})
        if live:
            log.info("client %r gone: cancelling %d requests", identity[:16], len(live))
        for handle in live.values():
            self.core.cancel(handle)


class _ClientSink:
    """Delivers a job's deltas to a direct client under the client's own id."""

    __slots__ = ("frontend", "identity", "client_rid")

    def __init__(self, frontend: ClientFrontend, identity: bytes, client_rid: str) -> None:
        self.frontend, self.identity, self.client_rid = frontend, identity, client_rid

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        put = self.frontend.outbox.put
        for d in deltas:
            d.request_id = self.client_rid
            put(self.identity, d)
        if deltas[-1].finished:
            clients = self.frontend.clients
            live = clients.get(self.identity)
            if live is not None:
                live.pop(self.client_rid, None)
                if not live:
                    del clients[self.identity]


def _explain(text: str) -> tuple[str, str | None]:
    """msgspec's "Expected `float` <= 2.0 - at `$[6][1]`" on an array-like
    Submit -> ("Expected `float` <= 2.0 (at 'params.temperature')", that path)."""
    at = _AT.search(text)
    if at is None:
        return text, None
    index = [int(i) for i in re.findall(r"\d+", at.group(1))]
    names: list[str] = []
    fields: tuple[msgspec.structs.FieldInfo, ...] | None = _SUBMIT_FIELDS
    for depth, i in enumerate(index):
        if depth == 0:
            i -= 1  # position 0 is the tag
        if fields is None or not 0 <= i < len(fields):
            names.append(str(i))
            fields = None
            continue
        f = fields[i]
        names.append(f.name)
        fields = _PARAM_FIELDS if f.name == "params" else None
    param = ".".join(names)
    return f"{text[: at.start()]} (at '{param}')", param


if TYPE_CHECKING:  # each side of the frontend's two ports, checked where the port is read
    _jobs: type[ClientJobs] = RouterCore  # what this frontend asks of the lifecycle
    _sink: type[RequestSink] = _ClientSink  # how the lifecycle answers a direct client
