"""ZeroMQ sockets driven from asyncio by one owner ("pump"), plus per-destination batching.

Why not ``await sock.recv()`` per message: measured here, one reader callback
on the socket's FD that drains everything non-blockingly carried ~5x the
traffic of per-message awaits.

ZeroMQ's FD is edge-triggered and a *send* may consume the "readable" edge, so
after every send (and after every drain) we re-check ``ZMQ_EVENTS`` and
schedule another drain if input is pending.

Costs that shaped the code (pyzmq 27, this VM): ``get(EVENTS)`` ~1.7 us, a
``recv`` that raises ``zmq.Again`` ~3.9 us (the exception object), a copying
``send`` of a small frame ~1 us in a burst and ~7 us when it has to wake the
IO thread -- cheaper than ``copy=False``, whose zero-copy bookkeeping only
pays off for frames of tens of kB.  Option and flag constants are plain ints:
pyzmq's enums cost ~1 us per operation.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar, cast

import msgspec
import zmq

log = logging.getLogger(__name__)

_DRAIN_BUDGET = 512  # messages per socket per loop turn, so one socket can't starve the loop
# Messages received per drain before relying on ``zmq.Again`` to find the end:
# a lone message (the common case at low load) then costs two EVENTS checks
# instead of a raised Again, a burst costs one Again instead of an EVENTS check each.
_CHECKED_RECVS = 2

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EHOSTUNREACH = zmq.EHOSTUNREACH

_T = TypeVar("_T")
_Dest = TypeVar("_Dest", bound=Hashable)
_Item = TypeVar("_Item")

PeerCallback = Callable[[bytes], None]  # called with a ROUTER peer's identity


class SocketPump:
    """Owns zmq sockets on one asyncio loop; the only code that touches them."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_event_loop()
        self._handlers: dict[zmq.Socket[bytes], Callable[[list[bytes]], None]] = {}
        self._backlog: dict[zmq.Socket[bytes], collections.deque[list[bytes]]] = {}
        self._drain_scheduled: set[zmq.Socket[bytes]] = set()
        # per socket: what to call with a ROUTER peer's identity when it is gone / full
        self._on_unreachable: dict[zmq.Socket[bytes], PeerCallback] = {}
        self._on_full: dict[zmq.Socket[bytes], PeerCallback] = {}

    def add(
        self,
        sock: zmq.Socket[bytes],
        on_message: Callable[[list[bytes]], None],
        *,
        on_unreachable: PeerCallback | None = None,
        on_full: PeerCallback | None = None,
    ) -> None:
        """Own ``sock``; its owner's callbacks say what each event means for it.

        ``on_unreachable(identity)`` (ROUTER with ROUTER_MANDATORY): a send
        found that peer gone.  ``on_full(identity)`` (ROUTER): a message for a
        peer whose queue is at the high-water mark is dropped and this called,
        instead of queueing in the pump -- where it would hold up every other
        peer's messages behind one that stopped reading.  Without ``on_full``
        such messages wait in order (a peer with liveness of its own)."""
        self._handlers[sock] = on_message
        if on_unreachable is not None:
            self._on_unreachable[sock] = on_unreachable
        if on_full is not None:
            self._on_full[sock] = on_full
        self._backlog[sock] = collections.deque()
        self.loop.add_reader(sock.fileno(), self._on_fd, sock)
        self._schedule_drain(sock)  # messages may have queued before we watched the FD

    def remove(self, sock: zmq.Socket[bytes]) -> None:
        if sock in self._handlers:
            self.loop.remove_reader(sock.fileno())
            del self._handlers[sock]
            del self._backlog[sock]
            self._on_unreachable.pop(sock, None)
            self._on_full.pop(sock, None)

    def send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Send now if the socket takes it, else queue until it does (order kept)."""
        backlog = self._backlog[sock]
        if backlog:
            backlog.append(frames)
        else:
            self._try_send(sock, frames)
        self._schedule_drain(sock)

    def read_now(self, sock: zmq.Socket[bytes]) -> int:
        """Handle whatever waits on ``sock`` now, without waiting for its FD;
        returns how many messages that was.  For liveness checks: a peer is
        declared silent only after its socket was read, so a readable edge
        lost anywhere (a send elsewhere that processed it, say) costs one
        check's delay instead of a reconnect."""
        return self._drain(sock)

    # -- internals ---------------------------------------------------------

    def _try_send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
        try:
            if len(frames) == 1:
                sock.send(frames[0], _NOBLOCK)
            else:
                # ROUTER checks room and the peer on the first part; once that is
                # accepted the rest of the message always is.
                last = len(frames) - 1
                for i, f in enumerate(frames):
                    sock.send(f, _NOBLOCK if i == last else _NOBLOCK | _SNDMORE)
            return True
        except zmq.Again:
            on_full = self._on_full.get(sock)
            if on_full is not None and len(frames) > 1:
                on_full(bytes(frames[0]))
                return True
            self._backlog[sock].append(frames)
            return False
        except zmq.ZMQError as e:
            if e.errno == _EHOSTUNREACH:  # ROUTER_MANDATORY: that peer is gone
                on_unreachable = self._on_unreachable.get(sock)
                if on_unreachable is not None:
                    on_unreachable(bytes(frames[0]))
                return True
            raise

    def _on_fd(self, sock: zmq.Socket[bytes]) -> None:
        self._drain(sock)

    def _schedule_drain(self, sock: zmq.Socket[bytes]) -> None:
        if sock not in self._drain_scheduled and sock in self._handlers:
            self._drain_scheduled.add(sock)
            self.loop.call_soon(self._drain, sock)

    def _drain(self, sock: zmq.Socket[bytes]) -> int:
        self._drain_scheduled.discard(sock)
        handler = self._handlers.get(sock)
        if handler is None:
            return 0
        backlog = self._backlog[sock]
        recv = sock.recv_multipart
        # EVENTS is an int option (pyzmq types every option's value as int | bytes)
        get = cast("Callable[[int], int]", sock.get)
        n = 0
        try:
            events = get(_EVENTS)
            while True:
                if backlog and events & _POLLOUT:
                    while backlog:
                        frames = backlog.popleft()
                        if not self._try_send(sock, frames):
                            # _try_send re-queued it at the tail; put it back in front
                            backlog.appendleft(backlog.pop())
                            break
                    # The sends (and this check) may have processed the peer's
                    # "room again" or "input ready" command: the FD will not
                    # fire for it, so look again instead of waiting.
                    events = get(_EVENTS)
                    continue
                if not events & _POLLIN:
                    return n
                while True:
                    try:
                        frames = recv(_NOBLOCK)
                    except zmq.Again:
                        break  # as final as an EVENTS check: recv processed the pending commands
                    n += 1
                    try:
                        handler(frames)
                    except Exception:  # a bad message must never kill the pump
                        log.exception("error handling message")
                    if sock not in self._handlers:
                        return n  # the handler removed (and maybe closed) the socket
                    if n < _CHECKED_RECVS:
                        if not get(_EVENTS) & _POLLIN:
                            break  # every pending command seen: the FD fires for new input
                    elif n >= _DRAIN_BUDGET:
                        self._schedule_drain(sock)  # let other work run; carry on next turn
                        return n
                if not backlog:
                    return n
                events = get(_EVENTS)  # a send is waiting: did room open meanwhile?
        except zmq.ZMQError:
            return n  # closed under us


class Outbox(Generic[_Dest, _Item]):
    """Collects items per destination and flushes them once per loop turn.

    ``flush_fn(dest, items)`` is called with every item queued for ``dest``
    since the last flush, so each destination gets one message per turn.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, flush_fn: Callable[[_Dest, list[_Item]], None]) -> None:
        self.loop = loop
        self.flush_fn = flush_fn
        self._pending: dict[_Dest, list[_Item]] = {}
        self._scheduled = False

    def put(self, dest: _Dest, item: _Item) -> None:
        items = self._pending.get(dest)
        if items is None:
            self._pending[dest] = [item]
        else:
            items.append(item)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for dest, items in pending.items():
            try:
                self.flush_fn(dest, items)
            except Exception:
                log.exception("flush to %r failed", dest)


def bind_router(
    ctx: zmq.Context[zmq.Socket[bytes]],
    addr: str,
    configure: Callable[[zmq.Socket[bytes]], None] | None = None,
    handover: bool = True,
    max_message_bytes: int = -1,
) -> zmq.Socket[bytes]:
    """A ROUTER socket as the router's two planes use it, bound to ``addr``;
    ``configure`` sets options that must precede the bind (CURVE: shared.curve).
    ``handover``: a peer that connects with an identity in use takes it over
    (workers reconnecting under their id); without it, that peer is refused.
    ``max_message_bytes``: a peer sending a larger message is disconnected
    before it is read whole (-1: no bound)."""
    s = ctx.socket(zmq.ROUTER)
    if configure is not None:
        configure(s)
    s.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # tell us when a peer is gone instead of dropping
    s.setsockopt(zmq.ROUTER_HANDOVER, 1 if handover else 0)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    s.bind(addr)
    return s


def split_routed(frames: list[bytes], decoder: msgspec.msgpack.Decoder[_T]) -> tuple[bytes, _T]:
    """(identity, message) of a ROUTER socket's ``[identity, payload]``;
    ValueError / msgspec.DecodeError for anything else."""
    if len(frames) != 2:
        raise ValueError(f"{len(frames)} frames")
    identity, payload = frames
    return bytes(identity), decoder.decode(payload)
