"""The router's request lifecycle (router.lifecycle.core) in-process: no sockets, no processes.

A fake worker port records dispatches and aborts, fake sinks record what
each request's client would see, and a fake clock drives deadlines (after
vLLM's MockEngineCore pattern; fakes, beside the ports they fake).
Every test checks the two promises every exit must keep: the client hears
exactly one final Delta, and the KV ledger is back to zero.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from fakes import FakeClock as Clock
from fakes import FakeSink as Sink
from fakes import FakeWorkers, registration
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.lifecycle.core import RouterCore
from router.lifecycle.jobs import JobState
from router.lifecycle.prompts import ModelPrompts
from shared import protocol as p
from shared.config import Config

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"


def config(**scheduler) -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "scheduler": {"generation_deadline_s": 30.0, **scheduler},
            "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}],
        },
        Config,
    )


def register(worker_id: str, seqs: int = 4, kv: int = 8192, model: str = "sim-m") -> p.Register:
    return registration(worker_id, model, kv=kv, seqs=seqs)


class Harness:
    def __init__(self, cfg: Config | None = None, prompts=None) -> None:
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.workers = FakeWorkers()
        self.core = RouterCore(cfg or config(), self.loop, self.workers, clock=self.clock, prompts=prompts)
        self.sinks: dict[int, Sink] = {}
        self.attempt_tokens: dict[tuple[str, str, int], int] = {}

    def close(self) -> None:
        self.core.close()
        self.loop.close()

    def settle(self) -> None:
        """Run what the lifecycle scheduled (policy passes, tokenizer callbacks)."""
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))

    def join(self, worker_id: str, **kw) -> None:
        self.workers.linked.add(worker_id)
        self.core.worker_joined(register(worker_id, **kw))

    def leave(self, worker_id: str, why: str = "heartbeat_timeout") -> None:
        self.workers.linked.discard(worker_id)
        self.core.worker_left(worker_id, why)

    def submit(self, prompt: str = "hello", max_tokens: int = 8, model: str = "sim-m") -> int:
        sink = Sink()
        handle = self.core.submit(p.Submit("c", model, prompt=prompt, max_tokens=max_tokens), sink)
        assert isinstance(handle, int), handle
        self.sinks[handle] = sink
        return handle

    def ask(self, sub: p.Submit) -> tuple[int | p.ErrorInfo, Sink]:
        """Submit ``sub`` as it is: its handle (or the refusal) and its sink, settled."""
        sink = Sink()
        handle = self.core.submit(sub, sink)
        if isinstance(handle, int):
            self.sinks[handle] = sink
            self.settle()
        return handle, sink

    def tokens(self, handle: int, n: int = 1, finish: str | None = None, worker: str | None = None, **fields) -> None:
        """Engine news for a job, from the worker it runs on (or ``worker``);
        ``completion_tokens`` counts as an engine does: within its attempt."""
        job_id = "%x" % handle
        wid = worker or self.workers.where(job_id) or "nobody"
        attempt = (job_id, wid, self.workers.attempts.get(job_id, 0))
        done = self.attempt_tokens.get(attempt, 0) + n
        self.attempt_tokens[attempt] = done
        self.core.on_outputs(
            wid, [p.Delta(job_id, " t" * n, n, finish, completion_tokens=done, token_ids=[7] * n, **fields)]
        )

    def reserved(self) -> int:
        return sum(w.reserved for w in self.core.policy.workers.values())


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()


def test_a_request_runs_and_ends_once_with_its_ledger_released(h):
    h.join("w0")
    a = h.submit(max_tokens=3)
    h.settle()
    req = h.workers.dispatched["w0"][0]
    assert req.request_id == "%x" % a and req.params.max_tokens == 3 and req.prompt_tokens == 2
    assert h.reserved() > 0
    h.tokens(a, 2)
    h.tokens(a, 1, "length")
    assert [d.num_tokens for d in h.sinks[a].deltas] == [2, 1] and h.sinks[a].finals[0].finish_reason == "length"
    assert h.reserved() == 0 and not h.core.jobs
    h.tokens(a, 1, "stop")  # a late duplicate from the engine: nobody hears it
    assert len(h.sinks[a].deltas) == 2


def test_a_job_walks_its_states_and_only_a_running_one_has_a_worker(h):
    h.join("w0", seqs=1)
    a, b = h.submit(), h.submit()
    ja, jb = h.core.jobs["%x" % a], h.core.jobs["%x" % b]
    assert (ja.state, jb.state) == (JobState.QUEUED, JobState.QUEUED)  # short prompts: tokenized inline
    h.settle()
    assert (ja.state, ja.worker) == (JobState.RUNNING, "w0") and (jb.state, jb.worker) == (JobState.QUEUED, None)
    h.join("w1")
    h.leave("w0")  # a's worker is lost before any output: queued again, then placed on w1
    assert ja.state is JobState.QUEUED and ja.worker is None
    h.settle()
    assert {ja.worker, jb.worker} == {"w1"} and ja.state is jb.state is JobState.RUNNING
    h.tokens(a, 1, "stop")
    h.core.cancel(b)
    assert ja.state is jb.state is JobState.ENDED and ja.worker is jb.worker is None and not h.core.jobs


def test_the_clients_message_is_not_changed_by_admission(h):
    h.join("w0")
    sub = p.Submit("c", "sim-m", prompt="hello", params=p.SamplingParams(temperature=0.5))
    assert isinstance(h.core.submit(sub, Sink()), int)
    h.settle()
    assert sub.params.max_tokens == 0 and sub.max_tokens is None  # resolved for the worker only
    assert h.workers.dispatched["w0"][0].params.max_tokens == 4096 - 2


def test_worker_loss_requeues_what_had_not_started_and_resumes_what_had(h):
    h.join("w0", seqs=2)
    started, waiting = h.submit(max_tokens=5), h.submit()
    h.settle()
    h.join("w1")
    h.tokens(started, 2)
    h.leave("w0")
    assert h.sinks[waiting].deltas == [] and h.reserved() == 0
    h.settle()
    cont = h.workers.dispatched["w1"][-2:]
    assert {r.request_id for r in cont} == {"%x" % started, "%x" % waiting}
    (resumed,) = [r for r in cont if r.request_id == "%x" % started]
    assert (resumed.prompt_tokens, resumed.params.max_tokens) == (2 + 2, 3)  # prompt + 2 generated; 3 to go
    h.tokens(started, 1, prompt_tokens=4)  # the engine counts the continuation's prompt
    h.tokens(started, 2, "length", prompt_tokens=4)
    ds = h.sinks[started].deltas
    assert [d.completion_tokens for d in ds] == [2, 3, 5]  # one stream, cumulative counts
    assert ds[-1].finish_reason == "length" and ds[-1].prompt_tokens == 2  # the client's prompt
    assert h.reserved() > 0
    h.tokens(waiting, 1, "stop")
    assert h.reserved() == 0 and not h.core.jobs
    m = h.core.metrics
    assert m.child(m.resumed, "sim-m", "heartbeat_timeout").value == 1


def test_jobs_a_worker_reports_lost_resume_elsewhere_with_their_reservations_released_once(h):
    """Its engine died (the worker lives): it says Drain, then Lost for the
    jobs it ran -- each moves on exactly as a lost worker's would."""
    h.join("w0", seqs=3)
    started, waiting, other = h.submit(max_tokens=5), h.submit(), h.submit()
    h.settle()
    h.join("w1")
    h.tokens(started, 2)
    h.core.worker_stats("w0", p.WorkerStats(), accepting=False)  # its Drain ("engine restarting")
    w0 = h.core.policy.workers["w0"]
    assert w0.reserved > 0
    h.core.lost("w0", ["%x" % started, "%x" % waiting, "nope"], "engine_died")
    assert h.sinks[started].finals == [] and h.sinks[waiting].deltas == []
    h.settle()
    cont = h.workers.dispatched["w1"]
    assert {r.request_id for r in cont} == {"%x" % started, "%x" % waiting}
    (resumed,) = [r for r in cont if r.request_id == "%x" % started]
    assert (resumed.prompt_tokens, resumed.params.max_tokens) == (2 + 2, 3)  # prompt + 2 generated; 3 to go
    assert h.workers.where("%x" % other) == "w0" and w0.reserved == h.core.policy.cost_of("%x" % other)
    h.core.lost("w0", ["%x" % started], "engine_died")  # late, twice: it runs on w1 now
    assert h.workers.attempts["%x" % started] == 2 and h.workers.where("%x" % started) == "w1"
    h.tokens(started, 3, "length", prompt_tokens=4)
    assert [d.completion_tokens for d in h.sinks[started].deltas] == [2, 5]  # one stream
    assert h.sinks[started].finals[0].finish_reason == "length"
    h.tokens(waiting, 1, "stop")
    h.tokens(other, 1, "stop")
    assert h.reserved() == 0 and not h.core.jobs
    m = h.core.metrics
    assert m.child(m.resumed, "sim-m", "engine_died").value == 1


def test_late_news_from_a_lost_attempt_is_ignored(h):
    h.join("w0")
    h.join("w1")
    a = h.submit(max_tokens=10)
    h.settle()
    first = h.workers.where("%x" % a)
    other = "w1" if first == "w0" else "w0"
    h.tokens(a, 3)
    h.workers.linked.discard(first)
    h.core.worker_left(first, "unreachable")
    h.settle()
    assert h.workers.where("%x" % a) == other
    h.tokens(a, 4, "stop", worker=first)  # the old worker was not dead after all
    assert len(h.sinks[a].deltas) == 1 and not h.sinks[a].finals
    h.tokens(a, 7, "length")
    assert [d.completion_tokens for d in h.sinks[a].deltas] == [3, 10] and h.reserved() == 0


def test_resumes_are_bounded_then_a_clear_error(h):
    h.join("w0")
    a = h.submit(max_tokens=50)
    h.settle()
    for _ in range(2):  # max_resumes = 2: two continuations...
        h.tokens(a, 1)
        h.join("w0")  # restarted under it
        h.settle()
    h.tokens(a, 1)
    h.join("w0")  # ...and a third loss ends it
    err = h.sinks[a].finals[0].error
    assert err.code == "worker_lost" and "after 2 resumes" in err.message
    assert h.sinks[a].finals[0].completion_tokens == 3 and h.reserved() == 0


def test_with_no_worker_left_the_lost_work_waits_for_one(h):
    h.join("w0")
    a, b = h.submit(max_tokens=6), h.submit(max_tokens=6)
    h.settle()
    h.tokens(a, 2)
    h.leave("w0")  # the model's last worker
    assert h.sinks[a].finals == [] and h.sinks[b].deltas == []
    h.clock.t += 5
    h.join("w1")
    h.settle()
    assert {r.request_id for r in h.workers.dispatched["w1"]} == {"%x" % a, "%x" % b}
    h.tokens(a, 4, "length")
    h.tokens(b, 6, "length")
    assert [d.completion_tokens for d in h.sinks[a].deltas] == [2, 6]
    assert h.reserved() == 0 and not h.core.jobs
    c = h.submit()
    h.settle()
    h.leave("w1")
    h.clock.t += 61  # nobody came back within its queue deadline
    h.core.run_policy()
    assert h.sinks[c].finals[0].error.code == "queue_deadline" and h.reserved() == 0


def test_reregistration_is_a_loss_of_what_ran_there(h):
    h.join("w0")
    a = h.submit()
    h.settle()
    h.tokens(a, 1)
    h.join("w0")  # the same id registers again: it restarted, and the job resumes there
    h.settle()
    assert [r.prompt_tokens for r in h.workers.dispatched["w0"]] == [2, 3]
    assert h.workers.aborted == []  # (nothing to abort: the restarted worker runs nothing)


def test_the_watchdog_moves_a_job_its_worker_stopped_talking_about(h):
    h.join("w0")
    h.join("w1")
    quiet, chatty = h.submit(max_tokens=20), h.submit(max_tokens=20)
    h.settle()
    first = h.workers.where("%x" % quiet)
    h.tokens(quiet, 2)
    for _ in range(4):  # the other keeps streaming, and worker heartbeats would go on
        h.clock.t += 3
        h.tokens(chatty, 1)
        h.core.check_stalls()
    assert h.workers.aborted == [(first, "%x" % quiet)]  # after stall_timeout_s (10 s) of silence
    h.settle()
    again = h.workers.dispatched[h.workers.where("%x" % quiet)][-1]
    assert again.prompt_tokens == 2 + 2 and again.params.max_tokens == 18  # resumed where it was
    h.tokens(quiet, 18, "length", prompt_tokens=4)
    assert [d.completion_tokens for d in h.sinks[quiet].deltas] == [2, 20]
    h.tokens(chatty, 16, "length")
    assert h.reserved() == 0 and not h.core.jobs


def test_a_job_the_link_cannot_send_ends_with_an_error_not_a_wait(h):
    h.join("w0")
    a = h.submit()
    h.settle()
    h.core.undeliverable("%x" % a, p.ErrorInfo(500, "cannot encode", "server_error", "internal_error"))
    assert h.sinks[a].finals[0].error.status == 500 and h.reserved() == 0 and not h.core.jobs


def test_cancel_then_a_late_final_delta_is_one_end(h):
    h.join("w0")
    a = h.submit()
    h.settle()
    h.core.cancel(a)
    assert h.workers.aborted == [("w0", "%x" % a)] and h.reserved() == 0
    h.tokens(a, 1, "abort")  # the engine's answer to the abort
    h.core.cancel(a)  # and a second cancel
    assert h.sinks[a].deltas == [] and h.workers.aborted == [("w0", "%x" % a)]
    m = h.core.metrics
    assert m.child(m.requests, "sim-m", "normal", "cancelled").value == 1


def test_final_delta_then_a_late_cancel_is_one_end(h):
    h.join("w0")
    a = h.submit()
    h.settle()
    h.tokens(a, 1, "stop")
    h.core.cancel(a)
    assert len(h.sinks[a].finals) == 1 and h.workers.aborted == [] and h.reserved() == 0


def test_generation_deadline_aborts_then_the_finish_is_ignored(h):
    h.join("w0")
    a = h.submit()
    h.settle()
    h.tokens(a, 1)
    h.clock.t += 31  # past generation_deadline_s
    h.core.run_policy()
    assert h.sinks[a].finals[0].error.code == "generation_deadline"
    assert h.workers.aborted == [("w0", "%x" % a)] and h.reserved() == 0
    h.tokens(a, 1, "length")  # finished "just then" on the worker
    assert len(h.sinks[a].finals) == 1


def test_queue_deadline_refuses_with_retry_after(h):
    h.join("w0", seqs=1)
    a, b = h.submit(), h.submit()
    h.settle()
    h.clock.t += 61  # the default class's queue_deadline_s is 60
    h.core.run_policy()
    err = h.sinks[b].finals[0].error
    assert err.status == 503 and err.code == "queue_deadline" and err.retry_after >= 1
    h.tokens(a, 1, "stop")
    assert h.reserved() == 0 and not h.core.jobs


def test_a_dispatch_to_an_unlinked_worker_is_requeued_not_lost(h):
    h.join("w0")
    h.workers.refuse_next = True
    a = h.submit()
    h.settle()  # first placement fails, the job goes back and is placed again
    assert h.workers.where("%x" % a) == "w0" and h.sinks[a].deltas == []
    h.tokens(a, 1, "stop")
    assert h.reserved() == 0


def test_refusals_before_queueing_are_returned_not_sunk(h):
    assert h.core.submit(p.Submit("c", "sim-m", prompt="x"), Sink()).code == "no_worker"
    h.join("w0")
    assert h.core.submit(p.Submit("c", "nope", prompt="x"), Sink()).code == "model_not_found"
    assert h.core.submit(p.Submit("c", "sim-m", prompt=""), Sink()).param == "prompt"
    too_long = h.core.submit(p.Submit("c", "sim-m", prompt="x" * 8000, max_tokens=3000), Sink())
    assert too_long.code == "context_length_exceeded"
    assert "maximum context length is 4096" in too_long.message
    assert not h.core.jobs and h.reserved() == 0


@pytest.mark.skipif(not (TINY / "tokenizer.json").exists(), reason="models/tiny-llama not built")
def test_a_long_prompt_is_tokenized_off_the_loop_and_can_be_cancelled_meanwhile():
    cfg = msgspec.convert(
        {"models": [{"name": "tiny", "engine": "vllm", "path": str(TINY), "max_model_len": 100000}]}, Config
    )
    h = Harness(cfg, prompts={"tiny": ModelPrompts(str(TINY))})
    try:
        h.workers.linked.add("w0")
        h.core.worker_joined(msgspec.structs.replace(register("w0", kv=1 << 20), model="tiny", max_model_len=100000))
        text = "word " * 1000  # > INLINE_MAX_CHARS
        kept = h.submit(text, model="tiny")
        dropped = h.submit(text, model="tiny")
        assert "%x" % kept in h.core.jobs and not h.workers.dispatched  # tokenizing, not yet queued
        h.core.cancel(dropped)
        for _ in range(1000):  # (real time: the thread tokenizes meanwhile)
            h.loop.run_until_complete(asyncio.sleep(0.01))
            if h.workers.dispatched:
                break
        (req,) = h.workers.dispatched["w0"]
        assert req.request_id == "%x" % kept and req.prompt_tokens == len(req.prompt_token_ids) > 1000
        h.tokens(kept, 1, "stop")
        assert h.reserved() == 0 and not h.core.jobs and h.sinks[dropped].deltas == []
    finally:
        h.close()


class LifecycleMachine(RuleBasedStateMachine):
    """Any interleaving of submits, cancels, engine news, deadlines, worker
    losses and re-registrations: one final Delta per request, a ledger that
    never exceeds a budget, and zero reserved once everything has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(config(generation_deadline_s=5.0))
        self.handles: list[int] = []
        self.records = []  # every admitted job's record (router.lifecycle.jobs), kept past its end

    def teardown(self) -> None:
        self.h.close()

    @rule(w=st.sampled_from(["w0", "w1"]))
    def join(self, w):
        self.h.join(w, seqs=2, kv=1024)
        self.h.settle()

    @rule(w=st.sampled_from(["w0", "w1"]), why=st.sampled_from(["goodbye", "heartbeat_timeout"]))
    def leave(self, w, why):
        if w in self.h.workers.linked:
            self.h.leave(w, why)
            self.h.settle()

    @rule(max_tokens=st.integers(1, 200))
    def submit(self, max_tokens):
        result = self.h.core.submit(p.Submit("c", "sim-m", prompt="x" * 40, max_tokens=max_tokens), sink := Sink())
        if isinstance(result, int):
            self.h.sinks[result] = sink
            self.handles.append(result)
            self.records.append(self.h.core.jobs["%x" % result])  # in the table from submit on
        self.h.settle()

    @precondition(lambda self: self.handles)
    @rule(
        i=st.integers(0, 1000),
        n=st.integers(0, 3),
        finish=st.sampled_from([None, None, "stop", "length", "abort", "error"]),
    )
    def news(self, i, n, finish):
        handle = self.handles[i % len(self.handles)]
        wid = self.h.workers.where("%x" % handle) or "w0"
        if finish == "error":
            d = p.Delta("%x" % handle, error=p.ErrorInfo(500, "boom", "server_error", "engine_error"))
            self.h.core.on_outputs(wid, [d])
        else:
            self.h.tokens(handle, n, finish)
        self.h.settle()

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 1000), w=st.sampled_from(["w0", "w1"]))
    def stale_news(self, i, w):
        """Output claimed by a worker that does not run the job: ignored."""
        handle = self.handles[i % len(self.handles)]
        if self.h.core.policy.worker_of("%x" % handle) != w:
            before = len(self.h.sinks[handle].deltas)
            self.h.core.on_outputs(w, [p.Delta("%x" % handle, " x", 1, "stop")])
            assert len(self.h.sinks[handle].deltas) == before

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 1000))
    def cancel(self, i):
        self.h.core.cancel(self.handles[i % len(self.handles)])
        self.h.settle()

    @rule(dt=st.sampled_from([0.5, 3.0, 70.0]))
    def time_passes(self, dt):
        self.h.clock.t += dt
        self.h.core.run_policy()
        self.h.settle()

    @invariant()
    def one_final_and_a_bounded_ledger(self):
        for sink in self.h.sinks.values():
            assert len(sink.finals) <= 1
        for w in self.h.core.policy.workers.values():
            assert 0 <= w.reserved <= w.budget and len(w.running) <= w.slots
        for handle, sink in self.h.sinks.items():
            if sink.finals:  # ended: gone from the table and from the ledger
                assert "%x" % handle not in self.h.core.jobs
                assert self.h.core.policy.worker_of("%x" % handle) is None
            counts = [d.completion_tokens for d in sink.deltas if d.error is None]
            assert counts == sorted(counts)  # one stream, however many attempts

    @invariant()
    def each_job_in_one_state_the_policy_agrees_with(self):
        jobs = self.h.core.jobs
        for j in self.records:
            assert (j.state is JobState.ENDED) == (j.job_id not in jobs)  # in the table exactly until its end
            assert j.worker == self.h.core.policy.worker_of(j.job_id)  # None unless running
            assert (j.state is JobState.RUNNING) == (j.worker is not None)

    def end_everything(self):
        for handle in self.handles:
            self.h.core.cancel(handle)
        self.h.settle()
        assert not self.h.core.jobs and self.h.reserved() == 0
        assert all(j.state is JobState.ENDED for j in self.records)

    @rule()
    def all_cancelled_leaves_nothing(self):
        self.end_everything()


LifecycleMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_lifecycle_state_machine = LifecycleMachine.TestCase


# ------------------------------------------------------------------ issue 13: n, structured output, bad input


def submit_params(h: Harness, model: str = "sim-m", prompt: str = "hello", max_tokens: int = 8, **params):
    sink = Sink()
    handle = h.core.submit(
        p.Submit("c", model, prompt=prompt, max_tokens=max_tokens, params=p.SamplingParams(**params)), sink
    )
    if isinstance(handle, int):
        h.sinks[handle] = sink
    return handle


def test_n_choices_reserve_every_sequence_and_release_once(h):
    from router.policy.estimate import kv_cost

    h.workers.linked.add("w0")
    h.core.worker_joined(msgspec.structs.replace(register("w0"), prefix_caching=True))
    prompt = "x" * 200  # 50 tokens by the sim estimate: 3 full blocks of 16 shared
    a = submit_params(h, prompt=prompt, max_tokens=20, n=3)
    h.settle()
    req = h.workers.dispatched["w0"][0]
    assert req.params.n == 3
    assert h.reserved() == kv_cost(req.prompt_tokens, 20, 16, 3, shared_prompt=True) == 48 + 3 * 32
    assert h.reserved() < kv_cost(req.prompt_tokens, 20, 16, 3)
    job_id = "%x" % a
    h.core.on_outputs(
        "w0",
        [
            p.Delta(job_id, " a", 1, token_ids=[1]),
            p.Delta(job_id, " b", 1, token_ids=[2], index=1),
            p.Delta(job_id, " c", 1, token_ids=[3], index=2, choice_finish="stop"),
        ],
    )
    assert h.reserved() > 0 and len(h.sinks[a].deltas) == 3 and not h.sinks[a].finals
    h.core.on_outputs(
        "w0",
        [
            p.Delta(job_id, "", 0, index=0, choice_finish="length"),
            p.Delta(job_id, "", 0, "length", index=1, completion_tokens=3),
        ],
    )
    assert h.sinks[a].finals[0].finish_reason == "length" and h.reserved() == 0 and not h.core.jobs
    b = submit_params(h, prompt=prompt, max_tokens=20, n=4)  # and a cancelled one
    h.settle()
    h.core.on_outputs("w0", [p.Delta("%x" % b, " a", 1, token_ids=[1], index=3)])
    h.core.cancel(b)
    assert h.reserved() == 0 and not h.core.jobs


def test_n_beyond_any_workers_kv_is_a_400_naming_n(h):
    h.join("w0", kv=4096)
    err = submit_params(h, max_tokens=1000, n=8)  # each sequence fits the context; eight do not fit the KV
    assert err.status == 400 and err.param == "n" and "each of 8 choices" in err.message
    err = submit_params(h, max_tokens=8, n=2, temperature=0.0)
    assert err.status == 400 and err.param == "n" and "greedy" in err.message
    err = submit_params(h, max_tokens=8, min_tokens=9)
    assert err.status == 400 and err.param == "min_tokens"
    assert not h.core.jobs and h.reserved() == 0 and not h.workers.dispatched


def test_a_structured_request_requeues_if_nothing_streamed_and_ends_worker_lost_if_it_had(h):
    """No resume today (issue 8): a structured-output request whose worker is
    lost after output ends with the clear worker_lost error; one that had not
    produced anything is dispatched again, constraint and all."""
    so = p.StructuredOutput(json_object=True)
    h.join("w0", seqs=1)
    started = submit_params(h, structured=so)
    waiting = submit_params(h, structured=so)
    h.settle()
    h.join("w1")
    h.tokens(started, 2)
    h.leave("w0")
    err = h.sinks[started].finals[0].error
    assert err.code == "worker_lost" and err.status == 503 and err.retry_after
    h.settle()
    (again,) = [r for r in h.workers.dispatched["w1"] if r.request_id == "%x" % waiting]
    assert again.params.structured == so
    h.tokens(waiting, 1, "stop")
    assert h.reserved() == 0 and not h.core.jobs


@pytest.mark.skipif(not (TINY / "tokenizer.json").exists(), reason="models/tiny-llama not built")
def test_model_checks_refuse_before_anything_is_reserved():
    cfg = msgspec.convert(
        {"models": [{"name": "tiny", "engine": "vllm", "path": str(TINY), "max_model_len": 512}]}, Config
    )
    prompts = ModelPrompts(str(TINY))
    h = Harness(cfg, prompts={"tiny": prompts})
    try:
        h.workers.linked.add("w0")
        h.core.worker_joined(msgspec.structs.replace(register("w0", kv=1 << 16), model="tiny", max_model_len=512))
        vocab = prompts.vocab_size
        err = submit_params(h, "tiny", logit_bias={vocab: 1.0})
        assert err.status == 400 and err.param == "logit_bias" and str(vocab) in err.message
        err = submit_params(h, "tiny", stop_token_ids=[1, vocab + 5])
        assert err.status == 400 and err.param == "stop_token_ids"
        # A schema is compiled before queueing: on the tokenizing thread while xgrammar is not yet loaded in
        # this process (the answer comes later), inline once it is (refused at submit): either way a 400
        bad = submit_params(h, "tiny", structured=p.StructuredOutput(json='{"type": "objectx"}'))
        good = submit_params(h, "tiny", structured=p.StructuredOutput(json='{"type": "object"}'))
        for _ in range(1000):
            h.loop.run_until_complete(asyncio.sleep(0.01))
            if (isinstance(bad, p.ErrorInfo) or h.sinks[bad].finals) and h.workers.dispatched:
                break
        err = bad if isinstance(bad, p.ErrorInfo) else h.sinks[bad].finals[0].error
        assert err.status == 400 and err.param == "response_format" and "objectx" in err.message
        assert [r.request_id for r in h.workers.dispatched["w0"]] == ["%x" % good]
        # once loaded, a small schema compiles inline: refused at submit
        err = submit_params(h, "tiny", structured=p.StructuredOutput(regex="[a-"))
        assert err.status == 400 and err.param == "structured_outputs.regex"
        err = submit_params(h, "tiny", structured=p.StructuredOutput(json="{}", regex="a"))
        assert err.status == 400 and err.param == "structured_outputs"
        h.tokens(good, 1, "stop")
        assert h.reserved() == 0 and not h.core.jobs
    finally:
        h.close()
