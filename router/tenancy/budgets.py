"""The budget ledger: per API key and per tenant, reserve at admission, settle at the end.

A request must fit every budget that applies to it (router.tenancy.buckets:
token buckets on its key and on its tenant) and takes from all of them at once:

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
returns exactly once whatever path ends the job (tests/inproc/test_budgets.py checks
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

The ledger keeps the decisions and the counts; the bucket levels are a
store's, behind ``BudgetStore``: router.tenancy.store_memory (the default;
pure, no I/O: one router) or router.tenancy.store_redis (``[quota] store =
"redis"``: several routers share one budget; answers come later, through a
callback).  When Redis is unreachable the router fails open (admits, counts
``weir_quota_store_errors``, logs a warning) or closed (503
``quota_unavailable``), per ``on_store_error``; after an error it does not
ask Redis again for ``STORE_RETRY_S``.
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
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, cast

from prometheus_client.core import CounterMetricFamily, Metric

from router.observe.metrics import RouterMetrics
from router.tenancy.buckets import (
    NO_HOLD,
    Bucket,
    BudgetAnswer,
    Hold,
    Reserved,
    StoreAnswer,
    StoreCallback,
    config_buckets,
    costs,
    empty_refusal,
    ratelimit,
    settle_amounts,
    too_large,
    too_large_refusal,
)
from router.tenancy.store_memory import MemoryBudgetStore
from router.tenancy.store_redis import RedisBudgetStore
from shared import protocol as p
from shared.config import Config, QuotaConfig
from shared.errors import Code, error
from shared.keys import config_digest, key_id, redact_url

if TYPE_CHECKING:
    from router.tenancy.identity import Identity

log = logging.getLogger("weir.router.budgets")

STORE_RETRY_S = 1.0  # after a store error, answer without asking it for this long
MAX_PENDING_CREDITS = 100_000  # settles kept for retry while the store is down


class SyncBudgetStore(Protocol):
    """A store that answers at once (router.tenancy.store_memory): the ledger
    passes its clock in, and reads levels for the admin view."""

    @property
    def sync(self) -> Literal[True]: ...

    def level(self, b: Bucket, now: float) -> float: ...

    def reserve(self, buckets: tuple[Bucket, ...], amounts: Sequence[int], now: float) -> Reserved: ...

    def credit(self, buckets: tuple[Bucket, ...], amounts: Sequence[int], now: float) -> None: ...


class AsyncBudgetStore(Protocol):
    """A store with I/O (router.tenancy.store_redis): calls go in with a hold id
    (a credit applies once, whatever is sent again) and are answered through
    ``callback``, never before ``submit`` returns."""

    @property
    def sync(self) -> Literal[False]: ...

    def submit(
        self, op: str, buckets: tuple[Bucket, ...], amounts: Sequence[int], hold_id: str, callback: StoreCallback | None
    ) -> None: ...

    async def close(self) -> None: ...


# What the ledger needs of a store; ``sync`` tells the two apart.
BudgetStore: TypeAlias = SyncBudgetStore | AsyncBudgetStore


def configured_store(qcfg: QuotaConfig) -> BudgetStore:
    """The store ``[quota]`` names; Redis starts connecting now if a loop runs."""
    if qcfg.store != "redis":
        return MemoryBudgetStore()
    store = RedisBudgetStore(qcfg.redis_url, qcfg.redis_prefix, qcfg.redis_timeout_s)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # built outside a loop (tests): connects on first use
    else:
        store.warm()
    return store


@dataclass(slots=True, eq=False)
class Group:
    """The jobs of one request that fans out (a prompt list, embeddings
    inputs, router.lifecycle.fanout / router.ingress.embeddings / router.services.batch.lines):
    its ``size`` request units are one reservation, taken whole or refused
    whole before any of its jobs reserves its tokens (each job's hold then
    takes 0 request units).  Settled once, when the fan-out has ``close``d it
    and its last job has ended: every unit back if any job was refused before
    it was queued (or the fan-out failed), else all kept -- as one job's unit
    is.  The core opens it (``BudgetLedger.open_group``) on the first job's submit."""

    size: int
    quota: BudgetLedger | None = None  # set once asked: who settles it
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

    def answered(self, got: BudgetAnswer) -> None:
        """The store's later answer to the group's reservation."""
        self.pending = False
        if isinstance(got, Hold):
            self.hold = got
        else:
            self.refusal, self.refund = got, True
        self._maybe_settle()


class BudgetLedger:
    """What the lifecycle (router.lifecycle.core) asks: ``reserve`` at admission,
    ``ended`` at the one exit.  Also per-tenant usage counters."""

    def __init__(
        self,
        cfg: Config,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        store: BudgetStore | None = None,
    ) -> None:
        self.clock = clock
        self.qcfg = cfg.quota
        self.store: BudgetStore = configured_store(cfg.quota) if store is None else store
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
            self.by_tenant[t.name] = config_buckets(f"t:{t.name}", t)
        for k in cfg.api_keys:
            self.by_key[key_id(config_digest(k))] = config_buckets(f"k:{key_id(config_digest(k))}", k)
        self._cache: dict[tuple[str, str], tuple[Bucket, ...]] = {}
        self.active = bool(cfg.api_keys)  # usage counters per tenant need keys; budgets too

    def buckets(self, who: Identity) -> tuple[Bucket, ...]:
        key = (who.key_id, who.tenant)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self.by_key.get(who.key_id, ()) + self.by_tenant.get(who.tenant, ())
        return got

    # -------------------------------------------------------------- reserve

    def reserve(
        self, who: Identity, tokens: int, on_answer: Callable[[BudgetAnswer], None], requests: int = 1
    ) -> BudgetAnswer | None:
        """A Hold or a refusal now; or None, and ``on_answer`` gets it later
        (a store with I/O).  No budget for this key: a Hold that takes nothing.
        ``requests``: the request units to take (a fan-out's jobs: 0, their Group took them)."""
        return self._reserve(who, self.buckets(who), tokens, on_answer, requests)

    def _reserve(
        self,
        who: Identity,
        buckets: tuple[Bucket, ...],
        tokens: int,
        on_answer: Callable[[BudgetAnswer], None],
        requests: int,
    ) -> BudgetAnswer | None:
        if not buckets:
            return NO_HOLD
        big = too_large(buckets, tokens, requests)
        if big is not None:
            self._refused(who.tenant, "too_large")
            return too_large_refusal(big, tokens, requests)
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

    def reserve_call(self, who: Identity, on_answer: Callable[[BudgetAnswer], None]) -> BudgetAnswer | None:
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
    ) -> BudgetAnswer:
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
        self._refused(who.tenant, "tokens" if b.tokens else "requests")
        return empty_refusal(b, levels[i], wait, tokens, requests, rl)

    def _store_down(
        self, who: Identity, buckets: tuple[Bucket, ...], tokens: int, exc: BaseException | None, requests: int = 1
    ) -> BudgetAnswer:
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
        metrics.registry.register(_UsageCollector(self))


class _UsageCollector:
    """The ledger's counters in /metrics, read at each scrape."""

    def __init__(self, quota: BudgetLedger) -> None:
        self.quota = quota

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        quota = self.quota
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
            "Requests refused by a budget, per tenant and budget (requests, tokens, too_large, store_unavailable)",
            labels=["tenant", "budget"],
        )
        for (t, b), n in sorted(quota.refusals.items()):
            ref.add_metric([t, b], n)
        err = CounterMetricFamily("weir_quota_store_errors", "Budget store calls that failed, by op", labels=["op"])
        for op, n in sorted(quota.store_errors.items()):
            err.add_metric([op], n)
        yield tok
        yield req
        yield ref
        yield err
