"""Router discovery: a router address given by DNS name links to every router behind it.

ZeroMQ resolves a ``tcp://name:port`` endpoint to one address and keeps it,
so a worker pointed at a name that stands for several routers (Kubernetes'
headless Service: one A record per router pod) would serve one router only.
Instead the worker resolves each such name itself -- all of its addresses,
``getaddrinfo`` on a thread, never on the event loop -- and keeps one link
per address:

- every ``discovery_interval_s`` and at once when a link is lost (``poke``);
- an address that appears is linked at the next resolution (within one period);
- an address that disappears is unlinked through the worker's one removal
  path -- once that router holds nothing here, so a router that is draining
  (still in the Service while it finishes its streams) finishes them;
- a name that resolves to nothing, or fails to resolve, keeps the links it
  has and is retried with back-off (interval, doubling to ``RESOLVE_BACKOFF_MAX_S``),
  logged once per failure streak, never a crash.  An address with no router
  behind it is the link's own business: its liveness and reconnect back-off.

Addresses given as IP literals, and ``ipc://`` / ``inproc://`` ones, are
static: linked once, as given.  ``discovery_interval_s = 0`` turns discovery
off (each name is one link, resolved by ZeroMQ).

Pure parts (``parse``, ``endpoint``, ``diff``) are separate from the loop so
tests drive them directly; the resolver is injectable.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable

from shared.config import split_hostport

log = logging.getLogger("engine_worker.discovery")

RESOLVE_BACKOFF_MAX_S = 30.0

Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses, may raise OSError


def parse(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://`` address whose host is a DNS name; None for a static one."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return None
    try:
        host, port = split_hostport(rest)
        ipaddress.ip_address(host)
    except ValueError:
        return (host, port) if rest and host not in ("", "*") else None
    return None  # an IP literal: static


def endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def system_resolve(host: str, port: int) -> list[str]:
    """Every address of ``host`` (TCP), in the resolver's order, without repeats."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for *_, sockaddr in infos:
        ip = str(sockaddr[0])
        if ip not in out:
            out.append(ip)
    return out


def diff(current: Iterable[str], wanted: Iterable[str]) -> tuple[list[str], list[str]]:
    """(addresses to link, addresses to unlink), in a stable order."""
    cur, want = set(current), set(wanted)
    return sorted(want - cur), sorted(cur - want)


class RouterDiscovery:
    """Keeps the worker's discovered links equal to what its router names resolve to.

    ``link(address)`` / ``unlink(address) -> bool`` are the worker's: unlink
    returns False while that router still holds requests here (tried again
    next round)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        names: list[tuple[str, int]],
        interval_s: float,
        link: Callable[[str], None],
        unlink: Callable[[str], bool],
        resolver: Resolver = system_resolve,
    ) -> None:
        self.loop = loop
        self.names = names
        self.interval_s = interval_s
        self._link = link
        self._unlink = unlink
        self.resolver = resolver
        self.linked: dict[tuple[str, int], set[str]] = {n: set() for n in names}  # name -> its linked addresses
        self._failing: dict[tuple[str, int], int] = {}  # name -> failed resolutions in a row
        self._due: dict[tuple[str, int], float] = dict.fromkeys(names, 0.0)  # name -> next resolution
        self._wake = asyncio.Event()
        self.rounds = 0

    def poke(self) -> None:
        """Resolve every name again now (a link was lost: its router may have moved)."""
        self._due = dict.fromkeys(self.names, 0.0)
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            await self.resolve_due()
            delay = max(0.0, min(self._due.values()) - self.loop.time())
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass

    async def resolve_due(self) -> None:
        """Resolve every name whose time has come: a resolving one again in
        ``interval_s``, a failing one after a back-off that doubles from it."""
        self.rounds += 1
        for name in self.names:
            if self._due[name] > self.loop.time():
                continue
            host, port = name
            try:
                ips = await self.loop.run_in_executor(None, self.resolver, host, port)
                if not ips:
                    raise OSError("no addresses")
            except OSError as e:
                n = self._failing[name] = self._failing.get(name, 0) + 1
                self._due[name] = self.loop.time() + min(self.interval_s * 2 ** (n - 1), RESOLVE_BACKOFF_MAX_S)
                if n == 1:  # once per failure streak: a name down for an hour is not 700 lines
                    log.warning("router name %s: %s; keeping its %d links, retrying", host, e, len(self.linked[name]))
                continue
            if self._failing.pop(name, 0):
                log.info("router name %s resolves again: %s", host, ", ".join(ips))
            self._due[name] = self.loop.time() + self.interval_s
            self._apply(name, [endpoint(ip, port) for ip in ips])

    def _apply(self, name: tuple[str, int], wanted: list[str]) -> None:
        have = self.linked[name]
        # an address two names share is linked once (by the first name) and unlinked when neither has it
        others = set().union(*(v for k, v in self.linked.items() if k != name))
        add, gone = diff(have, wanted)
        for addr in add:
            if addr not in others:
                log.info("router %s found at %s", name[0], addr)
                self._link(addr)
            have.add(addr)
        for addr in gone:
            if addr in others or self._unlink(addr):
                if addr not in others:
                    log.info("router %s no longer at %s: unlinked", name[0], addr)
                have.discard(addr)
