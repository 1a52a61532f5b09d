"""Token and request budgets per API key and per tenant: reserve, then settle.

Each budget is a token bucket that refills continuously: ``requests_per_minute``
(capacity N, N/60 per second), ``tokens_per_minute`` (likewise) and
``tokens_per_day`` (N/86,400 per second), on a key (``[[api_keys]]``) and on
its tenant (``[[tenants]]``, shared by all the tenant's keys).  A request must
fit every bucket that applies to it, and takes from all of them at once:

  * admission reserves 1 request and prompt + ``max_tokens`` tokens;
  * its end (``release``: finish, error, cancel, deadline, worker loss -- the
    lifecycle's one exit, router.lifecycle.core ``_end``) returns what it did not use:
    the tokens reserved less prompt + completion actually processed (the prompt
    counts once it reached an engine; a job that never left the queue used no
    tokens), and the request too if it was refused before it was queued.

The reservation belongs to the *job* (the lifecycle's job id), not to a
dispatch: a job put back in the queue after a worker loss, or resumed on
another worker (the fault-tolerance issue), keeps its one reservation and is
settled once, on its cumulative usage.  ``release`` pops the hold, so it
returns exactly once whatever path ends the job (tests/inproc/test_quota.py checks
this over random interleavings).

A refusal is 429 (``requests_budget`` / ``tokens_budget``: OpenAI's code
``rate_limit_exceeded``, ``type`` naming the budget) with a Retry-After of
when the bucket will hold the request; a request larger than a token budget's
capacity could never fit and gets 400 ``request_exceeds_budget`` at once.

A request that fans out into k jobs (prompt lists, embeddings inputs) is a
``Group``: its k request units are one reservation, taken before any of its
jobs' tokens (one script in Redis), refused whole (400 when k is over a
``requests_per_minute`` capacity) and returned whole when any of its jobs is
refused before it is queued.

Stores: ``MemoryStore`` (the default; pure, no I/O: one router) and
``RedisStore`` (``[quota] store = "redis"``: atomic Lua scripts, batched into
one pipeline per round trip, so several routers share one budget; the router's
loop never blocks on it -- admission resumes in a callback).  When Redis is
unreachable the router fails open (admits, counts ``weir_quota_store_errors``,
logs a warning) or closed (503 ``quota_unavailable``), per ``on_store_error``;
after an error it does not ask Redis again for ``STORE_RETRY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeAlias, cast

from prometheus_client.core import Metric

from router.observe.metrics import RouterMetrics
from shared import protocol as p
from shared.config import Budgets, Config
from shared.errors import Code, error
from shared.keys import config_digest, key_id, redact_url

if TYPE_CHECKING:
    import redis.asyncio

    from router.tenancy.identity import Identity

log = logging.getLogger("weir.router.quota")

# (config field, period in seconds, counts tokens?)
KINDS = (("requests_per_minute", 60.0, False), ("tokens_per_minute", 60.0, True), ("tokens_per_day", 86400.0, True))
_SHORT = {"requests_per_minute": "rpm", "tokens_per_minute": "tpm", "tokens_per_day": "tpd"}
STORE_RETRY_S = 1.0  # after a store error, answer without asking it for this long
MAX_PENDING_CREDITS = 100_000  # settles kept for retry while the store is down


class Bucket(NamedTuple):
    key: str  # store key, e.g. "k:1a2b3c4d5e6f:tpm" or "t:team-a:rpm"
    cap: int
    period: float
    tokens: bool  # a token budget (else requests)
    field: str  # the config field it comes from

    @property
    def rate(self) -> float:
        return self.cap / self.period


@dataclass(slots=True, eq=False)
class Hold:
    """One job's reservation; ``Quota.release`` returns it exactly once."""

    buckets: tuple[Bucket, ...]
    tokens: int  # reserved tokens
    tenant: str
    enforced: bool = True  # False: admitted while the store was down (nothing was taken)
    ratelimit: p.RateLimit | None = None  # the figures after the reservation
    hold_id: str = ""  # a store with I/O: its credit applies once, whatever is sent again
    requests: int = 1  # request units taken (a fan-out's: k on its Group's hold, 0 on each job's)


Answer: TypeAlias = Hold | p.ErrorInfo
# A store's answer to a reserve: (True, None, levels after) or
# (False, (index of the binding bucket, wait s), levels).
Reserved: TypeAlias = tuple[bool, tuple[int, float] | None, list[float]]
# What a store call's callback gets: a reserve's Reserved, a credit's script
# result (1: applied, 0: its hold was already settled), or the call's failure.
StoreAnswer: TypeAlias = Reserved | int | BaseException
StoreCallback: TypeAlias = Callable[[StoreAnswer], None]
_Call: TypeAlias = tuple[str, tuple[Bucket, ...], Sequence[int], str, StoreCallback | None]  # queued: op, ..., callback
NO_HOLD = Hold((), 0, "", enforced=False)  # a key without budgets: nothing taken, nothing to return


def ratelimit(buckets: tuple[Bucket, ...], levels: Sequence[float]) -> p.RateLimit:
    """OpenAI's x-ratelimit-* figures: for requests and for tokens, the budget
    with the least room (remaining, and seconds until it is whole again)."""
    rl = p.RateLimit()
    best_r: tuple[Bucket, float] | None = None
    best_t: tuple[Bucket, float] | None = None
    for b, level in zip(buckets, levels):
        if b.tokens:
            if best_t is None or level < best_t[1]:
                best_t = (b, level)
        elif best_r is None or level < best_r[1]:
            best_r = (b, level)
    if best_r is not None:
        b, level = best_r
        rl.limit_requests, rl.remaining_requests = b.cap, max(0, math.floor(level))
        rl.reset_requests_s = round(max(0.0, b.cap - level) / b.rate, 3)
    if best_t is not None:
        b, level = best_t
        rl.limit_tokens, rl.remaining_tokens = b.cap, max(0, math.floor(level))
        rl.reset_tokens_s = round(max(0.0, b.cap - level) / b.rate, 3)
    return rl


def costs(buckets: tuple[Bucket, ...], tokens: int, requests: int = 1) -> list[int]:
    return [tokens if b.tokens else requests for b in buckets]


def settle_amounts(hold: Hold, used: int, refund_request: bool) -> list[int]:
    """What a hold's release credits back, per bucket: the tokens not used
    (negative: more used than reserved) and, if refunded, every request unit it took."""
    back = hold.tokens - used
    return [back if b.tokens else (hold.requests if refund_request else 0) for b in hold.buckets]


def too_large(buckets: tuple[Bucket, ...], tokens: int, requests: int) -> Bucket | None:
    """The first budget this request is larger than (it could never fit), or None."""
    for b in buckets:
        if (tokens if b.tokens else requests) > b.cap:
            return b
    return None


@dataclass(slots=True, eq=False)
class Group:
    """The jobs of one request that fans out (a prompt list, embeddings
    inputs, router.lifecycle.fanout / router.ingress.embeddings / router.services.batch.lines):
    its ``size`` request units are one reservation, taken whole or refused
    whole before any of its jobs reserves its tokens (each job's hold then
    takes 0 request units).  Settled once, when the fan-out has ``close``d it
    and its last job has ended: every unit back if any job was refused before
    it was queued (or the fan-out failed), else all kept -- as one job's unit
    is.  The core opens it (``Quota.open_group``) on the first job's submit."""

    size: int
    quota: Quota | None = None  # set once asked: who settles it
    hold: Hold | None = None  # its request units (None: not answered yet, refused or no budget)
    refusal: p.ErrorInfo | None = None  # refused whole: every job gets this
    pending: bool = False  # a store with I/O has not answered yet
    live: int = 0  # its jobs in the job table
    closed: bool = False  # the fan-out submitted all it will
    refund: bool = False  # a job refused before queued, or the fan-out failed: every unit back
    settled: bool = False

    def joined(self) -> None:
        self.live += 1

    def left(self, queued: bool) -> None:
        """One of its jobs ended (``queued``: it was queued, else refused before)."""
        self.live -= 1
        if not queued:
            self.refund = True
        self._maybe_settle()

    def close(self, failed: bool) -> None:
        """The fan-out is done submitting; ``failed``: it was refused (nothing more will run)."""
        self.closed = True
        if failed:
            self.refund = True
        self._maybe_settle()

    def _maybe_settle(self) -> None:
        if self.closed and self.live <= 0 and not self.settled and not self.pending:
            self.settled = True
            hold, self.hold = self.hold, None
            if hold is not None and self.quota is not None:
                self.quota.release(hold, 0, refund_request=self.refund)

    def answered(self, got: Answer) -> None:
        """The store's later answer to the group's reservation."""
        self.pending = False
        if isinstance(got, Hold):
            self.hold = got
        else:
            self.refusal, self.refund = got, True
        self._maybe_settle()


# ------------------------------------------------------------------ stores


class MemoryStore:
    """Buckets in this process: pure (a clock goes in), no I/O."""

    sync: Literal[True] = True

    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float]] = {}  # key -> (level, at)

    def level(self, b: Bucket, now: float) -> float:
        s = self.state.get(b.key)
        if s is None:
            return float(b.cap)
        level, at = s
        return min(float(b.cap), level + (now - at) * b.rate) if now > at else min(float(b.cap), level)

    def reserve(self, buckets: tuple[Bucket, ...], amounts: Sequence[int], now: float) -> Reserved:
        """(True, None, levels after) or (False, (index of the binding bucket, wait s), levels)."""
        levels = [self.level(b, now) for b in buckets]
        worst, worst_i = -1.0, -1
        for i, (b, level, cost) in enumerate(zip(buckets, levels, amounts)):
            if level < cost:
                wait = (cost - level) / b.rate
                if wait > worst:
                    worst, worst_i = wait, i
        if worst_i >= 0:
            return False, (worst_i, worst), levels
        after: list[float] = []
        for b, level, cost in zip(buckets, levels, amounts):
            self.state[b.key] = (level - cost, now)
            after.append(level - cost)
        return True, None, after

    def credit(self, buckets: tuple[Bucket, ...], amounts: Sequence[int], now: float) -> None:
        for b, amount in zip(buckets, amounts):
            if amount:
                self.state[b.key] = (min(float(b.cap), self.level(b, now) + amount), now)


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


class RedisStore:
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
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries inside the client: a failure is the Quota's to handle, at once.
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


# ------------------------------------------------------------------ the facade


class Quota:
    """What the lifecycle (router.lifecycle.core) asks: ``reserve`` at admission,
    ``ended`` at the one exit.  Also per-tenant usage counters."""

    def __init__(
        self,
        cfg: Config,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        store: MemoryStore | RedisStore | None = None,
    ) -> None:
        self.clock = clock
        self.qcfg = cfg.quota
        if store is None:
            store = (
                RedisStore(cfg.quota.redis_url, cfg.quota.redis_prefix, cfg.quota.redis_timeout_s)
                if cfg.quota.store == "redis"
                else MemoryStore()
            )
            if isinstance(store, RedisStore):
                try:
                    asyncio.get_running_loop()
                except RuntimeError:
                    pass  # built outside a loop (tests): connects on first use
                else:
                    store.warm()
        self.store = store
        self._down_until = 0.0
        self._unsent: list[tuple[tuple[Bucket, ...], Sequence[int], str]] = []  # credits to (re)send
        # hold ids, unique across routers sharing one store: this process's prefix + a count
        self._hold_prefix, self._holds = os.urandom(6).hex() + ":", 0
        self._warned: dict[tuple[str, str], float] = {}
        self.usage: dict[str, list[int]] = {}  # tenant -> [requests, prompt, completion]
        self.refusals: dict[tuple[str, str], int] = {}  # (tenant, budget) -> count
        self.store_errors: dict[str, int] = {}  # op -> count
        self.outstanding = 0  # holds not yet released (tests and the admin view)
        self._install_metrics(metrics)
        self.reload(cfg)

    def reload(self, cfg: Config) -> None:
        """New keys and budgets (SIGHUP, POST /admin/reload); holds already
        made settle against the buckets they were taken from.  The store
        itself is kept (a new ``store`` takes a restart); ``on_store_error``
        applies at once."""
        self.qcfg = cfg.quota
        self.by_key: dict[str, tuple[Bucket, ...]] = {}
        self.by_tenant: dict[str, tuple[Bucket, ...]] = {}
        for t in cfg.tenants:
            self.by_tenant[t.name] = self._buckets(f"t:{t.name}", t)
        for k in cfg.api_keys:
            self.by_key[key_id(config_digest(k))] = self._buckets(f"k:{key_id(config_digest(k))}", k)
        self._cache: dict[tuple[str, str], tuple[Bucket, ...]] = {}
        self.active = bool(cfg.api_keys)  # usage counters per tenant need keys; budgets too

    @staticmethod
    def _buckets(prefix: str, b: Budgets) -> tuple[Bucket, ...]:
        out = []
        for field, period, tokens in KINDS:
            cap = getattr(b, field)
            if cap is not None:
                out.append(Bucket(f"{prefix}:{_SHORT[field]}", cap, period, tokens, field))
        return tuple(out)

    def buckets(self, who: Identity) -> tuple[Bucket, ...]:
        key = (who.key_id, who.tenant)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self.by_key.get(who.key_id, ()) + self.by_tenant.get(who.tenant, ())
        return got

    # -------------------------------------------------------------- reserve

    def reserve(
        self, who: Identity, tokens: int, on_answer: Callable[[Answer], None], requests: int = 1
    ) -> Answer | None:
        """A Hold or a refusal now; or None, and ``on_answer`` gets it later
        (a store with I/O).  No budget for this key: a Hold that takes nothing.
        ``requests``: the request units to take (a fan-out's jobs: 0, their Group took them)."""
        return self._reserve(who, self.buckets(who), tokens, on_answer, requests)

    def _reserve(
        self,
        who: Identity,
        buckets: tuple[Bucket, ...],
        tokens: int,
        on_answer: Callable[[Answer], None],
        requests: int,
    ) -> Answer | None:
        if not buckets:
            return NO_HOLD
        big = too_large(buckets, tokens, requests)
        if big is not None:
            self._refused(who.tenant, "too_large")
            if big.tokens:
                return error(
                    Code.BUDGET_TOO_SMALL,
                    f"This request needs {tokens} tokens (prompt + max_tokens), more than this "
                    f"key's {big.field} budget of {big.cap}: it can never be served under it. Reduce "
                    f"max_tokens or the prompt.",
                    param="max_tokens",
                )
            scope = "tenant" if big.key.startswith("t:") else "key"
            return error(
                Code.BUDGET_TOO_SMALL,
                f"This request needs {requests} requests (one per prompt or input), more than this "
                f"{scope}'s {big.field} budget of {big.cap}: it can never be served under it. Send at "
                f"most {big.cap} prompts or inputs per request.",
            )
        amounts = costs(buckets, tokens, requests)
        store = self.store
        if store.sync:
            return self._answer(who, buckets, tokens, store.reserve(buckets, amounts, self.clock()), requests=requests)
        now = self.clock()
        if now < self._down_until:
            return self._store_down(who, buckets, tokens, None, requests)
        self._flush_credits()
        hold_id = self._new_hold_id()
        store.submit(
            "reserve",
            buckets,
            amounts,
            hold_id,  # (a reserve's callback gets Reserved or a failure)
            lambda res: on_answer(
                self._answer(who, buckets, tokens, cast("Reserved | BaseException", res), amounts, hold_id, requests)
            ),
        )
        return None

    def reserve_call(self, who: Identity, on_answer: Callable[[Answer], None]) -> Answer | None:
        """One request unit and no tokens (a /tokenize call): as ``reserve``."""
        return self._reserve(who, self.request_buckets(who), 0, on_answer, 1)

    def request_buckets(self, who: Identity) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets(who) if not b.tokens)

    def open_group(self, who: Identity, group: Group) -> p.ErrorInfo | None:
        """Reserve a fan-out's ``group.size`` request units at once (its first
        job's submit); a refusal now, or None (held, or the answer comes later)."""
        group.quota = self
        group.pending = True
        # (its jobs reserve the tokens)
        got = self._reserve(who, self.request_buckets(who), 0, group.answered, group.size)
        if got is None:
            return None
        group.answered(got)
        return group.refusal

    def _new_hold_id(self) -> str:
        self._holds += 1
        return f"{self._hold_prefix}{self._holds:x}"

    def _answer(
        self,
        who: Identity,
        buckets: tuple[Bucket, ...],
        tokens: int,
        res: Reserved | BaseException,
        amounts: Sequence[int] = (),
        hold_id: str = "",
        requests: int = 1,
    ) -> Answer:
        if isinstance(res, BaseException):
            if hold_id:  # it may have run before the error (a timeout): undone if it did, else nothing
                self._unsent.append((buckets, amounts, hold_id))
            return self._store_down(who, buckets, tokens, res, requests)
        ok, why, levels = res
        rl = ratelimit(buckets, levels)
        if ok:
            self.outstanding += 1
            return Hold(buckets, tokens, who.tenant, True, rl, hold_id, requests)
        assert why is not None  # a refusal names its binding bucket
        i, wait = why
        b = buckets[i]
        scope = "tenant" if b.key.startswith("t:") else "key"
        budget = "tokens" if b.tokens else "requests"
        self._refused(who.tenant, budget)
        per = "minute" if b.period == 60.0 else "day"
        need = f"{tokens} tokens" if b.tokens else ("1 request" if requests == 1 else f"{requests} requests")
        return error(
            Code.TOKENS_BUDGET if b.tokens else Code.REQUESTS_BUDGET,
            f"Rate limit reached on {budget} per {per} for this {scope} (`{b.field}`): limit "
            f"{b.cap}, remaining {max(0, math.floor(levels[i]))}, this request needs {need}. "
            f"Retry after {math.ceil(wait)} s.",
            retry_after=max(wait, 0.001),
            ratelimit=rl,
        )

    def _store_down(
        self, who: Identity, buckets: tuple[Bucket, ...], tokens: int, exc: BaseException | None, requests: int = 1
    ) -> Answer:
        now = self.clock()
        if exc is not None:
            self._down_until = now + STORE_RETRY_S
        self._store_error("reserve", exc)
        if self.qcfg.on_store_error == "closed":
            self._refused(who.tenant, "store_unavailable")
            return error(
                Code.QUOTA_UNAVAILABLE, "The budget store is unreachable; retry shortly.", retry_after=STORE_RETRY_S
            )
        return Hold(buckets, tokens, who.tenant, enforced=False, requests=requests)

    def _store_error(self, op: str, exc: BaseException | None) -> None:
        """Count a failed call (``exc``; None: not asked, it failed just before) and warn now and then."""
        if exc is not None:
            self.store_errors[op] = self.store_errors.get(op, 0) + 1
        now = time.monotonic()
        what = (op, self.qcfg.on_store_error)
        if now - self._warned.get(what, -1e9) > 10.0:  # a down store must not flood the log
            self._warned[what] = now
            log.warning(
                "quota store %s failed (%s); %s",
                op,
                "it failed within the last second" if exc is None else f"{type(exc).__name__}: {exc}",
                "failing open: requests admitted unmetered"
                if self.qcfg.on_store_error == "open"
                else "failing closed: requests refused with 503",
            )

    def _refused(self, tenant: str, budget: str) -> None:
        k = (tenant, budget)
        self.refusals[k] = self.refusals.get(k, 0) + 1

    # -------------------------------------------------------------- the end

    def ended(self, who: Identity, hold: Hold | None, prompt: int, completion: int, queued: bool) -> None:
        """A job's end: count its usage and return what its hold did not use.
        ``prompt``: prompt tokens processed by an engine (0 if it never ran);
        ``queued``: False if it was refused before it was ever queued."""
        u = self.usage.get(who.tenant)
        if u is None:
            u = self.usage[who.tenant] = [0, 0, 0]
        if queued:
            u[0] += 1
            u[1] += prompt
            u[2] += completion
        if hold is not None:
            self.release(hold, prompt + completion, refund_request=not queued)

    def release(self, hold: Hold, used: int, refund_request: bool) -> None:
        if not hold.enforced or not hold.buckets:
            return
        self.outstanding -= 1
        amounts = settle_amounts(hold, used, refund_request)
        store = self.store
        if store.sync:
            store.credit(hold.buckets, amounts, self.clock())
            return
        self._unsent.append((hold.buckets, amounts, hold.hold_id))
        if self.clock() >= self._down_until:
            self._flush_credits()

    def _flush_credits(self) -> None:
        store = self.store
        if store.sync:
            return  # a store without I/O settles at once: it never has credits queued
        unsent, self._unsent = self._unsent, []
        for buckets, amounts, hold_id in unsent:
            store.submit(
                "credit",
                buckets,
                amounts,
                hold_id,
                partial(self._credited, buckets=buckets, amounts=amounts, hold_id=hold_id),
            )

    def _credited(self, res: StoreAnswer, buckets: tuple[Bucket, ...], amounts: Sequence[int], hold_id: str) -> None:
        if isinstance(res, BaseException):
            self._store_error("settle", res)
            self._down_until = self.clock() + STORE_RETRY_S
            if len(self._unsent) < MAX_PENDING_CREDITS:
                # sent again with the next store call (applied once: the hold id)
                self._unsent.append((buckets, amounts, hold_id))

    async def close(self) -> None:
        store = self.store
        if not store.sync:
            await store.close()

    # -------------------------------------------------------------- views

    def snapshot(self) -> dict[str, Any]:
        """The admin view (JSON-shaped): per-tenant usage and refusals; budgets
        by key id (never a key) with their levels where the store is this process."""
        now = self.clock()
        store = self.store
        tenants: dict[str, dict[str, Any]] = {}
        for t, (req, pr, co) in self.usage.items():
            tenants.setdefault(t, {})["usage"] = {"requests": req, "prompt_tokens": pr, "completion_tokens": co}
        for (t, budget), n in self.refusals.items():
            tenants.setdefault(t, {}).setdefault("refusals", {})[budget] = n

        def budgets(buckets: tuple[Bucket, ...]) -> dict[str, dict[str, int]]:
            out = {}
            for b in buckets:
                d = {"limit": b.cap}
                if store.sync:
                    d["remaining"] = max(0, math.floor(store.level(b, now)))
                out[b.field] = d
            return out

        for name, bs in self.by_tenant.items():
            tenants.setdefault(name, {})["budgets"] = budgets(bs)
        keys = {kid: budgets(bs) for kid, bs in self.by_key.items() if bs}
        return {
            "store": self.qcfg.store,
            "store_url": redact_url(self.qcfg.redis_url) if self.qcfg.store == "redis" else None,
            "on_store_error": self.qcfg.on_store_error,
            "outstanding": self.outstanding,
            "store_errors": dict(self.store_errors),
            "tenants": tenants,
            "keys": keys,
        }

    def _install_metrics(self, metrics: RouterMetrics) -> None:
        quota = self

        class _Collector:
            def describe(self) -> list[Metric]:
                return []

            def collect(self) -> Iterator[Metric]:
                from prometheus_client.core import CounterMetricFamily

                tok = CounterMetricFamily(
                    "weir_tenant_tokens",
                    "Tokens processed per tenant (prompt: reached an engine; completion: generated)",
                    labels=["tenant", "kind"],
                )
                req = CounterMetricFamily("weir_tenant_requests", "Requests admitted per tenant", labels=["tenant"])
                for t, (r, pr, co) in sorted(quota.usage.items()):
                    tok.add_metric([t, "prompt"], pr)
                    tok.add_metric([t, "completion"], co)
                    req.add_metric([t], r)
                ref = CounterMetricFamily(
                    "weir_quota_refusals",
                    "Requests refused by a budget, per tenant "
                    "and budget (requests, tokens, too_large, store_unavailable)",
                    labels=["tenant", "budget"],
                )
                for (t, b), n in sorted(quota.refusals.items()):
                    ref.add_metric([t, b], n)
                err = CounterMetricFamily(
                    "weir_quota_store_errors", "Budget store calls that failed, by op", labels=["op"]
                )
                for op, n in sorted(quota.store_errors.items()):
                    err.add_metric([op], n)
                yield tok
                yield req
                yield ref
                yield err

        metrics.registry.register(_Collector())
