"""The worker's own ledger: the one authority on what its engine holds, across routers.

Several routers may dispatch to one worker (README: Scaling out).  Each
reserves KV and a sequence slot in its own policy, but none sees the others'
reservations at once, so together they could over-commit the worker by up to
N x.  The worker sees every dispatch: it admits one only if the KV tokens the
router priced it at (``GenerateRequest.kv_tokens``) and one more sequence fit
its budget -- the same ``SchedulerConfig.kv_budget`` / ``seq_slots`` the
routers' policies use -- with everything it holds for all routers; otherwise
the dispatch is refused at once (``protocol.Refuse``) and never reaches the
engine.  So the engine never holds more than its budget, whatever the
routers' views, and never preempts (with ``overcommit`` 1.0).

Pure: no I/O, no clock.  The worker process (engine_worker.worker) calls
``admit`` on a Dispatch, ``release`` on a request's final Delta (or an
abort nobody is told of), ``drop`` when it loses a router, and reports
``others(router)`` in that router's heartbeats so each router's view
converges on the worker's.  Property-tested over interleavings of K routers
(tests/unit/test_arbitration_properties.py).
"""

from __future__ import annotations


def kv_tokens_of(prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """KV tokens of a dispatch whose router did not state them (an older
    router): prompt + max_tokens per sequence, whole blocks, no sharing --
    the most ``router.policy.estimate.kv_cost`` ever charges."""
    bs = max(1, block_size)
    per_seq = -(-(max(1, prompt_tokens) + max(0, max_tokens)) // bs) * bs
    return per_seq * max(1, n)


class Ledger:
    """KV tokens and sequences held, per (router, request id)."""

    __slots__ = ("budget", "slots", "held", "tokens", "by_router", "refused")

    def __init__(self, budget_tokens: int, slots: int) -> None:
        self.budget = budget_tokens
        self.slots = slots
        self.held: dict[tuple[int, str], int] = {}  # (router, request id) -> KV tokens
        self.tokens = 0  # sum of held
        self.by_router: dict[int, list[int]] = {}  # router -> [tokens, seqs]
        self.refused = 0  # dispatches refused so far

    @property
    def seqs(self) -> int:
        return len(self.held)

    def admit(self, router: int, request_id: str, tokens: int) -> bool:
        """Take a dispatch if it fits with everything held, else refuse it.
        A duplicate (the same router and id again) is already held: True,
        counted once.  An empty worker takes any one request within its
        budget (as the policy: a request that fits no worker is a 400)."""
        key = (router, request_id)
        if key in self.held:
            return True
        tokens = max(0, tokens)
        if tokens > self.budget or self.tokens + tokens > self.budget or len(self.held) >= self.slots:
            self.refused += 1
            return False
        self.held[key] = tokens
        self.tokens += tokens
        row = self.by_router.get(router)
        if row is None:
            row = self.by_router[router] = [0, 0]
        row[0] += tokens
        row[1] += 1
        return True

    def release(self, router: int, request_id: str) -> bool:
        """The request ended (any way): idempotent; True iff it was held."""
        tokens = self.held.pop((router, request_id), None)
        if tokens is None:
            return False
        self.tokens -= tokens
        row = self.by_router[router]
        row[0] -= tokens
        row[1] -= 1
        if row[1] == 0:
            del self.by_router[router]
        return True

    def drop(self, router: int) -> list[str]:
        """That router is gone (silent, said Goodbye, restarted): release all
        it held here and return those request ids (the worker stops them)."""
        ids = [rid for (r, rid) in self.held if r == router]
        for rid in ids:
            self.release(router, rid)
        return ids

    def held_by(self, router: int) -> tuple[int, int]:
        row = self.by_router.get(router)
        return (row[0], row[1]) if row is not None else (0, 0)

    def others(self, router: int) -> tuple[int, int]:
        """KV tokens and sequences held here for every router but this one."""
        t, s = self.held_by(router)
        return self.tokens - t, len(self.held) - s
