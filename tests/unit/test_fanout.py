"""router.lifecycle.fanout: a multi-prompt completion's jobs merged into one
response (numbering, usage, ends, failures), rendered by the real renderers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router import api
from router.api.checks import check_shape
from router.lifecycle.fanout import PromptFanOut
from router.lifecycle.prompts import BadInput, ModelPrompts
from shared.errors import Code, error
from shared.protocol import Delta, ErrorInfo, Submit

NO_META = api.meta_from_headers(None, None, None, None, None)


class FakeCore:
    """submit/cancel as router.lifecycle.core.RouterCore's: records sinks and cancels."""

    def __init__(self, refuse_at: int | None = None) -> None:
        self.sinks: list = []
        self.cancelled: list[int] = []
        self.refuse_at = refuse_at

    def submit(self, sub, sink, group=None):
        if len(self.sinks) == self.refuse_at:
            return error(Code.RATE_LIMITED, "budget", retry_after=1.0)
        self.sinks.append(sink)
        return len(self.sinks) - 1

    def cancel(self, handle: int) -> None:
        self.cancelled.append(handle)

    def served_model(self, model):
        return None


class Collect:
    def __init__(self) -> None:
        self.batches: list[list[Delta]] = []

    def on_deltas(self, deltas) -> None:
        self.batches.append(deltas)

    @property
    def all(self) -> list[Delta]:
        return [d for b in self.batches for d in b]


def _jobs(**fields) -> api.CompletionJobs:
    body = {"model": "m", "prompt": ["a", "b", "c"], **fields}
    return api.parse_completions(json.dumps(body).encode(), NO_META, "r")


def _fan(jobs, core=None, echoes=None):
    core = core or FakeCore()
    out = Collect()
    fan = PromptFanOut(core, out, jobs.n, len(jobs.subs), echoes or [])
    assert fan.submit(jobs.subs) is None
    return fan, core, out


def test_parse_splits_every_prompt_form():
    assert [s.prompt for s in _jobs().subs] == ["a", "b", "c"]
    ids = _jobs(prompt=[[1, 2], [3]])
    assert [s.prompt_token_ids for s in ids.subs] == [[1, 2], [3]] and ids.ctx.n == 2
    one = _jobs(prompt=[5, 6, 7])
    assert len(one.subs) == 1 and one.subs[0].prompt_token_ids == [5, 6, 7] and one.subs[0].prompt == ""
    two = _jobs(n=2, temperature=1.0)
    assert two.n == 2 and two.ctx.n == 6  # 3 prompts x n
    assert len({s.request_id for s in two.subs}) == 3
    assert _jobs(best_of=4).ctx.n == 3  # accepted, no effect (vLLM 0.32)


def test_max_prompts_is_enforced_with_param():
    body = json.dumps({"model": "m", "prompt": ["x"] * 5}).encode()
    try:
        api.parse_completions(body, NO_META, "r", max_prompts=4)
    except api.RequestError as e:
        assert e.info.status == 400 and e.info.param == "prompt" and "at most 4" in e.info.message
    else:
        raise AssertionError("5 prompts over a maximum of 4 were accepted")


def test_merge_numbers_choices_sums_usage_and_ends_with_the_last_prompt():
    jobs = _jobs(n=2, temperature=1.0)
    fan, core, out = _fan(jobs)
    acc = api.Accumulator(jobs.ctx)
    s0, s1, s2 = core.sinks
    s1.on_deltas([Delta("x", "B0", 1, index=0, prompt_tokens=4, completion_tokens=1)])
    s1.on_deltas([Delta("x", "B1", 1, index=1, completion_tokens=2, choice_finish="stop")])
    s1.on_deltas([Delta("x", "!", 1, index=0, finish_reason="length", prompt_tokens=4, completion_tokens=3)])
    s0.on_deltas([Delta("x", "A", 1, index=1, prompt_tokens=2, completion_tokens=1, finish_reason="stop")])
    assert not any(d.finish_reason for d in out.all)  # prompt c still runs
    s2.on_deltas([Delta("x", "C", 1, prompt_tokens=3, completion_tokens=2, finish_reason="stop", cached_tokens=1)])
    assert out.all[-1].finish_reason is not None and fan.closed
    acc.add(out.all)
    body = json.loads(acc.render())
    got = [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]]
    assert got == [
        (0, "", "stop"),
        (1, "A", "stop"),
        (2, "B0!", "length"),
        (3, "B1", "stop"),
        (4, "C", "stop"),
        (5, "", "stop"),
    ]
    assert body["usage"]["prompt_tokens"] == 2 + 4 + 3
    assert body["usage"]["completion_tokens"] == 1 + 3 + 2
    assert core.cancelled == []


def test_streamed_chunks_carry_each_choice_index_and_one_usage():
    jobs = _jobs(stream=True, stream_options={"include_usage": True}, prompt=["a", "b"])
    fan, core, out = _fan(jobs)
    r = api.StreamRenderer(jobs.ctx)
    sse = []
    feed = out.on_deltas

    def render(deltas):
        feed(deltas)
        sse.append(r.render(deltas))

    out.on_deltas = render  # type: ignore[method-assign]
    core.sinks[1].on_deltas([Delta("x", "y", 1, prompt_tokens=2, completion_tokens=1)])
    core.sinks[0].on_deltas([Delta("x", "z", 1, prompt_tokens=3, completion_tokens=1, finish_reason="stop")])
    core.sinks[1].on_deltas([Delta("x", "w", 1, completion_tokens=2, finish_reason="length", prompt_tokens=2)])
    events = [json.loads(e[6:]) for e in b"".join(sse).decode().split("\n\n") if e and e != "data: [DONE]"]
    choices = [(c["index"], c["text"], c["finish_reason"]) for e in events for c in e["choices"]]
    assert choices == [(1, "y", None), (0, "z", "stop"), (1, "w", "length")]
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 3, 8)
    assert r.finished


def test_a_failed_prompt_fails_the_response_and_cancels_the_others():
    jobs = _jobs()
    fan, core, out = _fan(jobs)
    core.sinks[0].on_deltas([Delta("x", "A", 1, prompt_tokens=2, completion_tokens=1)])
    core.sinks[1].on_deltas([Delta("x", error=error(Code.SERVICE_UNAVAILABLE, "worker lost", retry_after=1.0))])
    assert out.all[-1].error is not None and out.all[-1].index == 1
    assert sorted(core.cancelled) == [0, 1, 2] and fan.closed
    n = len(out.all)
    core.sinks[2].on_deltas([Delta("x", "late", 1, finish_reason="stop")])
    assert len(out.all) == n  # nothing after the end


def test_a_refusal_at_submit_cancels_the_prompts_admitted_before_it():
    jobs = _jobs()
    core = FakeCore(refuse_at=2)
    fan = PromptFanOut(core, Collect(), jobs.n, 3, [])
    got = fan.submit(jobs.subs)
    assert isinstance(got, ErrorInfo) and got.status == 429
    assert core.cancelled == [0, 1]


def test_client_gone_cancels_every_job_once():
    fan, core, _ = _fan(_jobs())
    fan.cancel()
    fan.cancel()
    assert core.cancelled == [0, 1, 2]


def test_echo_prefixes_each_prompts_choices():
    jobs = _jobs(echo=True, n=2, temperature=1.0, prompt=["p", "q"])
    fan, core, out = _fan(jobs, echoes=["p", "q"])
    core.sinks[0].on_deltas([Delta("x", "1", 1, index=1, prompt_tokens=1, completion_tokens=1, finish_reason="stop")])
    core.sinks[1].on_deltas([Delta("x", "2", 1, prompt_tokens=1, completion_tokens=1, finish_reason="stop")])
    acc = api.Accumulator(jobs.ctx)
    acc.add(out.all)
    texts = [c["text"] for c in json.loads(acc.render())["choices"]]
    assert texts == ["p", "p1", "q2", "q"]


# ------------------------------------------------------------ token-id prompts in router.lifecycle.prompts

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"


def test_token_id_prompts_are_checked_against_the_vocabulary_and_sent_as_they_are():
    prompts = ModelPrompts(str(TINY))
    ids = prompts.encode("Hello there", add_special_tokens=True)
    sub = Submit(request_id="r", model="m", prompt_token_ids=ids)
    assert tuple(prompts.tokenize(sub)) == (ids, len(ids))
    assert prompts.decode(prompts.encode("Hello there", add_special_tokens=False)) == "Hello there"
    bad = Submit(request_id="r", model="m", prompt_token_ids=[1, prompts.vocab_size])
    with pytest.raises(BadInput) as e:
        prompts.tokenize(bad)
    assert e.value.param == "prompt"
    # no tokenizer (the simulated engine's models): nothing to check them against, sent as they are
    assert tuple(ModelPrompts(None).tokenize(sub)) == (ids, len(ids))


def test_prompt_and_token_ids_together_are_refused_over_zeromq_too():
    err = check_shape(Submit(request_id="r", model="m", prompt="x", prompt_token_ids=[1]))
    assert err is not None and err.status == 400 and err.param == "prompt_token_ids"
    assert check_shape(Submit(request_id="r", model="m", prompt_token_ids=[1])) is None
