"""The budgets' fan-out arithmetic (router.tenancy.buckets, .budgets), without the lifecycle: a request of k
jobs takes its k request units in one reservation (router.tenancy.budgets.Group) or
none; it is never charged more than k, and any refusal among its jobs gives
every unit back.  The lifecycle around it: tests/inproc/test_budgets.py."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from router.observe.metrics import RouterMetrics
from router.tenancy.buckets import Bucket, Hold, costs, settle_amounts, too_large
from router.tenancy.budgets import BudgetLedger, Group
from router.tenancy.identity import Identity
from router.tenancy.store_memory import MemoryBudgetStore
from shared.config import Config
from shared.keys import config_digest, digest, key_id

KEY = "sk-groups"
RPM = Bucket("k:x:rpm", 10, 60.0, False, "requests_per_minute")
TPM = Bucket("k:x:tpm", 500, 60.0, True, "tokens_per_minute")


def test_costs_and_settle_amounts_count_request_units_per_hold():
    assert costs((RPM, TPM), 40) == [1, 40]
    assert costs((RPM, TPM), 40, requests=0) == [0, 40]  # a fan-out's job: its group took the unit
    assert costs((RPM, TPM), 0, requests=7) == [7, 0]
    group_hold = Hold((RPM,), 0, "a", requests=7)
    assert settle_amounts(group_hold, 0, refund_request=True) == [7]
    assert settle_amounts(group_hold, 0, refund_request=False) == [0]
    job_hold = Hold((RPM, TPM), 50, "a", requests=0)
    assert settle_amounts(job_hold, 12, refund_request=True) == [0, 38]


def test_too_large_names_the_budget_a_request_could_never_fit():
    assert too_large((RPM, TPM), 500, 10) is None
    assert too_large((RPM, TPM), 501, 1) is TPM
    assert too_large((RPM, TPM), 10, 11) is RPM


class _Frozen(MemoryBudgetStore):
    """No refill: what is taken can be compared exactly."""

    def level(self, b, now):
        return super().level(b, 0.0)

    def reserve(self, buckets, amounts, now):
        return super().reserve(buckets, amounts, 0.0)

    def credit(self, buckets, amounts, now):
        super().credit(buckets, amounts, 0.0)


def _quota(rpm: int) -> tuple[BudgetLedger, Identity]:
    cfg = msgspec.convert(
        {
            "models": [{"name": "m", "engine": "sim"}],
            "api_keys": [{"key_sha256": digest(KEY), "tenant": "a", "requests_per_minute": rpm}],
        },
        Config,
    )
    q = BudgetLedger(cfg, RouterMetrics(), clock=lambda: 0.0, store=_Frozen())
    return q, Identity("a", "standard", 1.0, key_id(config_digest(cfg.api_keys[0])))


def _level(q: BudgetLedger) -> float:
    (b,) = next(iter(q.by_key.values()))
    return q.store.level(b, 0.0)


@given(
    rpm=st.integers(1, 30),
    used=st.integers(0, 30),
    k=st.integers(2, 40),
    jobs=st.lists(st.sampled_from(["queued", "refused"]), max_size=40),
    fan_out_failed=st.booleans(),
    close_first=st.booleans(),
)
def test_a_group_is_charged_k_units_or_nothing(rpm, used, k, jobs, fan_out_failed, close_first):
    """Whatever its jobs do: at most k units taken while it runs; at its
    settle, exactly k if all its jobs were queued, else every unit back."""
    q, who = _quota(rpm)
    used = min(used, rpm)
    for _ in range(used):  # single requests already counted
        assert isinstance(q.reserve(who, 1, lambda _: None), Hold)
    before = _level(q)
    group = Group(k)
    refused = q.open_group(who, group)
    jobs = jobs[:k]
    if k > rpm:
        assert refused is not None and refused.status == 400 and refused.code == "request_exceeds_budget"
    elif k > before:
        assert refused is not None and refused.status == 429 and refused.retry_after > 0
    else:
        assert refused is None and _level(q) == before - k
    assert _level(q) >= before - k
    if refused is not None:
        assert _level(q) == before  # refused whole: nothing taken
        group.close(failed=True)
        assert _level(q) == before and q.outstanding == used
        return
    for _ in jobs:
        group.joined()
    if close_first:
        group.close(fan_out_failed)
    for outcome in jobs:
        group.left(queued=outcome == "queued")
        assert _level(q) in (before - k, before)  # never in between: all or nothing
    if not close_first:
        group.close(fan_out_failed)
    assert group.settled and q.outstanding == used
    charged = not fan_out_failed and all(o == "queued" for o in jobs)
    assert _level(q) == (before - k if charged else before)
