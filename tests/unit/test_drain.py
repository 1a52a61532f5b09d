"""Router drain (router.lifecycle.drain): its pure decisions and its state, against a
fake lifecycle and a hand-moved clock."""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeClock

from router.lifecycle.drain import RouterDrain, token_time, worth_starting
from shared import protocol as p


def test_a_request_stays_queued_only_while_its_whole_generation_fits_before_the_deadline() -> None:
    assert worth_starting(now=10.0, deadline=20.0, max_tokens=100, token_s=0.05)  # 5 s of 10 left
    assert worth_starting(now=15.0, deadline=20.0, max_tokens=100, token_s=0.05)  # exactly fits
    assert not worth_starting(now=15.1, deadline=20.0, max_tokens=100, token_s=0.05)
    assert not worth_starting(now=10.0, deadline=20.0, max_tokens=1000, token_s=0.05)


def test_nothing_measured_keeps_it_until_the_deadline_itself() -> None:
    assert worth_starting(now=19.9, deadline=20.0, max_tokens=10_000, token_s=0.0)
    assert not worth_starting(now=20.0, deadline=20.0, max_tokens=1, token_s=0.0)


def test_token_time_is_the_median_rate_of_the_streams_running() -> None:
    assert token_time([]) == 0.0
    assert token_time([(1.0, 1), (0.0, 50)]) == 0.0  # one token, or no time: no rate
    assert token_time([(1.0, 11), (2.0, 11), (10.0, 11)]) == pytest.approx(0.2)


class FakeCore:
    """The lifecycle as a drain sees it: jobs with their tokens so far."""

    def __init__(self) -> None:
        self.draining = False
        self.jobs: dict[str, tuple[int, float, int]] = {}  # id -> (max_tokens, first token at, tokens)
        self.ended: dict[str, p.ErrorInfo] = {}

    def drain_view(self, now: float) -> tuple[list[tuple[str, int]], list[tuple[float, int]]]:
        waiting = [(jid, mt) for jid, (mt, _, n) in self.jobs.items() if n == 0]
        running = [(now - t, n) for _, t, n in self.jobs.values() if n]
        return waiting, running

    def job_ids(self) -> list[str]:
        return list(self.jobs)

    def end_job(self, job_id: str, err: p.ErrorInfo) -> None:
        del self.jobs[job_id]
        self.ended[job_id] = err

    def live_jobs(self) -> int:
        return len(self.jobs)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_drain_sheds_what_cannot_finish_keeps_the_rest_and_ends_it_at_the_deadline(loop) -> None:
    clock, core = FakeClock(100.0), FakeCore()
    # a stream at 0.1 s a token (10 s since its first, 101 tokens); a short and a long one queued
    core.jobs = {"run": (500, 90.0, 101), "short": (20, 0.0, 0), "long": (200, 0.0, 0)}
    drain = RouterDrain(core, loop, timeout_s=10.0, clock=clock)
    drain.start("test")
    assert core.draining and drain.deadline == 110.0
    # 200 tokens x 0.1 s > 10 s left: refused now with a retryable 503; 20 tokens fit
    assert list(core.ended) == ["long"] and core.ended["long"].code == "router_draining"
    assert core.ended["long"].status == 503 and core.ended["long"].retry_after
    assert not drain.done.is_set() and drain.shed == 1
    clock.t = 108.5  # now 2 s of "short" no longer fit: shed on the next tick
    drain._tick()
    assert "short" in core.ended and drain.shed == 2
    clock.t = 110.0  # the deadline: what still runs ends with an error, and the drain is done
    drain._tick()
    assert "run" in core.ended and "drain timeout" in core.ended["run"].message
    assert drain.cut_at_deadline == 1 and drain.done.is_set()
    drain.close()


def test_a_drain_with_nothing_running_is_done_at_once_and_start_is_idempotent(loop) -> None:
    clock, core = FakeClock(), FakeCore()
    drain = RouterDrain(core, loop, timeout_s=30.0, clock=clock)
    assert not drain.started
    drain.start("test")
    deadline = drain.deadline
    clock.t += 5
    drain.start("again")
    assert drain.done.is_set() and drain.deadline == deadline


def test_finish_now_ends_everything_with_error_events(loop) -> None:
    clock, core = FakeClock(), FakeCore()
    core.jobs = {"a": (10, 999.0, 3), "b": (10, 0.0, 0)}
    drain = RouterDrain(core, loop, timeout_s=30.0, clock=clock)
    drain.start("SIGTERM")
    assert not core.ended  # both fit: nothing measured is slow
    drain.finish_now("SIGINT")
    assert set(core.ended) == {"a", "b"} and drain.done.is_set()
    assert all(e.code == "router_draining" for e in core.ended.values())
    drain.close()
