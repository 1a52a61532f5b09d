"""router.lifecycle.tokenizer_queue.FairQueue: who runs next on the tokenizer threads.
Short prompts first and never waiting for a long prompt or a call (a thread
is always free of those), per tenant FIFO, tenants round robin, calls bounded
and on at most their own threads (a long prompt never waits behind a call),
under any sequence of pushes, pops and ends (hypothesis); and the pool's size
from the config."""

from __future__ import annotations

import os
from collections import Counter, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from router.lifecycle.tokenizer_queue import CALL, KINDS, MIN_THREADS, PROMPT, SHORT, FairQueue, cores, pool_threads

TENANTS = ["a", "b", "c"]


def test_a_prompt_goes_before_another_tenants_backlog_of_calls():
    q: FairQueue[str] = FairQueue(threads=2, call_threads=1, calls_per_tenant=64, calls_total=256)
    for i in range(32):
        assert q.push(CALL, "a", f"a{i}")
    assert q.push(PROMPT, "b", "b-prompt")
    assert q.push(CALL, "c", "c-call")
    assert q.pop() == (CALL, "a0")
    assert q.pop() == (PROMPT, "b-prompt")  # the other thread: a prompt never waits behind a call
    assert q.pop() is None  # both threads busy
    q.done(CALL)
    assert q.pop() == (CALL, "c-call")  # round robin: c's one call before a's second
    q.done(CALL)
    assert q.pop() == (CALL, "a1")


def test_a_short_prompt_never_waits_behind_a_burst_of_long_ones():
    # 150 agent prompts of 220 KB from one tenant (~150 ms each), then its 2 KB prompt
    q: FairQueue[str] = FairQueue(threads=2, call_threads=1, calls_per_tenant=32, calls_total=256)
    for i in range(150):
        assert q.push(PROMPT, "a", f"long{i}")
    assert q.push(CALL, "b", "call")
    assert [q.pop(), q.pop()] == [(CALL, "call"), (PROMPT, "long0")]
    assert q.pop() is None  # the third thread stays free: heavy work has its two
    assert q.push(SHORT, "a", "short")
    assert q.pop() == (SHORT, "short")  # at once, on the free thread, not after 149 long ones
    assert q.pop() is None
    q.done(SHORT)
    q.done(PROMPT)
    assert q.push(SHORT, "c", "short-c")
    assert q.pop() == (SHORT, "short-c")  # ahead of the long ones queued before it
    assert q.pop() == (PROMPT, "long1")


def test_the_pool_follows_the_config_and_the_cores():
    assert pool_threads(8) == (8, 4)
    assert pool_threads(3) == (3, 1)
    assert pool_threads(1) == (MIN_THREADS, 1)  # calls on one at most, one left to long prompts
    assert pool_threads(0) == (max(MIN_THREADS, cores()), max(MIN_THREADS, cores()) // 2)
    assert cores() == len(os.sched_getaffinity(0))


def test_calls_are_bounded_per_tenant_and_in_all_prompts_never():
    q: FairQueue[int] = FairQueue(threads=2, call_threads=1, calls_per_tenant=2, calls_total=3)
    assert q.push(CALL, "a", 1) and q.push(CALL, "a", 2)
    assert not q.push(CALL, "a", 3)  # a's bound
    assert q.push(CALL, "b", 4)
    assert not q.push(CALL, "c", 5)  # the total
    assert all(q.push(PROMPT, "a", i) for i in range(100))
    assert q.pop() == (CALL, 1)  # running: no longer queued, so a has room again
    assert q.push(CALL, "c", 6)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(KINDS), st.sampled_from(TENANTS)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("done"), st.integers(0, 10)),
    ),
    max_size=120,
)


@settings(max_examples=400)
@given(ops=ops, threads=st.integers(1, 4), per_tenant=st.integers(1, 4), total=st.integers(1, 8))
def test_fifo_round_robin_bounded_short_first_and_prompts_keep_a_thread(ops, threads, per_tenant, total):
    call_threads = max(1, threads - 1)
    q: FairQueue[tuple[str, str, int]] = FairQueue(threads, call_threads, per_tenant, total)
    waiting = {k: {t: deque() for t in TENANTS} for k in KINDS}
    served_while_waiting = {k: {t: Counter() for t in TENANTS} for k in KINDS}
    running: list[str] = []
    n = 0
    for op in ops:
        if op[0] == "push":
            _, kind, tenant = op
            n += 1
            queued_calls = sum(len(d) for d in waiting[CALL].values())
            over = kind == CALL and (len(waiting[CALL][tenant]) >= per_tenant or queued_calls >= total)
            assert q.push(kind, tenant, (kind, tenant, n)) is not over  # bounded: calls only
            if not over:
                if not waiting[kind][tenant]:
                    served_while_waiting[kind][tenant].clear()
                waiting[kind][tenant].append((kind, tenant, n))
        elif op[0] == "pop":
            heavy = running.count(PROMPT) + running.count(CALL)
            got = q.pop()
            if got is None:
                if any(waiting[SHORT].values()):  # a short prompt waits only for a short one
                    assert len(running) == threads + 1 and running.count(SHORT) >= 1
                heavy_free = heavy < threads and len(running) <= threads
                calls_may = any(waiting[CALL].values()) and running.count(CALL) < call_threads
                assert not heavy_free or (not any(waiting[PROMPT].values()) and not calls_may)
                continue
            kind, item = got
            _, tenant, _ = item
            if kind != SHORT:
                assert not any(waiting[SHORT].values())  # short prompts go first
            assert waiting[kind][tenant].popleft() == item  # FIFO within a tenant and kind
            for other in TENANTS:  # round robin: while one waits, no other tenant is served twice
                if other != tenant and waiting[kind][other]:
                    served_while_waiting[kind][other][tenant] += 1
                    assert served_while_waiting[kind][other][tenant] <= 1
            served_while_waiting[kind][tenant].clear()
            running.append(kind)
            heavy = running.count(PROMPT) + running.count(CALL)
            assert len(running) <= threads + 1 and heavy <= threads  # a thread always free of heavy work
            assert running.count(CALL) <= call_threads
            if threads > 1:
                assert running.count(CALL) < threads  # a thread is always left to long prompts
        elif running:
            kind = running.pop(op[1] % len(running))
            q.done(kind)
        for k in KINDS:
            assert q.queued[k] == sum(len(d) for d in waiting[k].values())
