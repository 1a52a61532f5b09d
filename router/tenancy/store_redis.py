"""The budget store in Redis (``[quota] store = "redis"``): one budget shared by several routers.

Its own module because it is the one part of the budgets with I/O: two Lua
scripts make each reserve and each credit atomic in Redis, and the calls are
batched into one pipeline per round trip and answered through callbacks, so
the router's loop never waits on Redis (admission resumes in a callback).
What to do when Redis fails (fail open or closed, retry later) is the
ledger's (router.tenancy.budgets); this module reports every failure to it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias

from router.tenancy.buckets import Bucket, StoreAnswer, StoreCallback

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("weir.router.budgets")

_Call: TypeAlias = tuple[str, tuple[Bucket, ...], Sequence[int], str, StoreCallback | None]  # queued: op, ..., callback


# Both scripts take the buckets' keys and then the hold's key (last): a
# reserve that takes sets it, a credit applies only if it deletes it -- so a
# credit sent again after a timeout, or one undoing a reserve that timed out,
# counts exactly once whether or not the first call ran.
_RESERVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = #KEYS - 1
local levels = {}
local worst, worst_i = -1, 0
for i = 1, n do
  local cap, period, cost = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local b = redis.call('HMGET', KEYS[i], 'l', 't')
  local l = tonumber(b[1])
  if l == nil then l = cap else l = math.min(cap, l + math.max(0, now - tonumber(b[2])) * cap / period) end
  levels[i] = l
  if l < cost then
    local wait = (cost - l) * period / cap
    if wait > worst then worst = wait; worst_i = i end
  end
end
local out = {1, 0, '0'}
if worst_i > 0 then
  out = {0, worst_i, tostring(worst)}
else
  redis.call('SET', KEYS[#KEYS], '1', 'EX', tonumber(ARGV[3*n+1]))
end
for i = 1, n do
  local l = levels[i]
  if worst_i == 0 then
    local period = tonumber(ARGV[3*i-1])
    l = l - tonumber(ARGV[3*i])
    redis.call('HSET', KEYS[i], 'l', tostring(l), 't', tostring(now))
    redis.call('EXPIRE', KEYS[i], math.ceil(period * 2))
  end
  out[#out+1] = tostring(l)
end
return out
"""

_CREDIT_LUA = """
if redis.call('DEL', KEYS[#KEYS]) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 1, #KEYS - 1 do
  local cap, period, amount = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local b = redis.call('HMGET', KEYS[i], 'l', 't')
  local l = tonumber(b[1])
  if l == nil then l = cap else l = math.min(cap, l + math.max(0, now - tonumber(b[2])) * cap / period) end
  l = math.min(cap, l + amount)
  redis.call('HSET', KEYS[i], 'l', tostring(l), 't', tostring(now))
  redis.call('EXPIRE', KEYS[i], math.ceil(period * 2))
end
return 1
"""


class RedisBudgetStore:
    """Buckets in Redis, shared by every router that names it.  Calls are
    queued and sent as one pipeline per round trip (while one is in flight,
    the next batch gathers), answered through callbacks on the loop."""

    sync: Literal[False] = False

    def __init__(self, url: str, prefix: str, timeout_s: float) -> None:
        self.url, self.prefix, self.timeout_s = url, prefix, timeout_s
        self._client: redis.asyncio.Redis | None = None
        self._reserve: str | None = None  # the scripts' SHA1s
        self._credit: str | None = None
        self._queue: list[_Call] = []
        self._busy = False

    def _connect(self) -> redis.asyncio.Redis:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No retries inside the client: a failure is the BudgetLedger's to handle, at once.
        client = self._client = aioredis.from_url(
            self.url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._reserve = self._credit = None  # SHA1s, loaded on first use (and after a Redis restart)
        return client

    def submit(
        self, op: str, buckets: tuple[Bucket, ...], amounts: Sequence[int], hold_id: str, callback: StoreCallback | None
    ) -> None:
        """``callback(result | exception)``: result is the reserve's (ok, why, levels).
        Never called before this returns (the lifecycle relies on it).  A
        credit applies only if the reserve of ``hold_id`` took, and once."""
        self._queue.append((op, buckets, amounts, hold_id, callback))
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().create_task(self._run())

    def warm(self) -> None:
        """Connect and load the scripts at router start, not on the first
        request's clock: importing redis.asyncio, connecting and two
        SCRIPT LOADs took over the 0.5 s bound on a busy 2-core machine, so a
        fresh router's first requests failed open (unmetered).  Calls that
        come meanwhile wait for it."""
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().create_task(self._warm())

    async def _warm(self) -> None:
        try:
            await asyncio.wait_for(self._ready(), max(2.0, self.timeout_s * 8))
        except Exception as e:  # the first request's call tries again, and reports
            log.warning("quota store %s not reachable at start (%s); requests will try it again", self.url, e)
        finally:
            self._busy = False
            if self._queue:
                self._busy = True
                asyncio.get_running_loop().create_task(self._run())

    async def _ready(self) -> tuple[redis.asyncio.Redis, str, str]:
        """The client and the scripts' SHA1s, connecting and loading what is missing."""
        client = self._client
        if client is None:
            client = self._connect()
        if self._reserve is None or self._credit is None:
            # both or neither: a load cut short (timeout, cancel) must not leave one unset
            reserve = await client.script_load(_RESERVE_LUA)
            credit = await client.script_load(_CREDIT_LUA)
            self._reserve, self._credit = reserve, credit
        return client, self._reserve, self._credit

    async def _run(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                results: list[StoreAnswer]
                try:
                    results = await asyncio.wait_for(self._send(batch), self.timeout_s * 2)
                except Exception as e:  # every failure is the callbacks' news
                    results = [e] * len(batch)
                for (_op, _b, _a, _h, cb), res in zip(batch, results):
                    if cb is not None:
                        try:
                            cb(res)
                        except Exception:
                            log.exception("quota callback failed")
        finally:
            self._busy = False

    async def _send(self, batch: list[_Call]) -> list[StoreAnswer]:
        from redis.exceptions import NoScriptError

        for attempt in (0, 1):
            client, reserve_sha, credit_sha = await self._ready()
            pipe = client.pipeline(transaction=False)
            for op, buckets, amounts, hold_id, _cb in batch:
                keys = [self.prefix + b.key for b in buckets] + [self.prefix + "hold:" + hold_id]
                args: list[float] = []
                for b, a in zip(buckets, amounts):
                    args += [b.cap, b.period, a]
                if op == "reserve":  # the hold outlives any job: twice the longest period
                    args.append(math.ceil(2 * max(b.period for b in buckets)))
                pipe.evalsha(reserve_sha if op == "reserve" else credit_sha, len(keys), *keys, *args)
            raw = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in raw):
                self._reserve = None  # Redis restarted and forgot them: load again, once
                continue
            break
        if len(raw) != len(batch):
            raise RuntimeError(f"redis answered {len(raw)} of {len(batch)} calls")
        out: list[StoreAnswer] = []
        for (op, _b, _a, _h, _cb), r in zip(batch, raw):
            if isinstance(r, Exception) or op != "reserve":
                out.append(r)
                continue
            ok, i, wait = int(r[0]), int(r[1]), float(r[2])
            levels = [float(x) for x in r[3:]]
            out.append((True, None, levels) if ok else (False, (i - 1, wait), levels))
        return out

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
