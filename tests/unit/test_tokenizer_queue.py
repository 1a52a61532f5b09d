"""router.lifecycle.tokenizer_queue.FairQueue: who runs next on the tokenizer threads.
Short prompts first and never waiting for a long prompt or a call (a thread
is always free of those), per tenant FIFO, tenants round robin, calls bounded
and on at most their own threads (a long prompt never waits behind a call),
under any sequence of pushes, pops and ends (hypothesis); and the pool's size
from the config."""

from __future__ import annotations

import os
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.lifecycle.tokenizer_queue import (
    CALL,
    KINDS,
    MIN_THREADS,
    PROMPT,
    SHORT,
    FairQueue,
    cgroup_cpu_quota,
    cores,
    pool_threads,
)

TENANTS = ["a", "b", "c"]


def test_a_prompt_goes_before_another_tenants_backlog_of_calls():
    q: FairQueue[str] = FairQueue(threads=2, call_threads=1, calls_per_tenant=64, calls_total=256)
    for i in range(32):
        assert q.push(CALL, "a", f"a{i}")
    assert q.push(PROMPT, "b", "b-prompt")
    assert q.push(CALL, "c", "c-call")
    assert q.pop() == (CALL, "a0", False)
    assert q.pop() == (PROMPT, "b-prompt", False)  # the other thread: a prompt never waits behind a call
    assert q.pop() is None  # both threads busy
    q.done(CALL)
    assert q.pop() == (CALL, "c-call", False)  # round robin: c's one call before a's second
    q.done(CALL)
    assert q.pop() == (CALL, "a1", False)


def test_a_short_prompt_never_waits_behind_a_burst_of_long_ones():
    # 150 agent prompts of 220 KB from one tenant (~150 ms each), then its 2 KB prompt
    q: FairQueue[str] = FairQueue(threads=2, call_threads=1, calls_per_tenant=32, calls_total=256)
    for i in range(150):
        assert q.push(PROMPT, "a", f"long{i}")
    assert q.push(CALL, "b", "call")
    assert [q.pop(), q.pop()] == [(CALL, "call", False), (PROMPT, "long0", False)]
    assert q.pop() is None  # the spare thread stays free: heavy work has its two
    assert q.push(SHORT, "a", "short")
    assert q.pop() == (SHORT, "short", True)  # at once, on the spare thread, not after 149 long ones
    assert q.push(SHORT, "a", "short2")
    assert q.pop() is None  # (it waits for the short one, only)
    q.done(SHORT, True)
    assert q.pop() == (SHORT, "short2", True)
    q.done(SHORT, True)
    q.done(PROMPT)
    assert q.push(SHORT, "c", "short-c") and q.push(SHORT, "c", "short-c2")
    assert q.pop() == (SHORT, "short-c", True)  # ahead of the long ones queued before it
    assert q.pop() == (PROMPT, "long1", False)  # the free heavy thread: long work waits for it
    assert q.pop() is None  # short-c2 waits for the short thread only
    q.done(SHORT, True)
    assert q.pop() == (SHORT, "short-c2", True)


def test_a_stream_of_short_prompts_never_holds_back_long_ones():
    # tenant a keeps short prompts queued; tenant b's long prompt still gets a heavy thread at once
    q: FairQueue[str] = FairQueue(threads=2, call_threads=1, calls_per_tenant=32, calls_total=256)
    for i in range(20):
        assert q.push(SHORT, "a", f"short{i}")
    assert q.pop() == (SHORT, "short0", True)
    assert q.pop() == (SHORT, "short1", False)  # no heavy work waits: a free heavy thread is used
    assert q.push(PROMPT, "b", "long")
    assert q.push(CALL, "c", "call")
    assert [q.pop(), q.pop()] == [(CALL, "call", False), None]  # both heavy threads taken
    q.done(SHORT, False)
    assert q.pop() == (PROMPT, "long", False)  # not a's next short prompt
    q.done(SHORT, True)
    assert q.pop() == (SHORT, "short2", True)


def test_the_pool_follows_the_config_and_the_cores():
    assert pool_threads(8) == (8, 4)
    assert pool_threads(3) == (3, 1)
    assert pool_threads(1) == (MIN_THREADS, 1)  # calls on one at most, one left to long prompts
    assert pool_threads(0) == (max(MIN_THREADS, cores()), max(MIN_THREADS, cores()) // 2)
    assert cores(lambda path: None) == len(os.sched_getaffinity(0))


def _files(**texts: str):
    """A ``read`` over fixture files: /proc/self/cgroup as ``proc``, the rest by path under /sys/fs/cgroup."""
    paths = {("/proc/self/cgroup" if k == "proc" else k): v for k, v in texts.items()}
    return paths.get


V2 = "0::/kubepods/pod1/c1\n"
V1 = "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n0::/\n"
Q1 = "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us"
P1 = "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us"


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        # cgroup v2, the process at the root (a container with its own cgroup namespace)
        ({"proc": "0::/\n", "/sys/fs/cgroup/cpu.max": "150000 100000\n"}, 2),  # --cpus 1.5: rounded up
        ({"proc": "0::/\n", "/sys/fs/cgroup/cpu.max": "20000 100000\n"}, 1),
        ({"proc": "0::/\n", "/sys/fs/cgroup/cpu.max": "max 100000\n"}, None),
        # v2, nested: the smallest quota on the way up, the process's own cgroup's or an ancestor's
        (
            {
                "proc": V2,
                "/sys/fs/cgroup/cpu.max": "max 100000",
                "/sys/fs/cgroup/kubepods/cpu.max": "400000 100000",
                "/sys/fs/cgroup/kubepods/pod1/cpu.max": "250000 100000",
                "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000",
            },
            3,
        ),
        ({"proc": V2, "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "100000 50000"}, 2),
        ({"proc": V2, "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000"}, None),
        # v1: the cpu controller's line and its mount (cpu,cpuacct or cpu)
        ({"proc": V1, Q1: "50000\n", P1: "100000\n"}, 1),
        ({"proc": V1, Q1: "300000\n", P1: "100000\n"}, 3),
        ({"proc": V1, Q1: "-1\n", P1: "100000\n"}, None),  # unlimited
        (
            {
                "proc": "4:cpu:/x\n3:cpuacct:/x\n",
                "/sys/fs/cgroup/cpu/x/cpu.cfs_quota_us": "200000",
                "/sys/fs/cgroup/cpu/x/cpu.cfs_period_us": "100000",
            },
            2,
        ),
        # v1 in a container: /proc/self/cgroup names the host's path, the mount is the container's own
        (
            {
                "proc": V1,
                "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000",
                "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
            },
            2,
        ),
        # missing or unreadable files: no quota; no /proc/self/cgroup: the root's cpu.max
        ({"proc": V2}, None),
        ({"proc": V1, Q1: "50000"}, None),  # the period missing
        ({}, None),
        ({"/sys/fs/cgroup/cpu.max": "300000 100000"}, 3),
        ({"proc": "0::/\n", "/sys/fs/cgroup/cpu.max": "garbage\n"}, None),
        ({"proc": V1, Q1: "x", P1: "100000"}, None),
    ],
)
def test_the_cgroup_cpu_quota_is_the_smallest_on_the_process_cgroups_path(files, quota):
    assert cgroup_cpu_quota(_files(**files)) == quota


def test_the_cores_are_capped_by_the_cgroups_cpu_quota():
    affinity = len(os.sched_getaffinity(0))
    nested = _files(proc=V2, **{"/sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000"})
    assert cores(nested) == min(affinity, 2)
    assert cores(_files(proc=V1, **{Q1: "20000", P1: "100000"})) == 1
    assert cores(_files(proc=V2)) == affinity  # no quota: the affinity alone


def test_calls_are_bounded_per_tenant_and_in_all_prompts_never():
    q: FairQueue[int] = FairQueue(threads=2, call_threads=1, calls_per_tenant=2, calls_total=3)
    assert q.push(CALL, "a", 1) and q.push(CALL, "a", 2)
    assert not q.push(CALL, "a", 3)  # a's bound
    assert q.push(CALL, "b", 4)
    assert not q.push(CALL, "c", 5)  # the total
    assert all(q.push(PROMPT, "a", i) for i in range(100))
    assert q.pop() == (CALL, 1, False)  # running: no longer queued, so a has room again
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
@given(
    ops=ops,
    threads=st.integers(1, 4),
    spare=st.integers(1, 2),
    per_tenant=st.integers(1, 4),
    total=st.integers(1, 8),
)
def test_fifo_round_robin_bounded_short_first_and_prompts_keep_a_thread(ops, threads, spare, per_tenant, total):
    call_threads = max(1, threads - 1)
    q: FairQueue[tuple[str, str, int]] = FairQueue(threads, call_threads, per_tenant, total, spare)
    waiting = {k: {t: deque() for t in TENANTS} for k in KINDS}
    served_while_waiting = {k: {t: Counter() for t in TENANTS} for k in KINDS}
    running: list[tuple[str, bool]] = []  # (kind, on a spare thread)
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
            on_heavy = [k for k, sp in running if not sp]
            got = q.pop()
            if got is None:
                if any(waiting[SHORT].values()):  # a short prompt waits only for short ones
                    assert [k for k, sp in running if sp] == [SHORT] * spare and len(on_heavy) == threads
                calls_may = any(waiting[CALL].values()) and on_heavy.count(CALL) < call_threads
                assert len(on_heavy) >= threads or (not any(waiting[PROMPT].values()) and not calls_may)
                continue
            kind, item, on_spare = got
            _, tenant, _ = item
            spare_full = sum(sp for _, sp in running) == spare
            if kind != SHORT:  # short prompts go first: they wait only while their threads are full
                assert not any(waiting[SHORT].values()) or spare_full
            assert waiting[kind][tenant].popleft() == item  # FIFO within a tenant and kind
            for other in TENANTS:  # round robin: while one waits, no other tenant is served twice
                if other != tenant and waiting[kind][other]:
                    served_while_waiting[kind][other][tenant] += 1
                    assert served_while_waiting[kind][other][tenant] <= 1
            served_while_waiting[kind][tenant].clear()
            if on_spare:
                assert kind == SHORT  # the spare threads are short prompts' alone
            elif kind == SHORT:  # on a heavy thread: only with its own threads full and no heavy work waiting
                calls_may = any(waiting[CALL].values()) and on_heavy.count(CALL) < call_threads
                assert spare_full and not any(waiting[PROMPT].values()) and not calls_may
            running.append((kind, on_spare))
            on_heavy = [k for k, sp in running if not sp]
            assert len(on_heavy) <= threads and sum(sp for _, sp in running) <= spare  # each pool's size
            assert on_heavy.count(CALL) <= call_threads
            if threads > 1:
                assert on_heavy.count(CALL) < threads  # a thread is always left to long prompts
        elif running:
            kind, on_spare = running.pop(op[1] % len(running))
            q.done(kind, on_spare)
        for k in KINDS:
            assert q.queued[k] == sum(len(d) for d in waiting[k].values())
