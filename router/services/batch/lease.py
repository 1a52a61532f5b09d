"""Which router runs a batch: one at a time, under a lease that dies with its holder.

``FileLease`` (one host, the default): ``flock`` on the batch's ``lease``
file.  The kernel drops it when the holding process dies, SIGKILL included,
so another router sharing the directory takes the batch on its next scan.

``RedisLease`` (``[quota] store = "redis"``: routers on several hosts over a
shared batch directory): ``SET key token NX PX ttl``, renewed every scan by
a compare-and-extend script; a holder that stops renewing (dead, or cut off
from Redis) loses it after ``lease_ttl_s`` and another router takes over.
A holder that fails to renew stops running the batch at once.

Each grant carries a fencing token, larger than every earlier grant's for
that batch (a counter in the ``lease`` file under its lock; a Redis counter
bumped by the same script that takes the key).  The new holder raises the
batch's fence to it before it reads anything (router.services.batch.store.Fence),
and every append to the batch's result files and every state write checks
the fence under its lock: a holder that stalled past ``lease_ttl_s`` (a
paused process, a long GC) and woke up after another router took over is
refused at its next write and stops, so two routers never both write one
batch.
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

    def token(self, batch_id: str) -> int:
        """The fencing token of this router's grant of the batch (0: not held)."""

    async def renew(self, batch_id: str) -> bool:
        """False: the lease is lost; stop running the batch."""

    async def release(self, batch_id: str) -> None: ...


class FileLease:
    def __init__(self, batches_dir: Path) -> None:
        self.dir = batches_dir
        self._held: dict[str, int] = {}  # batch id -> fd holding the lock
        self._tokens: dict[str, int] = {}

    async def acquire(self, batch_id: str) -> bool:
        if batch_id in self._held:
            return True
        fd = os.open(self.dir / batch_id / "lease", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        try:
            token = _bump(fd)
        except (OSError, ValueError):
            os.close(fd)
            return False
        self._held[batch_id] = fd
        self._tokens[batch_id] = token
        return True

    def token(self, batch_id: str) -> int:
        return self._tokens.get(batch_id, 0)

    async def renew(self, batch_id: str) -> bool:
        return batch_id in self._held

    async def release(self, batch_id: str) -> None:
        fd = self._held.pop(batch_id, None)
        self._tokens.pop(batch_id, None)
        if fd is not None:
            os.close(fd)  # (closing drops the lock)


def _bump(fd: int) -> int:
    """The lease file's grant counter plus one, written back (the caller holds its lock)."""
    raw = os.pread(fd, 32, 0).strip()
    token = (int(raw) if raw else 0) + 1
    data = b"%d\n" % token
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)
    return token


# Take the key if free and bump the batch's grant counter in the same step:
# the token a grant returns is larger than every earlier grant's.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
"""
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
        self.fence_prefix = prefix + "batch-fence:"
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.holder = secrets.token_hex(8)  # this router's: a restarted router is another holder
        self._client: redis.asyncio.Redis | None = None
        self._held: dict[str, int] = {}  # batch id -> fencing token of the grant

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
            got: Any = await self._redis().eval(
                _ACQUIRE, 2, self.prefix + batch_id, self.fence_prefix + batch_id, self.holder, self.ttl_ms
            )
        except Exception:
            return False
        if got:
            self._held[batch_id] = int(got)
        return bool(got)

    def token(self, batch_id: str) -> int:
        return self._held.get(batch_id, 0)

    async def renew(self, batch_id: str) -> bool:
        try:
            ok: Any = await self._redis().eval(_RENEW, 1, self.prefix + batch_id, self.holder, self.ttl_ms)
        except Exception:
            ok = 0
        if not ok:
            self._held.pop(batch_id, None)
        return bool(ok)

    async def release(self, batch_id: str) -> None:
        self._held.pop(batch_id, None)
        try:
            await self._redis().eval(_RELEASE, 1, self.prefix + batch_id, self.holder)
        except Exception:
            pass

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
