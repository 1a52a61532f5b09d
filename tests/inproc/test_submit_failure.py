"""A prompt that cannot be tokenized (a defect, or input the model refuses)
still takes its job out of the table: inline or on the tokenizing thread the
same error, and nothing stays behind (no phantom job that /health counts or
that keeps an unloading model alive)."""

from __future__ import annotations

import asyncio

import pytest
from test_lifecycle import Harness, Sink

import router.lifecycle.intake
from shared import protocol as p


def test_an_inline_tokenize_that_raises_leaves_no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> object:
        raise RuntimeError("tokenizer defect")

    monkeypatch.setattr(router.lifecycle.intake, "tokenize_hashed", broken)
    h = Harness()
    try:
        h.join("w0")
        got = h.core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=2), Sink())
        assert isinstance(got, p.ErrorInfo) and got.code == "internal_error", got
        assert h.core.jobs == {}
        assert h.reserved() == 0
    finally:
        h.close()


@pytest.mark.parametrize(
    ("raised", "status"),
    [(RuntimeError("tokenizer defect"), 500), (ValueError("bad prompt"), 400)],
)
def test_a_prompt_that_cannot_be_tokenized_is_refused_alike_inline_and_on_the_thread(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, status: int
) -> None:
    """The intake's one path for a prompt that cannot be tokenized: inline it
    is submit's answer, on the tokenizing thread the sink's one Delta; the
    same error either way, and no job stays behind."""

    def broken(*args: object) -> object:
        raise raised

    monkeypatch.setattr(router.lifecycle.intake, "tokenize_hashed", broken)
    got: dict[bool, p.ErrorInfo] = {}
    for inline in (True, False):
        h = Harness()
        try:
            h.join("w0")
            served = h.core.served_model("sim-m")
            assert served is not None
            monkeypatch.setattr(served.prompts, "inline", lambda sub, inline=inline: inline)
            sink = Sink()
            answer = h.core.submit(p.Submit("c", "sim-m", prompt="hello", max_tokens=2), sink)
            if inline:
                assert isinstance(answer, p.ErrorInfo), answer
                got[inline] = answer
            else:
                assert isinstance(answer, int), answer
                for _ in range(500):  # (real time: the thread runs meanwhile)
                    h.loop.run_until_complete(asyncio.sleep(0.01))
                    if sink.deltas:
                        break
                (delta,) = sink.deltas
                assert delta.finished and delta.error is not None
                got[inline] = delta.error
            assert h.core.jobs == {} and h.reserved() == 0
        finally:
            h.close()
    assert got[True] == got[False] and got[True].status == status, got
