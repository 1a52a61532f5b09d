"""Stored responses of ``/v1/responses``: what ``previous_response_id`` and
``GET /v1/responses/{id}`` read.

One record per response id: the encoded ``StoredResponse`` (the response
object as it was sent, the conversation a continuation prepends, and its
owner: tenant and key digest, checked by router.tenancy.ownership on every read).
Two stores with one interface (``ResponseStore``):

- ``MemoryResponseStore`` (``[responses] store = "memory"``): this router's
  memory; a response created through one router is unknown to another;
- ``RedisResponseStore`` (``store = "redis"``): the ``[quota]`` Redis, so
  every router naming it shares the responses.

Bounds are per tenant, so one tenant's responses never evict another's:
count (``max_stored``) and bytes (``max_bytes``; both overridable per
``[[tenants]]`` entry), the tenant's oldest going first; and age
(``max_age_s``).  An evicted or expired id is answered like one that never
existed (404).  A record over ``max_stored_bytes`` (or its tenant's whole
byte bound) is not stored (the response is still served; counted as
``too_large``).  Every call is async so the event loop never waits on
Redis; the memory store's complete at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.config import Config

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("weir.responses")


class StoredResponse(msgspec.Struct, gc=False):
    """One stored response: the object a retrieve returns, verbatim, the
    chat messages (OpenAI chat shape) its continuation starts from, and its
    owner (a record without one is nobody's: 404 to everyone)."""

    response: msgspec.Raw
    messages: list[dict[str, Any]]
    tenant: str = ""
    key: str = ""  # SHA-256 of the API key that made it ("" without keys)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StoredResponse)


def encode_record(response: bytes, messages: list[dict[str, Any]], tenant: str = "", key: str = "") -> bytes:
    return _encoder.encode(StoredResponse(msgspec.Raw(response), messages, tenant, key))


def decode_record(data: bytes) -> StoredResponse:
    return _decoder.decode(data)


# tenant -> (max_stored, max_bytes): its own bounds, as the config reads now
Bounds = Callable[[str], tuple[int, int]]


def tenant_bounds(cfg: Config, tenant: str) -> tuple[int, int]:
    """A tenant's stored-responses bounds: its ``[[tenants]]`` entry's, else ``[responses]``'s."""
    r = cfg.responses
    t = next((t for t in cfg.tenants if t.name == tenant), None)
    count = t.responses_max_stored if t is not None and t.responses_max_stored is not None else r.max_stored
    size = t.responses_max_bytes if t is not None and t.responses_max_bytes is not None else r.max_bytes
    return count, size


class _Counters:
    def __init__(self, max_stored_bytes: int, bounds: Bounds) -> None:
        self.max_stored_bytes = max_stored_bytes
        self.bounds = bounds
        self.evicted = {"count": 0, "bytes": 0, "age": 0}
        self.too_large = 0
        self.errors = 0

    def fits(self, record: bytes, max_bytes: int) -> bool:
        if len(record) > min(self.max_stored_bytes, max_bytes):
            self.too_large += 1
            return False
        return True

    def _common(self) -> dict[str, int]:
        return {
            "evicted_count": self.evicted["count"],
            "evicted_bytes": self.evicted["bytes"],
            "evicted_age": self.evicted["age"],
            "too_large": self.too_large,
            "errors": self.errors,
        }


class _Shelf:
    """One tenant's responses, insertion-ordered: the front is its oldest."""

    __slots__ = ("items", "bytes")

    def __init__(self) -> None:
        self.items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    def pop(self, response_id: str | None = None) -> None:
        if response_id is None:
            _, (_, data) = self.items.popitem(last=False)
        else:
            _, data = self.items.pop(response_id)
        self.bytes -= len(data)


class MemoryResponseStore(_Counters):
    """A shelf per tenant; each bound evicts from the front of the tenant's own shelf."""

    kind = "memory"

    def __init__(
        self,
        max_stored: int,
        max_age_s: float,
        max_stored_bytes: int,
        clock: Any = time.monotonic,
        bounds: Bounds | None = None,
    ) -> None:
        super().__init__(max_stored_bytes, bounds or (lambda _tenant: (max_stored, max_stored * max_stored_bytes)))
        self.max_age_s = max_age_s
        self.clock = clock
        self._shelves: dict[str, _Shelf] = {}
        self._tenant_of: dict[str, str] = {}  # response id -> the shelf it is on

    def _drop(self, response_id: str) -> None:
        tenant = self._tenant_of.pop(response_id)
        shelf = self._shelves[tenant]
        shelf.pop(response_id)
        if not shelf.items:
            del self._shelves[tenant]

    def _expire(self, shelf: _Shelf, now: float) -> None:
        while shelf.items:
            rid, (t, _) = next(iter(shelf.items.items()))
            if now - t < self.max_age_s:
                break
            self._drop(rid)
            self.evicted["age"] += 1

    async def get(self, response_id: str) -> bytes | None:
        tenant = self._tenant_of.get(response_id)
        if tenant is None:
            return None
        t, data = self._shelves[tenant].items[response_id]
        if self.clock() - t >= self.max_age_s:
            self._drop(response_id)
            self.evicted["age"] += 1
            return None
        return data

    async def put(self, response_id: str, record: bytes, tenant: str) -> bool:
        max_stored, max_bytes = self.bounds(tenant)
        if not self.fits(record, max_bytes):
            return False
        now = self.clock()
        if response_id in self._tenant_of:
            self._drop(response_id)
        shelf = self._shelves.setdefault(tenant, _Shelf())
        self._expire(shelf, now)
        shelf = self._shelves.setdefault(tenant, _Shelf())  # (expiring may have emptied it)
        shelf.items[response_id] = (now, record)
        shelf.bytes += len(record)
        self._tenant_of[response_id] = tenant
        while len(shelf.items) > max_stored or shelf.bytes > max_bytes:
            why = "count" if len(shelf.items) > max_stored else "bytes"
            rid = next(iter(shelf.items))
            shelf.pop()
            del self._tenant_of[rid]
            self.evicted[why] += 1
        return True

    async def delete(self, response_id: str, tenant: str) -> bool:
        if self._tenant_of.get(response_id) != tenant:
            return False
        self._drop(response_id)
        return True

    async def close(self) -> None:
        return None

    def counters(self) -> dict[str, int]:
        now = self.clock()
        for shelf in list(self._shelves.values()):
            self._expire(shelf, now)
        stored = sum(len(s.items) for s in self._shelves.values())
        size = sum(s.bytes for s in self._shelves.values())
        return {"stored": stored, "bytes": size, **self._common()}


# KEYS: the record, the tenant's index (ids by time stored), its sizes (id -> bytes), its byte total.
# ARGV: id, record, ttl_s, now, max_age_s, max_stored, max_bytes, the records' key prefix.
# Atomic: the tenant's index, sizes and total always agree, whichever router writes.
_PUT = """
local id, rec = ARGV[1], ARGV[2]
local now, max_age = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_n, max_b, rprefix = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
local old = redis.call('HGET', KEYS[3], id)
if old then total = total - tonumber(old) end
redis.call('SET', KEYS[1], rec, 'EX', ARGV[3])
redis.call('ZADD', KEYS[2], now, id)
redis.call('HSET', KEYS[3], id, #rec)
total = total + #rec
local aged = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - max_age)
for _, a in ipairs(aged) do
  total = total - tonumber(redis.call('HGET', KEYS[3], a) or '0')
  redis.call('HDEL', KEYS[3], a)
  redis.call('ZREM', KEYS[2], a)
  redis.call('DEL', rprefix .. a)
end
local n = redis.call('ZCARD', KEYS[2])
local by_count, by_bytes = 0, 0
while n > 0 and (n > max_n or total > max_b) do
  if n > max_n then by_count = by_count + 1 else by_bytes = by_bytes + 1 end
  local o = redis.call('ZPOPMIN', KEYS[2])
  total = total - tonumber(redis.call('HGET', KEYS[3], o[1]) or '0')
  redis.call('HDEL', KEYS[3], o[1])
  redis.call('DEL', rprefix .. o[1])
  n = n - 1
end
redis.call('SET', KEYS[4], total)
return {#aged, by_count, by_bytes, n}
"""

# KEYS as _PUT's; ARGV: id.  1 if the record was there, on that tenant's shelf.
_DELETE = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
local size = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if size then redis.call('DECRBY', KEYS[4], size) end
return redis.call('DEL', KEYS[1])
"""


class RedisResponseStore(_Counters):
    """``prefix + "r:" + id`` holds a record (expiring after ``max_age_s``);
    per tenant, ``prefix + "t:" + tenant`` orders its ids by time stored,
    ``"s:"`` holds their sizes and ``"b:"`` their total, so a tenant's
    bounds evict its own oldest across every router."""

    kind = "redis"

    def __init__(
        self,
        url: str,
        prefix: str,
        timeout_s: float,
        max_stored: int,
        max_age_s: float,
        max_bytes: int,
        bounds: Bounds | None = None,
    ):
        super().__init__(max_bytes, bounds or (lambda _tenant: (max_stored, max_stored * max_bytes)))
        self.max_age_s = max_age_s
        self.url, self.prefix, self.timeout_s = url, prefix, timeout_s
        self._client: redis.asyncio.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._stored: dict[str, int] = {}  # tenant -> its index's size at the last put (for the gauge)

    def _redis(self) -> redis.asyncio.Redis:
        if self._client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry  # (the asyncio client's: a synchronous one is converted, warning)
            from redis.backoff import NoBackoff

            self._client = aioredis.from_url(
                self.url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
            self._scripts = {"put": self._client.register_script(_PUT), "delete": self._client.register_script(_DELETE)}
        return self._client

    def _key(self, response_id: str) -> str:
        return self.prefix + "r:" + response_id

    def _keys(self, response_id: str, tenant: str) -> list[str]:
        p = self.prefix
        return [self._key(response_id), p + "t:" + tenant, p + "s:" + tenant, p + "b:" + tenant]

    async def get(self, response_id: str) -> bytes | None:
        try:
            data = await self._redis().get(self._key(response_id))
        except Exception:
            self.errors += 1
            raise
        return data.encode() if isinstance(data, str) else data

    async def put(self, response_id: str, record: bytes, tenant: str) -> bool:
        max_stored, max_bytes = self.bounds(tenant)
        if not self.fits(record, max_bytes):
            return False
        self._redis()
        args = [response_id, record, max(1, math.ceil(self.max_age_s)), time.time(), self.max_age_s]
        try:
            aged, by_count, by_bytes, n = await self._scripts["put"](
                keys=self._keys(response_id, tenant), args=[*args, max_stored, max_bytes, self.prefix + "r:"]
            )
        except Exception:
            self.errors += 1
            raise
        self.evicted["age"] += int(aged)
        self.evicted["count"] += int(by_count)
        self.evicted["bytes"] += int(by_bytes)
        self._stored[tenant] = int(n)
        return True

    async def delete(self, response_id: str, tenant: str) -> bool:
        self._redis()
        try:
            deleted = await self._scripts["delete"](keys=self._keys(response_id, tenant), args=[response_id])
        except Exception:
            self.errors += 1
            raise
        return bool(deleted)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def counters(self) -> dict[str, int]:
        return {"stored": sum(self._stored.values()), **self._common()}


ResponseStore = MemoryResponseStore | RedisResponseStore


def make_store(cfg: Config, bounds: Bounds | None = None) -> ResponseStore:
    """The configured store; ``bounds`` reads each tenant's bounds as the config reads now
    (default: ``cfg``'s, never reloaded)."""
    r = cfg.responses
    bounds = bounds or (lambda tenant: tenant_bounds(cfg, tenant))
    if r.store == "redis":
        q = cfg.quota
        return RedisResponseStore(
            q.redis_url, r.redis_prefix, q.redis_timeout_s, r.max_stored, r.max_age_s, r.max_stored_bytes, bounds
        )
    return MemoryResponseStore(r.max_stored, r.max_age_s, r.max_stored_bytes, bounds=bounds)


class StoreCollector(Collector):
    """The store's gauges and counters, read at scrape time."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        c = self.store.counters()
        stored = GaugeMetricFamily(
            "weir_responses_stored",
            "Responses stored for previous_response_id (redis: of the tenants this router stored for)",
            labels=["store"],
        )
        stored.add_metric([self.store.kind], c["stored"])
        yield stored
        evicted = CounterMetricFamily(
            "weir_responses_evicted",
            "Stored responses evicted, by their tenant's bound (count, bytes, age)",
            labels=["why"],
        )
        evicted.add_metric(["count"], c["evicted_count"])
        evicted.add_metric(["bytes"], c["evicted_bytes"])
        evicted.add_metric(["age"], c["evicted_age"])
        yield evicted
        skipped = CounterMetricFamily(
            "weir_responses_not_stored",
            "Responses served but not stored, by why (too_large, store_error)",
            labels=["why"],
        )
        skipped.add_metric(["too_large"], c["too_large"])
        skipped.add_metric(["store_error"], c["errors"])
        yield skipped
