"""A batch whose key is revoked, in process: its run (BatchRun) with the real on-disk
stores and I/O thread, and the keys a reload leaves (router.tenancy.ownership's rule).

A key removed, or moved to another tenant, cancels the batch: what finished
stays, every other line gets one ``api_key_revoked`` entry in the error
file, ``errors.data`` says so -- whether the reload comes while the batch runs
here (``recheck``) or before a router takes it up."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import types
from pathlib import Path

import pytest

from router.services.batch import rules as m
from router.services.batch.files import FileStore
from router.services.batch.run import REVOKED_CODE, BatchRun
from router.services.batch.store import BatchStore, result_id
from shared.config import ApiKey
from shared.keys import digest

KEY = "sk-revoke-me"
OWNER = "alpha"
LINES = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}} for i in range(4)]


def _service(root: Path, by_key: dict) -> types.SimpleNamespace:
    bcfg = types.SimpleNamespace(
        max_in_flight=4, queued_target=4, retry_s=1.0, scan_interval_s=0.05, max_result_bytes=1 << 30
    )
    return types.SimpleNamespace(
        core=types.SimpleNamespace(keys=types.SimpleNamespace(by_key=by_key)),
        bcfg=bcfg,
        max_body_bytes=1 << 20,
        max_prompts=8,
        files=FileStore(root),
        store=BatchStore(root),
        io=concurrent.futures.ThreadPoolExecutor(1),
        batch_class="batch",
    )


def _batch(svc: types.SimpleNamespace) -> BatchRun:
    """A batch of four lines in progress, the first already answered."""
    f = svc.files.create(OWNER, "in.jsonl", "batch", b"".join(json.dumps(x).encode() + b"\n" for x in LINES))
    now = int(time.time())
    rec = svc.store.new(
        owner=OWNER,
        key_digest=digest(KEY),
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=now,
        expires_at=now + 86400,
    )
    rec.move(m.IN_PROGRESS)
    rec.total = rec.input_lines = len(LINES)
    done = json.dumps({"id": result_id(rec.id, 0), "custom_id": "c0"}).encode() + b"\n"
    svc.files.data_path(rec.output_file_id).write_bytes(done)  # as a router before this one wrote it
    return BatchRun(svc, rec)  # type: ignore[arg-type]


def _check_cancelled(svc: types.SimpleNamespace, run: BatchRun) -> None:
    rec = run.rec
    assert run.ended and rec.status == m.CANCELLED
    assert [e.code for e in rec.errors] == [REVOKED_CODE]
    assert (rec.completed, rec.failed) == (1, 3)
    errs = [json.loads(x) for x in svc.files.data_path(rec.error_file_id).read_bytes().splitlines()]
    assert sorted(e["custom_id"] for e in errs) == ["c1", "c2", "c3"]
    assert {e["error"]["code"] for e in errs} == {REVOKED_CODE} and all(e["response"] is None for e in errs)
    assert svc.files.get(OWNER, rec.error_file_id) is not None  # its tenant can download it
    assert svc.store.load(rec.id).status == m.CANCELLED


LIVE = {digest(KEY): ApiKey(key=KEY, tenant=OWNER)}
REVOKED = {"removed": {}, "moved": {digest(KEY): ApiKey(key=KEY, tenant="delta")}}


@pytest.mark.parametrize("how", sorted(REVOKED))
def test_a_batch_taken_up_after_its_key_was_revoked_is_cancelled(tmp_path: Path, how: str) -> None:
    svc = _service(tmp_path, REVOKED[how])
    try:
        run = _batch(svc)
        assert run.revoked
        asyncio.run(asyncio.wait_for(run.main(), 10))
        _check_cancelled(svc, run)
    finally:
        svc.io.shutdown()


@pytest.mark.parametrize("how", sorted(REVOKED))
def test_a_reload_revoking_the_key_of_a_running_batch_cancels_it(tmp_path: Path, how: str) -> None:
    svc = _service(tmp_path, dict(LIVE))
    try:
        run = _batch(svc)
        assert not run.revoked and run.feeder.who.tenant == OWNER  # type: ignore[union-attr]

        async def main() -> None:
            await run._recover()
            svc.core.keys.by_key = REVOKED[how]  # what the reload leaves
            run.recheck()
            assert run.revoked and run.wake.is_set()
            await run.step()

        asyncio.run(asyncio.wait_for(main(), 10))
        run._close()
        _check_cancelled(svc, run)
    finally:
        svc.io.shutdown()


def test_a_reload_that_keeps_the_key_leaves_the_batch_alone(tmp_path: Path) -> None:
    svc = _service(tmp_path, dict(LIVE))
    try:
        run = _batch(svc)
        svc.core.keys.by_key = {**LIVE, digest("sk-other"): ApiKey(key="sk-other", tenant="beta")}
        run.recheck()
        assert not run.revoked and not run.wake.is_set() and run.rec.status == m.IN_PROGRESS
    finally:
        svc.io.shutdown()
