"""A batch's end, in process: the moment a batch shows a terminal status (and so
its output/error file ids), those files exist.

The batch's run (BatchRun) registers the files in its I/O thread; an HTTP GET for the batch is
served from the same in-memory record meanwhile.  A client that reads the output
file the moment it sees ``cancelled`` must not get a 404.  The stand-in service
carries the real on-disk stores and a real I/O thread; the register is slowed so
that the window between the two is wide enough to be seen every time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import types
from pathlib import Path
from typing import Any

import pytest
from batchutil import in_progress_batch

from router.services.batch import rules as m
from router.services.batch.files import FileStore
from router.services.batch.run import BatchRun
from router.services.batch.store import BatchStore

OWNER = "tenant-a"


class SlowFileStore(FileStore):
    """The real store; its register takes a while, as an fsync on a busy disk does."""

    def register(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        return super().register(*args, **kwargs)


def _service(root: Path) -> types.SimpleNamespace:
    bcfg = types.SimpleNamespace(
        max_in_flight=4, queued_target=4, retry_s=1.0, scan_interval_s=0.5, max_result_bytes=1 << 30
    )
    core = types.SimpleNamespace(keys=types.SimpleNamespace(by_key={}))
    return types.SimpleNamespace(
        core=core,
        bcfg=bcfg,
        max_body_bytes=1 << 20,
        max_prompts=8,
        files=SlowFileStore(root),
        store=BatchStore(root),
        io=concurrent.futures.ThreadPoolExecutor(1),
        batch_class="batch",
    )


def _running_batch(svc: types.SimpleNamespace, completed: int, failed: int, status: str) -> BatchRun:
    rec = in_progress_batch(svc.store, OWNER, completed + failed + 3)
    if status == m.CANCELLED:
        rec.move(m.CANCELLING)
    rec.completed, rec.failed = completed, failed
    run = BatchRun(svc, rec)  # type: ignore[arg-type]
    if completed:
        run.results.out.append([b'{"id":"r0","custom_id":"a"}\n'] * completed)
    if failed:
        run.results.err.append([b'{"id":"r1","custom_id":"b"}\n'] * failed)
    return run


async def _watch(svc: types.SimpleNamespace, run: BatchRun, seen: list[str], stop: asyncio.Event) -> None:
    """What a client polling GET /v1/batches/{id} would see, checked at every loop turn."""
    while not stop.is_set():
        shown = run.rec.public()
        for key in ("output_file_id", "error_file_id"):
            fid = shown[key]
            if fid is not None and svc.files.get(OWNER, fid) is None:
                seen.append(f"{shown['status']}: {key} {fid} shown but not yet a file")
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("status", [m.CANCELLED, m.COMPLETED])
def test_a_terminal_batch_never_shows_a_file_that_does_not_exist_yet(tmp_path: Path, status: str) -> None:
    svc = _service(tmp_path)

    async def main() -> list[str]:
        run = _running_batch(svc, completed=5, failed=2, status=status)
        seen: list[str] = []
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(svc, run, seen, stop))
        await run._finish(status)
        await asyncio.sleep(0.01)
        stop.set()
        await watcher
        assert run.rec.status == status and run.ended
        shown = run.rec.public()
        assert svc.files.get(OWNER, shown["output_file_id"]).bytes > 0
        assert svc.files.get(OWNER, shown["error_file_id"]).bytes > 0
        return seen

    try:
        assert asyncio.run(main()) == []
    finally:
        svc.io.shutdown()


def test_a_failed_batch_registers_its_files_before_it_shows_failed(tmp_path: Path) -> None:
    svc = _service(tmp_path)

    async def main() -> list[str]:
        run = _running_batch(svc, completed=3, failed=0, status=m.IN_PROGRESS)
        seen: list[str] = []
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(svc, run, seen, stop))
        await run._fail("internal_error", "boom")
        stop.set()
        await watcher
        assert run.rec.status == m.FAILED and run.rec.public()["output_file_id"] is not None
        return seen

    try:
        assert asyncio.run(main()) == []
    finally:
        svc.io.shutdown()
