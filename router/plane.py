"""What the router's two ZeroMQ adapters share: one ROUTER socket and one timer each.

``router.worker_link`` (the backend) and ``router.client_frontend`` (the
frontend) each own one bound ROUTER socket -- with CURVE where ``[security]``
turns it on -- driven by the process's one SocketPump, and one periodic
timer (heartbeats; client probes).  This base binds, ticks and closes them.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

import zmq

from router.metrics import RouterMetrics
from shared.config import RouterConfig
from router.metrics import plane_security
from shared.transport import SocketPump, bind_router


class RouterPlane:
    side = ""  # "frontend" | "backend": its address in RouterConfig and its ZAP domain

    def __init__(self, cfg: RouterConfig, loop: asyncio.AbstractEventLoop, pump: SocketPump,
                 metrics: RouterMetrics, ctx: Optional[zmq.Context] = None, *, security=None,
                 base_dir: str = "") -> None:
        self.cfg = cfg
        self.security, self.base_dir = security, base_dir  # CURVE (shared.curve): [security]
        self.loop = loop
        self.pump = pump
        self.metrics = metrics
        self.ctx = ctx or zmq.Context.instance()
        self.sock: Optional[zmq.Socket] = None
        self._timer: Optional[asyncio.TimerHandle] = None

    def _bind(self, on_message: Callable[[list[bytes]], None], tick: Callable[[], None], **callbacks) -> None:
        """Bind this side's socket, let the pump drive it, start its timer."""
        addr = getattr(self.cfg, self.side)
        self.sock = bind_router(self.ctx, addr,
                                plane_security(self.ctx, self.security, self.base_dir, self.side, self.metrics))
        self.pump.add(self.sock, on_message, **callbacks)
        self._tick = tick
        self._timer = self.loop.call_later(self.cfg.heartbeat_interval_s, self._on_timer)

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
