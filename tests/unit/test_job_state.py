"""The job state machine (router.lifecycle.jobs): the one table of transitions and the one function that makes them."""

from __future__ import annotations

import itertools

import pytest
from fakes import FakeSink

from router.lifecycle.jobs import TRANSITIONS, IllegalTransition, JobRecord, JobState, advance
from router.tenancy.identity import Identity
from shared import protocol as p

S = JobState


def record(state: JobState = S.TOKENIZING, worker: str | None = None) -> JobRecord:
    j = JobRecord("1", p.Submit("c", "m", prompt="x"), FakeSink(), Identity("t", "normal", 1.0), 0.0)
    j.state, j.worker = state, worker
    return j


LEGAL = {(a, b) for a, nexts in TRANSITIONS.items() for b in nexts}


def test_the_lifecycle_edges_are_exactly_these():
    assert LEGAL == {
        (S.TOKENIZING, S.AWAITING_BUDGET),
        (S.TOKENIZING, S.QUEUED),
        (S.TOKENIZING, S.ENDED),
        (S.AWAITING_BUDGET, S.QUEUED),
        (S.AWAITING_BUDGET, S.ENDED),
        (S.QUEUED, S.QUEUED),
        (S.QUEUED, S.RUNNING),
        (S.QUEUED, S.ENDED),
        (S.RUNNING, S.QUEUED),
        (S.RUNNING, S.ENDED),
    }


@pytest.mark.parametrize("src,dst", [e for e in itertools.product(S, S) if e not in LEGAL])
def test_an_illegal_transition_is_refused_and_changes_nothing(src, dst):
    j = record(src, "w0" if src is S.RUNNING else None)
    with pytest.raises(IllegalTransition):
        advance(j, dst, "w0" if dst is S.RUNNING else None)
    assert j.state is src


def test_running_needs_a_worker_and_only_running_has_one():
    j = record(S.QUEUED)
    with pytest.raises(IllegalTransition):
        advance(j, S.RUNNING)
    with pytest.raises(IllegalTransition):
        advance(j, S.QUEUED, "w0")
    advance(j, S.RUNNING, "w0")
    assert (j.state, j.worker) == (S.RUNNING, "w0")
    advance(j, S.QUEUED)  # its worker lost: queued again, and no worker's news counts
    assert (j.state, j.worker) == (S.QUEUED, None)


def test_every_state_can_end_and_an_end_is_final():
    reach = {s: {s} for s in S}
    for _ in S:  # transitive closure
        for s in S:
            reach[s] |= {c for n in reach[s] for c in TRANSITIONS[n]}
    assert all(S.ENDED in reach[s] for s in S)
    assert TRANSITIONS[S.ENDED] == frozenset()
    j = record(S.RUNNING, "w0")
    advance(j, S.ENDED)
    with pytest.raises(IllegalTransition):  # a second end is a bug, not a no-op
        advance(j, S.ENDED)


def test_a_walk_through_every_legal_path_of_up_to_six_steps_ends_once():
    """Each path from admission that reaches ENDED does so exactly once and stops there."""
    paths = [[S.TOKENIZING]]
    for _ in range(6):
        paths = [path + [n] for path in paths for n in TRANSITIONS[path[-1]]] + [
            path for path in paths if path[-1] is S.ENDED
        ]
    for path in paths:
        j = record()
        for s in path[1:]:
            advance(j, s, "w0" if s is S.RUNNING else None)
        assert path.count(S.ENDED) <= 1 and j.state is path[-1]
