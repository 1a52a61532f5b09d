"""A defect while tokenizing inline still takes the job out of the table: the
caller gets an internal error and nothing stays behind (no phantom job that
/health counts or that keeps an unloading model alive)."""

from __future__ import annotations

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
