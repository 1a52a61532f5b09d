"""A batch's result files are bounded (``[batch] max_result_bytes``): a batch
whose results would pass the bound fails alone, with ``results_too_large``,
keeping what it wrote; another batch of the same service runs on.

Two real BatchRuns over the real on-disk stores and a real I/O thread; their
lines' results are handed to them as the core would (``line_ok``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import types
from pathlib import Path

import pytest
from batchutil import in_progress_batch

from router.services.batch import rules as m
from router.services.batch.files import FileStore
from router.services.batch.run import BatchRun
from router.services.batch.store import BatchStore
from shared.errors import Code, error

OWNER = "tenant-a"
BOUND = 16384


def _service(root: Path) -> types.SimpleNamespace:
    bcfg = types.SimpleNamespace(
        max_in_flight=4, queued_target=4, retry_s=1.0, scan_interval_s=0.5, max_result_bytes=BOUND
    )
    core = types.SimpleNamespace(keys=types.SimpleNamespace(by_key={}), jobs={}, draining=False)
    stats = types.SimpleNamespace(line_done=lambda *a, **k: None)
    return types.SimpleNamespace(
        core=core,
        bcfg=bcfg,
        max_body_bytes=1 << 20,
        max_prompts=8,
        files=FileStore(root),
        store=BatchStore(root),
        io=concurrent.futures.ThreadPoolExecutor(1),
        batch_class="batch",
        stats=stats,
        charge=lambda *a: None,
        budget_allows=lambda owner: True,
    )


def _run(svc: types.SimpleNamespace, lines: int) -> BatchRun:
    rec = in_progress_batch(svc.store, OWNER, lines)
    run = BatchRun(svc, rec)  # type: ignore[arg-type]
    run.results.done = bytearray((lines + 7) // 8)
    run.feeder.eof = True
    return run


def _finish_line(run: BatchRun, line: int, text_bytes: int) -> None:
    ctx = types.SimpleNamespace(id=f"cmpl-{line}")
    sink = types.SimpleNamespace(handles=[], line=line, custom_id=f"c{line}", ctx=ctx)
    body = json.dumps(
        {"id": ctx.id, "choices": [{"text": "x" * text_bytes}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    ).encode()
    run.feeder.line_ok(sink, body)  # type: ignore[arg-type]


def test_a_batch_whose_results_pass_the_bound_fails_alone(tmp_path: Path) -> None:
    svc = _service(tmp_path)

    async def main() -> None:
        big, small = _run(svc, 40), _run(svc, 40)
        for line in range(40):
            _finish_line(big, line, 1000)  # ~45 KB of results: past the 16 KiB bound
            _finish_line(small, line, 10)  # ~10 KB: within it
            await asyncio.sleep(0.01)  # (results flush in groups, GROUP_WAIT_S apart)
        await small.results.drain()
        for _ in range(200):
            if big.ended:
                break
            await asyncio.sleep(0.01)
        assert big.rec.status == m.FAILED and big.ended
        assert [e.code for e in big.rec.errors] == ["results_too_large"]
        assert "max_result_bytes" in big.rec.errors[0].message
        written = svc.files.data_path(big.rec.output_file_id)
        assert 0 < written.stat().st_size <= BOUND  # what fitted is kept, in whole lines
        assert written.read_bytes().endswith(b"\n")
        # The other batch of the same service is untouched and ends normally.
        assert small.rec.status == m.IN_PROGRESS and not small.ended and small.rec.completed == 40
        await small.step()
        assert small.rec.status == m.COMPLETED
        out = svc.files.get(OWNER, small.rec.output_file_id)
        assert out is not None and out.bytes == svc.files.data_path(small.rec.output_file_id).stat().st_size

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()


def test_a_group_cut_by_the_bound_counts_the_results_it_wrote(tmp_path: Path) -> None:
    """One group holds a small output line (within the bound) and a large error
    entry (past it): the output line is appended and fsync'ed before the error
    file refuses.  The batch fails, and its counts, usage and visible files say
    what the files hold: the written result is counted and its file shown."""
    svc = _service(tmp_path)
    svc.bcfg.max_result_bytes = 2048

    async def main() -> None:
        run = _run(svc, 2)
        _finish_line(run, 0, 10)  # ~300 bytes: fits
        sink = types.SimpleNamespace(handles=[], line=1, custom_id="c1", raw=b"")
        run.feeder.line_refused(sink, error(Code.BAD_REQUEST, "x" * 4096))  # type: ignore[arg-type]
        for _ in range(200):
            if run.ended:
                break
            await asyncio.sleep(0.01)
        assert run.rec.status == m.FAILED and [e.code for e in run.rec.errors] == ["results_too_large"]
        out = svc.files.data_path(run.rec.output_file_id).read_bytes().splitlines()
        assert [json.loads(x)["custom_id"] for x in out] == ["c0"]
        saved = svc.store.load(run.rec.id)
        assert (saved.completed, saved.failed) == (1, 0)
        assert saved.usage.input_tokens == 1 and saved.usage.output_tokens == 1
        assert saved.public()["output_file_id"] == run.rec.output_file_id
        assert svc.files.get(OWNER, run.rec.output_file_id) is not None

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()


@pytest.mark.parametrize("end", ["expired", "revoked"])
def test_expiry_or_revocation_entries_cut_by_the_bound_are_counted(tmp_path: Path, end: str) -> None:
    """The entries for the lines never run are written in chunks (4,096 lines):
    when a later chunk would pass the bound, the batch fails with
    ``results_too_large``, and the entries already written are counted and
    their error file shown -- the counts say what the files hold."""
    svc = _service(tmp_path)
    svc.bcfg.max_result_bytes = 1_200_000  # one chunk of entries (~0.8 MB) fits, two do not
    lines = 8200
    rows = (
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {}}) for i in range(lines)
    )
    run = _run(svc, lines)
    svc.files.data_path(run.rec.input_file_id).write_bytes("".join(r + "\n" for r in rows).encode())
    if end == "expired":
        run.rec.expires_at = int(time.time()) - 1
    else:
        run.revoked = True

    async def main() -> None:
        await run.step()
        assert run.ended and run.rec.status == m.FAILED
        assert [e.code for e in run.rec.errors] == ["results_too_large"]
        written = svc.files.data_path(run.rec.error_file_id).read_bytes().splitlines()
        assert len(written) == 4096
        saved = svc.store.load(run.rec.id)
        assert (saved.completed, saved.failed) == (0, 4096)
        assert saved.public()["error_file_id"] == run.rec.error_file_id
        assert svc.files.get(OWNER, run.rec.error_file_id) is not None

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()


@pytest.mark.parametrize("then", ["revoked", "draining"])
def test_a_revocation_or_a_drain_after_a_failed_write_leaves_the_failure_alone(tmp_path: Path, then: str) -> None:
    """A group of results was refused (past the bound): the batch is failing.
    Its key revoked meanwhile does not write revocation entries after the
    failure nor end it a second time; a drain meanwhile does not hand it on
    (releasing its lease) before the failure is saved: it ends failed, once,
    as it would alone."""
    svc = _service(tmp_path)
    svc.bcfg.max_result_bytes = 512
    run = _run(svc, 2)
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {}} for i in range(2)]
    svc.files.data_path(run.rec.input_file_id).write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows))

    async def main() -> None:
        _finish_line(run, 0, 1000)  # its result alone passes the bound
        assert run.results._flush_timer is not None
        run.results._flush_timer.cancel()
        run.results._flush()  # (now, not at the timer)
        writing = run.results._flushing
        assert writing is not None
        gate = threading.Event()
        svc.io.submit(gate.wait)  # the failing write runs; what the failure does next waits behind this
        await asyncio.wait([writing])
        assert run.results.write_failed
        if then == "revoked":
            run.revoked = True  # the key is revoked while the failure is being recorded
        else:
            run.feeder.draining = True  # the router drains meanwhile
        stepping = asyncio.ensure_future(run.step())
        await asyncio.sleep(0.05)
        gate.set()
        await stepping
        for _ in range(200):
            if run.ended:
                break
            await asyncio.sleep(0.01)
        saved = svc.store.load(run.rec.id)
        assert saved.status == m.FAILED and [e.code for e in saved.errors] == ["results_too_large"]
        assert run.ended and not run.handed_off
        errors = svc.files.data_path(run.rec.error_file_id)
        assert not errors.exists() or errors.read_bytes() == b""  # no entry written after the failure

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()
