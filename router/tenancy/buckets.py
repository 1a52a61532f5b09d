"""Budget arithmetic: buckets, holds and what a reserve takes and a release gives back.

Each budget is a token bucket that refills continuously: ``requests_per_minute``
(capacity N, N/60 per second), ``tokens_per_minute`` (likewise) and
``tokens_per_day`` (N/86,400 per second), on a key (``[[api_keys]]``) and on
its tenant (``[[tenants]]``, shared by all the tenant's keys).  A request must
fit every bucket that applies to it, and takes from all of them at once.

A module of its own because this part is pure -- no clock, no I/O, no
state, property-tested alone (tests/unit/test_budget_groups.py) -- and is the
vocabulary shared by the stores (router.tenancy.store_memory,
router.tenancy.store_redis) and the ledger (router.tenancy.budgets): a store
keeps bucket levels, the ledger decides what to take and give back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

from shared import protocol as p
from shared.config import Budgets
from shared.errors import Code, error

# (config field, period in seconds, counts tokens?)
BUDGET_KINDS = (
    ("requests_per_minute", 60.0, False),
    ("tokens_per_minute", 60.0, True),
    ("tokens_per_day", 86400.0, True),
)
_SHORT = {"requests_per_minute": "rpm", "tokens_per_minute": "tpm", "tokens_per_day": "tpd"}


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
    """One job's reservation; ``BudgetLedger.release`` returns it exactly once."""

    buckets: tuple[Bucket, ...]
    tokens: int  # reserved tokens
    tenant: str
    enforced: bool = True  # False: admitted while the store was down (nothing was taken)
    ratelimit: p.RateLimit | None = None  # the figures after the reservation
    hold_id: str = ""  # a store with I/O: its credit applies once, whatever is sent again
    requests: int = 1  # request units taken (a fan-out's: k on its Group's hold, 0 on each job's)


# What the ledger answers a reserve: the hold, or the refusal to send.
BudgetAnswer: TypeAlias = Hold | p.ErrorInfo
# A store's answer to a reserve: (True, None, levels after) or
# (False, (index of the binding bucket, wait s), levels).
Reserved: TypeAlias = tuple[bool, tuple[int, float] | None, list[float]]
# What a store call's callback gets: a reserve's Reserved, a credit's script
# result (1: applied, 0: its hold was already settled), or the call's failure.
StoreAnswer: TypeAlias = Reserved | int | BaseException
StoreCallback: TypeAlias = Callable[[StoreAnswer], None]
NO_HOLD = Hold((), 0, "", enforced=False)  # a key without budgets: nothing taken, nothing to return


def config_buckets(prefix: str, b: Budgets) -> tuple[Bucket, ...]:
    """The buckets of one ``[[api_keys]]`` or ``[[tenants]]`` entry (``prefix``:
    ``k:<key id>`` or ``t:<tenant>``), one per budget it sets."""
    out = []
    for field, period, tokens in BUDGET_KINDS:
        cap = getattr(b, field)
        if cap is not None:
            out.append(Bucket(f"{prefix}:{_SHORT[field]}", cap, period, tokens, field))
    return tuple(out)


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


def too_large_refusal(big: Bucket, tokens: int, requests: int) -> p.ErrorInfo:
    """The 400 for a request larger than ``big``'s capacity (``too_large``)."""
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


def empty_refusal(b: Bucket, level: float, wait: float, tokens: int, requests: int, rl: p.RateLimit) -> p.ErrorInfo:
    """The 429 for a request that does not fit ``b`` now (at ``level``; it will in ``wait`` s)."""
    scope = "tenant" if b.key.startswith("t:") else "key"
    budget = "tokens" if b.tokens else "requests"
    per = "minute" if b.period == 60.0 else "day"
    need = f"{tokens} tokens" if b.tokens else ("1 request" if requests == 1 else f"{requests} requests")
    return error(
        Code.TOKENS_BUDGET if b.tokens else Code.REQUESTS_BUDGET,
        f"Rate limit reached on {budget} per {per} for this {scope} (`{b.field}`): limit "
        f"{b.cap}, remaining {max(0, math.floor(level))}, this request needs {need}. "
        f"Retry after {math.ceil(wait)} s.",
        retry_after=max(wait, 0.001),
        ratelimit=rl,
    )
