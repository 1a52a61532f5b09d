"""The Redis budget store's client (router.tenancy.store_redis), built without a
server (redis.asyncio connects on first use): it never retries inside the client,
since a failure is the ledger's to handle at once (fail open or closed), and it
is built with redis.asyncio's own Retry, so no router start warns that a
synchronous one was converted."""

from __future__ import annotations

import warnings

from redis.asyncio.retry import Retry

from router.tenancy.store_redis import RedisBudgetStore


def test_the_client_does_not_retry_and_builds_without_a_warning():
    store = RedisBudgetStore("redis://127.0.0.1:1/0", "weir-test:", 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client = store._connect()
    kw = client.connection_pool.connection_kwargs
    assert isinstance(kw["retry"], Retry) and kw["retry"].get_retries() == 0
    assert kw["socket_timeout"] == 0.25 and kw["socket_connect_timeout"] == 0.25
