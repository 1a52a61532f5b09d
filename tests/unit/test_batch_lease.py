"""Batch leases and their fence, on disk: every grant's token is larger than
the last, a holder whose token is stale writes nothing, recovery rebuilds the
counts and the usage from the result files; and which refusals a batch line
waits out rather than fails on."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.services.batch import rules as m
from router.services.batch.lease import FileLease
from router.services.batch.store import BatchStore, ResultLog, StaleLease, result_id
from shared.errors import Code


def test_every_refusal_that_means_not_now_is_retried_for_a_batch_line():
    """503s say "this router cannot take it now" (draining, no worker yet, a worker lost):
    a batch line waits and is sent again, it never lands in the error file for one."""
    unavailable = [c for c in Code if c.status == 503]
    assert Code.ROUTER_DRAINING in unavailable
    for code in unavailable:
        assert m.retryable(code.status, code.wire, code.type), code
    for code in (Code.BAD_REQUEST, Code.CONTEXT_LENGTH, Code.MODEL_NOT_FOUND, Code.ENGINE_ERROR):
        assert not m.retryable(code.status, code.wire, code.type), code  # about the line itself


def test_each_file_lease_grant_carries_a_larger_fencing_token(tmp_path):
    store = BatchStore(tmp_path)
    (store.dir / "batch_x").mkdir()
    a, b = FileLease(store.dir), FileLease(store.dir)

    async def grants() -> list[int]:
        seen = []
        for holder in (a, b, a, b):
            assert await holder.acquire("batch_x")
            assert not await (b if holder is a else a).acquire("batch_x")  # one holder at a time
            seen.append(holder.token("batch_x"))
            await holder.release("batch_x")
            assert holder.token("batch_x") == 0
        return seen

    seen = asyncio.run(grants())
    assert seen == sorted(seen) and len(set(seen)) == 4 and seen[0] >= 1


def test_a_stale_holder_is_refused_by_the_fence_and_writes_nothing(tmp_path):
    store = BatchStore(tmp_path)
    rec = store.new(
        owner="t",
        key_digest="",
        input_file_id="file-x",
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=1,
        expires_at=2,
    )
    log = ResultLog(tmp_path / "out.data")
    old, new = store.fence(rec.id, 1), store.fence(rec.id, 2)
    with old.hold():
        log.append([b'{"id": "a"}\n'])
    store.save(rec, old)
    new.claim()  # the new holder, before it reads anything
    with pytest.raises(StaleLease):
        with old.hold():
            log.append([b'{"id": "b"}\n'])
    rec.completed = 99
    with pytest.raises(StaleLease):
        store.save(rec, old)
    assert (tmp_path / "out.data").read_bytes() == b'{"id": "a"}\n'
    assert store.load(rec.id).completed == 0
    with new.hold():  # the new holder writes on
        log.append([b'{"id": "c"}\n'])
    store.save(rec, new)
    assert store.load(rec.id).completed == 99


def test_recovery_rebuilds_usage_from_the_output_file(tmp_path):
    """The state saved last may lag the files (a crash between a group's fsync
    and the next save): the tokens come back from the result lines themselves."""
    path = tmp_path / "out.data"
    rows = []
    for line, (pt, ct, cached) in enumerate([(5, 16, 0), (7, 3, 4), (2, 9, 2)]):
        body = {
            "object": "text_completion",
            "usage": {
                "prompt_tokens": pt,
                "completion_tokens": ct,
                "total_tokens": pt + ct,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        rows.append(
            {
                "id": result_id("batch_" + "a" * 24, line),
                "custom_id": f"c{line}",
                "response": {"status_code": 200, "request_id": "r", "body": body},
                "error": None,
            }
        )
    emb = {"object": "list", "data": [], "usage": {"prompt_tokens": 11, "total_tokens": 11}}
    rows.append(
        {
            "id": result_id("batch_" + "a" * 24, 3),
            "custom_id": "e",
            "response": {"status_code": 200, "request_id": "r", "body": emb},
            "error": None,
        }
    )
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'{"id": "torn')
    log = ResultLog(path)
    done = bytearray(1)
    log.recover(done)
    assert log.lines == 4 and done[0] == 0b1111
    assert (log.usage.input_tokens, log.usage.output_tokens, log.usage.cached_tokens) == (25, 28, 6)
