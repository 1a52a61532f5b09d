"""A full disk pauses a running batch; it never fails it.  On a real, small
filesystem (a 1 MiB tmpfs, mounted for the test: needs root), filled up by
someone else's file, as another tenant's upload would.

The run is the real BatchRun with its real stores and I/O thread; its
service is a stand-in (no core: the lines' results are handed to it as their
sinks would, ``line_ok``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from batchutil import in_progress_batch

from router.services.batch import rules as m
from router.services.batch.files import FileStore
from router.services.batch.host import BatchStats
from router.services.batch.run import BatchRun
from router.services.batch.service import _BatchCollector
from router.services.batch.store import BatchStore, ResultLog, disk_full


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(directory: Path) -> Path:
    """Someone else's file takes every byte left."""
    filler = directory / "someone-else"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert disk_full(e)
    return filler


def test_an_append_that_meets_a_full_disk_leaves_the_file_as_it_was(small_disk: Path):
    log = ResultLog(small_disk / "out.data")
    log.append([b'{"id": "a"}\n'])
    filler = _fill(small_disk)
    with pytest.raises(OSError) as e:
        log.append([b'{"id": "b"}\n' * 1000])
    assert disk_full(e.value)
    assert (small_disk / "out.data").read_bytes() == b'{"id": "a"}\n' and log.lines == 1
    filler.unlink()
    log.append([b'{"id": "b"}\n'])  # the same lines again, once there is room
    assert (small_disk / "out.data").read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    log.close()


def _service(root: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        core=types.SimpleNamespace(keys=types.SimpleNamespace(by_key={}), jobs={}, draining=False),
        bcfg=types.SimpleNamespace(
            max_in_flight=4, queued_target=4, retry_s=0.05, scan_interval_s=0.05, max_result_bytes=1 << 30
        ),
        max_body_bytes=1 << 20,
        max_prompts=8,
        files=FileStore(root),
        store=BatchStore(root),
        io=concurrent.futures.ThreadPoolExecutor(1),
        batch_class="batch",
        stats=BatchStats(),
        budget_allows=lambda tenant: True,
        charge=lambda tenant, tokens: None,
        runs={},
        preempted=0,
    )


def _paused_seconds(svc: types.SimpleNamespace) -> dict[str, float]:
    """weir_batch_disk_full_seconds as /metrics shows it."""
    fams = {f.name: f for f in _BatchCollector(svc).collect()}  # type: ignore[arg-type]
    return {s.labels["batch"]: s.value for s in fams["weir_batch_disk_full_seconds"].samples}


BODY = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 5}}).encode()


def test_a_running_batch_pauses_while_the_disk_is_full_and_finishes_its_lines_once_when_room_comes_back(
    small_disk: Path,
):
    svc = _service(small_disk)
    n = 40
    rec = in_progress_batch(svc.store, "tenant-a", n)

    async def main() -> None:
        run = BatchRun(svc, rec)  # type: ignore[arg-type]
        svc.runs[rec.id] = run
        run.results.done = bytearray((n + 7) // 8)
        filler = _fill(small_disk)
        for i in range(n):  # the lines end while the disk is full
            sink = types.SimpleNamespace(line=i, custom_id=f"c{i}", ctx=types.SimpleNamespace(id=f"r{i}"), handles=[])
            run.feeder.line_ok(sink, BODY)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        while run.results.disk_full_since is None:
            assert time.monotonic() < deadline, "the write never met the full disk"
            await asyncio.sleep(0.01)
        run.results.dirty = True
        for _ in range(5):  # the run's steps meanwhile: state saves fail too; nothing is sent
            await run.step()
            await asyncio.sleep(0.05)
        assert rec.status == m.IN_PROGRESS and not rec.errors and not run.ended
        assert rec.completed == 0 and run.results.disk_full_since is not None
        assert _paused_seconds(svc)[rec.id] > 0
        filler.unlink()  # room again
        while rec.completed < n:
            assert time.monotonic() < deadline + 5, f"not resumed: {rec.completed} of {n} written"
            await asyncio.sleep(0.02)
        assert run.results.disk_full_since is None and rec.status == m.IN_PROGRESS and _paused_seconds(svc) == {}
        assert (rec.usage.input_tokens, rec.usage.output_tokens) == (3 * n, 5 * n)
        await run.step()  # the state saved again
        assert svc.store.load(rec.id).completed == n
        run.results.out.close()

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()
    out = [json.loads(x) for x in svc.files.data_path(rec.output_file_id).read_bytes().splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(n))  # each once


def test_a_state_save_that_meets_a_full_disk_pauses_feeding_until_a_save_goes_through(small_disk: Path):
    svc = _service(small_disk)
    rec = in_progress_batch(svc.store, "tenant-a", 1)

    async def main() -> None:
        run = BatchRun(svc, rec)  # type: ignore[arg-type]
        run.results.done = bytearray(1)
        filler = _fill(small_disk)
        run.results.dirty = True
        await run.step()
        assert run.results.paused and run.results.dirty and rec.status == m.IN_PROGRESS and not run.ended
        filler.unlink()
        await run.step()
        assert run.results.disk_full_since is None and not run.results.dirty
        assert svc.store.load(rec.id).status == m.IN_PROGRESS

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()


def test_a_state_save_that_fits_does_not_resume_feeding_while_results_wait_for_room(small_disk: Path):
    """The disk has room for a small state file but not for a group of results:
    a save that goes through while that group's retry is on the I/O thread does
    not end the pause -- the results are still not written, and feeding more
    lines would only pile up more results in memory."""
    svc = _service(small_disk)
    n = 40
    rec = in_progress_batch(svc.store, "tenant-a", n)
    body = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 5}, "pad": "x" * 400}).encode()

    async def main() -> None:
        run = BatchRun(svc, rec)  # type: ignore[arg-type]
        run.results.done = bytearray((n + 7) // 8)
        spare = small_disk / "spare"
        spare.write_bytes(b"\0" * 4096)
        filler = _fill(small_disk)
        spare.unlink()  # one page free: a state file fits, ~20 KB of results do not
        for i in range(n):
            sink = types.SimpleNamespace(line=i, custom_id=f"c{i}", ctx=types.SimpleNamespace(id=f"r{i}"), handles=[])
            run.feeder.line_ok(sink, body)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        while run.results.disk_full_since is None:
            assert time.monotonic() < deadline, "the write never met the full disk"
            await asyncio.sleep(0.01)
        if run.results._flushing is not None:
            await asyncio.wait([run.results._flushing])
        gate = threading.Event()
        svc.io.submit(gate.wait)  # the I/O thread busy: the save, then the retry, queue behind it

        async def save_then_look() -> float | None:
            await run.results.save()
            return run.results.disk_full_since  # as the save left it (before the retry's answer is read)

        saving = asyncio.ensure_future(save_then_look())
        await asyncio.sleep(0)  # (the save is queued)
        if run.results._flush_timer is not None:
            run.results._flush_timer.cancel()
            run.results._flush_timer = None
        run.results._flush()  # the retry of the results, queued after the save
        assert run.results._flushing is not None and not run.results._out_buf
        gate.set()
        assert await saving is not None  # the pause holds: the results are not written
        if run.results._flushing is not None:
            await asyncio.wait([run.results._flushing])
        assert run.results.disk_full_since is not None and rec.completed == 0
        filler.unlink()
        while rec.completed < n:
            assert time.monotonic() < deadline + 5, f"not resumed: {rec.completed} of {n} written"
            await asyncio.sleep(0.02)
        assert run.results.disk_full_since is None
        run.results.out.close()

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()


def test_a_revocation_whose_end_meets_a_full_disk_records_its_error_once(small_disk: Path):
    """The revoked batch's end (its files' registration, its state) meets a full
    disk and is tried again at the next step: once room comes back it ends
    cancelled with one ``api_key_revoked`` error, not one per attempt."""
    svc = _service(small_disk)
    rec = in_progress_batch(svc.store, "tenant-a", 1)
    svc.files.data_path(rec.input_file_id).write_bytes(b'{"custom_id": "c0", "method": "POST", "body": {}}\n')

    async def main() -> None:
        run = BatchRun(svc, rec)  # type: ignore[arg-type]
        run.results.done = bytearray(b"\x01")  # its one line was answered already: nothing more to write but the end
        run.revoked = True
        filler = _fill(small_disk)
        for _ in range(3):  # the run's steps while the disk is full
            with pytest.raises(OSError) as e:
                await run.step()
            assert disk_full(e.value) and not run.ended
        filler.unlink()
        await run.step()
        assert run.ended and rec.status == m.CANCELLED
        assert [e.code for e in svc.store.load(rec.id).errors] == ["api_key_revoked"]

    try:
        asyncio.run(main())
    finally:
        svc.io.shutdown()
