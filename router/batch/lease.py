"""Which router runs a batch: one at a time, under a lease that dies with its holder.

``FileLease`` (one host, the default): ``flock`` on the batch's ``lease``
file.  The kernel drops it when the holding process dies, SIGKILL included,
so another router sharing the directory takes the batch on its next scan.

``RedisLease`` (``[quota] store = "redis"``: routers on several hosts over a
shared batch directory): ``SET key token NX PX ttl``, renewed every scan by
a compare-and-extend script; a holder that stops renewing (dead, or cut off
from Redis) loses it after ``lease_ttl_s`` and another router takes over.
A holder that fails to renew stops running the batch at once, so two
routers never append to one batch's files.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis.asyncio


class Lease(Protocol):
    async def acquire(self, batch_id: str) -> bool: ...

    async def renew(self, batch_id: str) -> bool:
        """False: the lease is lost; stop running the batch."""

    async def release(self, batch_id: str) -> None: ...


class FileLease:
    def __init__(self, batches_dir: Path) -> None:
        self.dir = batches_dir
        self._held: dict[str, int] = {}  # batch id -> fd holding the lock

    async def acquire(self, batch_id: str) -> bool:
        if batch_id in self._held:
            return True
        fd = os.open(self.dir / batch_id / "lease", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[batch_id] = fd
        return True

    async def renew(self, batch_id: str) -> bool:
        return batch_id in self._held

    async def release(self, batch_id: str) -> None:
        fd = self._held.pop(batch_id, None)
        if fd is not None:
            os.close(fd)  # (closing drops the lock)


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisLease:
    def __init__(self, url: str, prefix: str, ttl_s: float, timeout_s: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix + "batch-lease:"
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(8)  # this router's: a restarted router is another holder
        self._client: redis.asyncio.Redis | None = None
        self._held: set[str] = set()

    def _redis(self) -> redis.asyncio.Redis:
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.from_url(
                self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
            )
        return self._client

    async def acquire(self, batch_id: str) -> bool:
        if batch_id in self._held:
            return await self.renew(batch_id)
        try:
            got: Any = await self._redis().set(self.prefix + batch_id, self.token, nx=True, px=self.ttl_ms)
        except Exception:
            return False
        if got:
            self._held.add(batch_id)
        return bool(got)

    async def renew(self, batch_id: str) -> bool:
        try:
            ok: Any = await self._redis().eval(_RENEW, 1, self.prefix + batch_id, self.token, self.ttl_ms)
        except Exception:
            ok = 0
        if not ok:
            self._held.discard(batch_id)
        return bool(ok)

    async def release(self, batch_id: str) -> None:
        self._held.discard(batch_id)
        try:
            await self._redis().eval(_RELEASE, 1, self.prefix + batch_id, self.token)
        except Exception:
            pass

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
