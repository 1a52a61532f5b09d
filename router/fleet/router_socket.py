"""What the router's two ZeroMQ adapters share: one ROUTER socket and one timer each.

``router.fleet.worker_link`` (the backend) and ``router.ingress.zmq_clients`` (the
frontend) each own one bound ROUTER socket -- with CURVE where ``[security]``
turns it on -- driven by the process's one SocketPump, and one periodic
timer (heartbeats; client probes).  This base binds, ticks and closes them,
and drops (counted, logged) whatever arrives that is not a message of its side.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec
import zmq

from router.observe.metrics import RouterMetrics
from shared.config import RouterConfig, SecurityConfig
from shared.transport import SocketPump, bind_router, split_routed

log = logging.getLogger("weir.router")

_Msg = TypeVar("_Msg")  # the messages one side's decoder gives


class RouterSocket:
    side = ""  # "frontend" | "backend": its address in RouterConfig and its ZAP domain
    handover = True  # a peer connecting with an identity in use takes it over (shared.transport.bind_router)
    max_message_bytes = -1  # a larger message disconnects its peer before it is read whole (-1: none)

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
    ) -> None:
        self.cfg = cfg
        self.security, self.base_dir = security, base_dir  # CURVE (shared.curve): [security]
        self.loop = loop
        self.pump = pump
        self.metrics = metrics
        self.ctx = ctx or zmq.Context.instance()
        self.sock: zmq.Socket[bytes] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _bind(
        self, on_message: Callable[[list[bytes]], None], tick: Callable[[], None], **callbacks: Callable[[bytes], None]
    ) -> None:
        """Bind this side's socket, let the pump drive it, start its timer."""
        addr = getattr(self.cfg, self.side)
        self.sock = bind_router(self.ctx, addr, self._curve(), self.handover, self.max_message_bytes)
        self.pump.add(self.sock, on_message, **callbacks)
        self._tick = tick
        self._timer = self.loop.call_later(self.cfg.heartbeat_interval_s, self._on_timer)

    def _curve(self) -> Callable[[zmq.Socket[Any]], None] | None:
        """CURVE set-up for this side's socket (shared.curve), or None."""
        if self.security is None or not self.security.curve:
            return None
        from shared import curve

        d = Path(self.base_dir or ".") / os.path.expanduser(self.security.curve_dir)
        denied = self.metrics.auth_denied
        return curve.server_configure(
            self.ctx, d.resolve(), self.side, lambda domain, _name: self.metrics.child(denied, domain).inc()
        )

    def _decode(
        self,
        frames: list[bytes],
        decoder: msgspec.msgpack.Decoder[_Msg],
        on_invalid: Callable[[list[bytes], msgspec.ValidationError], None] | None = None,
    ) -> tuple[bytes, _Msg] | None:
        """(identity, message) of a ROUTER socket's frames, or None: what does
        not decode is counted, logged and dropped (``on_invalid(frames, error)``
        may still answer a message that decodes but fails validation)."""
        try:
            # (split_routed is typed to return an object: the message is what ``decoder`` decodes)
            return cast("tuple[bytes, _Msg]", split_routed(frames, decoder))
        except (ValueError, msgspec.DecodeError) as e:
            self.metrics.child(self.metrics.bad_frames, self.side).inc()
            log.warning("%s: dropped malformed message: %s", self.side, e)
            if on_invalid is not None and len(frames) == 2 and isinstance(e, msgspec.ValidationError):
                on_invalid(frames, e)
            return None

    def _on_timer(self) -> None:
        self._tick()
        self._timer = self.loop.call_later(self.cfg.heartbeat_interval_s, self._on_timer)

    def close(self) -> None:
        if self.sock is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self.pump.remove(self.sock)
        self.sock.close(linger=200)
        self.sock = None
