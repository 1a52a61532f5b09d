"""Stored responses of ``/v1/responses``: what ``previous_response_id`` and
``GET /v1/responses/{id}`` read.

One record per response id: the encoded ``StoredResponse`` (the response
object as it was sent, and the conversation a continuation prepends).  Two
stores with one interface (``ResponseStore``):

- ``MemoryResponseStore`` (``[responses] store = "memory"``): this router's
  memory; a response created through one router is unknown to another;
- ``RedisResponseStore`` (``store = "redis"``): the ``[quota]`` Redis, so
  every router naming it shares the responses.

Both are bounded by count (``max_stored``: the oldest goes first) and age
(``max_age_s``); an evicted or expired id is answered like one that never
existed (404).  A record over ``max_stored_bytes`` is not stored (the response
is still served; counted as ``too_large``).  Every call is async so the
event loop never waits on Redis; the memory store's complete at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.config import Config

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("weir.responses")


class StoredResponse(msgspec.Struct, gc=False):
    """One stored response: the object a retrieve returns, verbatim, and the
    chat messages (OpenAI chat shape) its continuation starts from."""

    response: msgspec.Raw
    messages: list[dict[str, Any]]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StoredResponse)


def encode_record(response: bytes, messages: list[dict[str, Any]]) -> bytes:
    return _encoder.encode(StoredResponse(msgspec.Raw(response), messages))


def decode_record(data: bytes) -> StoredResponse:
    return _decoder.decode(data)


class _Counters:
    def __init__(self, max_stored_bytes: int) -> None:
        self.max_stored_bytes = max_stored_bytes
        self.evicted = {"count": 0, "age": 0}
        self.too_large = 0
        self.errors = 0

    def fits(self, record: bytes) -> bool:
        if len(record) > self.max_stored_bytes:
            self.too_large += 1
            return False
        return True


class MemoryResponseStore(_Counters):
    """Insertion-ordered: the front is the oldest, so both bounds evict from it."""

    kind = "memory"

    def __init__(self, max_stored: int, max_age_s: float, max_stored_bytes: int, clock: Any = time.monotonic) -> None:
        super().__init__(max_stored_bytes)
        self.max_stored = max_stored
        self.max_age_s = max_age_s
        self.clock = clock
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    def _expire(self, now: float) -> None:
        items = self._items
        while items:
            rid, (t, data) = next(iter(items.items()))
            if now - t < self.max_age_s:
                break
            items.popitem(last=False)
            self.bytes -= len(data)
            self.evicted["age"] += 1

    async def get(self, response_id: str) -> bytes | None:
        self._expire(self.clock())
        item = self._items.get(response_id)
        return None if item is None else item[1]

    async def put(self, response_id: str, record: bytes) -> bool:
        if not self.fits(record):
            return False
        now = self.clock()
        self._expire(now)
        old = self._items.pop(response_id, None)
        if old is not None:
            self.bytes -= len(old[1])
        self._items[response_id] = (now, record)
        self.bytes += len(record)
        while len(self._items) > self.max_stored:
            _, (_, data) = self._items.popitem(last=False)
            self.bytes -= len(data)
            self.evicted["count"] += 1
        return True

    async def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.bytes -= len(item[1])
        return True

    async def close(self) -> None:
        return None

    def counters(self) -> dict[str, int]:
        self._expire(self.clock())
        return {"stored": len(self._items), "bytes": self.bytes, **self._common()}

    def _common(self) -> dict[str, int]:
        return {
            "evicted_count": self.evicted["count"],
            "evicted_age": self.evicted["age"],
            "too_large": self.too_large,
            "errors": self.errors,
        }


class RedisResponseStore(MemoryResponseStore):
    """``prefix + "r:" + id`` holds a record (expiring after ``max_age_s``);
    the sorted set ``prefix + "index"`` orders the ids by time stored, so the
    count bound evicts the oldest across every router."""

    kind = "redis"

    def __init__(self, url: str, prefix: str, timeout_s: float, max_stored: int, max_age_s: float, max_bytes: int):
        super().__init__(max_stored, max_age_s, max_bytes)
        self.url, self.prefix, self.timeout_s = url, prefix, timeout_s
        self._client: redis.asyncio.Redis | None = None
        self._stored = 0  # the index's size at the last put (for the gauge)

    def _redis(self) -> redis.asyncio.Redis:
        if self._client is None:
            import redis.asyncio as aioredis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._client = aioredis.from_url(
                self.url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        return self._client

    def _key(self, response_id: str) -> str:
        return self.prefix + "r:" + response_id

    async def get(self, response_id: str) -> bytes | None:
        try:
            data = await self._redis().get(self._key(response_id))
        except Exception:
            self.errors += 1
            raise
        return data.encode() if isinstance(data, str) else data

    async def put(self, response_id: str, record: bytes) -> bool:
        if not self.fits(record):
            return False
        index = self.prefix + "index"
        now = time.time()
        try:
            pipe = self._redis().pipeline(transaction=False)
            pipe.set(self._key(response_id), record, ex=max(1, math.ceil(self.max_age_s)))
            pipe.zadd(index, {response_id: now})
            pipe.zremrangebyscore(index, "-inf", now - self.max_age_s)  # their records expired by themselves
            pipe.zcard(index)
            _, _, aged, count = await pipe.execute()
            self.evicted["age"] += int(aged)
            over = int(count) - self.max_stored
            if over > 0:
                oldest = await self._redis().zpopmin(index, over)  # [(id, score)], oldest first
                ids = [(o[0].decode() if isinstance(o[0], bytes) else str(o[0])) for o in oldest]
                if ids:
                    await self._redis().delete(*[self._key(rid) for rid in ids])
                    self.evicted["count"] += len(ids)
            self._stored = min(int(count), self.max_stored)
        except Exception:
            self.errors += 1
            raise
        return True

    async def delete(self, response_id: str) -> bool:
        try:
            pipe = self._redis().pipeline(transaction=False)
            pipe.delete(self._key(response_id))
            pipe.zrem(self.prefix + "index", response_id)
            deleted, _ = await pipe.execute()
        except Exception:
            self.errors += 1
            raise
        return bool(deleted)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def counters(self) -> dict[str, int]:
        return {"stored": self._stored, **self._common()}


def make_store(cfg: Config) -> MemoryResponseStore:
    r = cfg.responses
    if r.store == "redis":
        q = cfg.quota
        return RedisResponseStore(
            q.redis_url, r.redis_prefix, q.redis_timeout_s, r.max_stored, r.max_age_s, r.max_stored_bytes
        )
    return MemoryResponseStore(r.max_stored, r.max_age_s, r.max_stored_bytes)


class StoreCollector(Collector):
    """The store's gauges and counters, read at scrape time."""

    def __init__(self, store: MemoryResponseStore) -> None:
        self.store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        c = self.store.counters()
        stored = GaugeMetricFamily(
            "weir_responses_stored", "Responses stored for previous_response_id (redis: all routers')", labels=["store"]
        )
        stored.add_metric([self.store.kind], c["stored"])
        yield stored
        evicted = CounterMetricFamily(
            "weir_responses_evicted", "Stored responses evicted, by bound (count, age)", labels=["why"]
        )
        evicted.add_metric(["count"], c["evicted_count"])
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
