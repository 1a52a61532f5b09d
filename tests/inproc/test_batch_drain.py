"""A batch through a router drain, and a stale lease holder, in process: the
real RouterCore (fake workers), the real BatchService and its on-disk stores.

A draining router sends no more lines of its batches, withdraws the queued
ones, lets the running ones end (a line the drain's deadline cuts waits to be
sent again: it is not a failure), writes what finished and releases the lease
at once; a second router over the same directory takes the batch over and
ends it with every line answered exactly once and none failed.  A holder
whose lease another router took over writes nothing more and stops.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import msgspec
from test_batch_disk_full import _fill
from test_batch_disk_full import small_disk as small_disk  # (a fixture)
from test_lifecycle import Harness

from router.lifecycle.drain import RouterDrain
from router.services.batch import rules as m
from router.services.batch.files import FileStore
from router.services.batch.lease import FileLease
from router.services.batch.service import BatchService
from router.services.batch.store import BatchStore
from shared.config import Config

N = 20


def _config(root: Path) -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "scheduler": {"generation_deadline_s": 30.0},
            "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}],
            "batch": {
                "directory": str(root),
                "scan_interval_s": 0.05,
                "queued_target": 4,
                "retry_s": 0.05,
                "preempt": False,
            },
        },
        Config,
    )


class Router:
    """One router: a core on fake workers, its batch service, pumped by hand."""

    def __init__(self, root: Path) -> None:
        self.h = Harness(_config(root))
        self.h.join("w0", seqs=2)
        self.svc = BatchService(self.h.core, self.h.core.cfg)

        async def start() -> None:
            self.svc.start()

        self.h.loop.run_until_complete(start())

    def pump(self, s: float = 0.05) -> None:
        self.h.loop.run_until_complete(asyncio.sleep(s))

    def run(self):
        (run,) = self.svc.runs.values()
        return run

    def running(self) -> list[int]:
        """Handles of the batches' jobs on the (fake) worker."""
        jobs = self.h.core.jobs
        return [
            hd for run in self.svc.runs.values() for hd in run.feeder.in_flight if jobs["%x" % hd].worker is not None
        ]

    def call(self, fn, *args) -> None:
        """``fn`` on the loop, as the socket's reader calls the core (the batch tier arms timers)."""

        async def on_loop() -> None:
            fn(*args)

        self.h.loop.run_until_complete(on_loop())

    def finish(self, handle: int) -> None:
        self.call(self.h.tokens, handle, 3, "length")

    def close(self) -> None:
        self.h.loop.run_until_complete(self.svc.close())
        self.h.close()


def _until(router: Router, cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        router.pump()


def _batch(root: Path) -> tuple[str, BatchStore]:
    """A batch of N lines, created as the API creates one: no router runs it yet."""
    files, store = FileStore(root), BatchStore(root)
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "sim-m", "prompt": f"line {i}", "max_tokens": 3},
        }
        for i in range(N)
    ]
    f = files.create("anonymous", "in.jsonl", "batch", b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    now = int(time.time())
    rec = store.new(
        owner="anonymous",
        key_digest="",
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=now,
        expires_at=now + 86400,
    )
    return rec.id, store


def _results(root: Path, file_id: str) -> list[dict]:
    path = root / "files" / f"{file_id}.data"
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def test_a_draining_router_hands_its_batch_on_and_no_line_fails(tmp_path):
    bid, store = _batch(tmp_path)
    a = Router(tmp_path)
    try:
        _until(a, lambda: bid in a.svc.runs and len(a.running()) == 2, "router a never ran two lines")
        first = a.running()[0]
        a.finish(first)
        _until(a, lambda: a.run().rec.completed == 1, "the first line was never written")
        sent_before = a.svc.stats.sent
        drain = RouterDrain(a.h.core, a.h.loop, timeout_s=5.0, clock=a.h.clock)
        a.call(drain.start, "test")
        a.pump(0.2)
        run = a.run()
        # no line sent since, the queued ones withdrawn: only the two running remain
        assert a.svc.stats.sent == sent_before and len(run.feeder.in_flight) == 2 == len(a.running())
        later, _ = _batch(tmp_path)  # created while it drains: left for the others
        a.pump(0.2)
        assert later not in a.svc.runs and store.load(later).status == m.VALIDATING
        ending, cut = a.running()
        a.finish(ending)
        a.h.clock.t += 5.0  # the drain's deadline: the other running line is cut (router_draining)
        a.call(drain._tick)
        _until(a, lambda: bid not in a.svc.runs, "the run was not handed on")
        assert run.handed_off and not run.ended and drain.done.is_set()
        probe = FileLease(store.dir)
        assert asyncio.run(probe.acquire(bid))  # released at once, not at the router's exit
        asyncio.run(probe.release(bid))
        on_disk = store.load(bid)
        assert (on_disk.status, on_disk.completed, on_disk.failed) == (m.IN_PROGRESS, 2, 0)
        assert _results(tmp_path, on_disk.error_file_id) == []  # no line failed for the drain
        assert "%x" % cut not in [r["id"] for r in _results(tmp_path, on_disk.output_file_id)]
        drain.close()
    finally:
        a.close()

    b = Router(tmp_path)  # another router (or the same one, restarted)
    try:

        def finish_all() -> bool:
            if bid not in b.svc.runs and later not in b.svc.runs:
                return True
            for hd in b.running():
                b.finish(hd)
            return False

        _until(b, lambda: bid in b.svc.runs and later in b.svc.runs, "router b never took the batches over")
        _until(b, finish_all, "router b never finished the batch", timeout=20.0)
        rec = store.load(bid)
        assert (rec.status, rec.completed, rec.failed) == (m.COMPLETED, N, 0)
        ids = [r["custom_id"] for r in _results(tmp_path, rec.output_file_id)]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(N))  # each exactly once
        assert rec.usage.output_tokens == 3 * N  # the tokens of a's lines are counted too
        assert store.load(later).status == m.COMPLETED
    finally:
        b.close()


def test_a_holder_whose_lease_was_taken_over_writes_nothing_more_and_stops(tmp_path):
    """A router stalled past its lease (SIGSTOP, a long pause) wakes up with
    lines that finished meanwhile: its next write meets the newer holder's
    fence, is refused, and the run stops; the files hold only what the batch's
    holders wrote while they held it."""
    bid, store = _batch(tmp_path)
    a = Router(tmp_path)
    try:
        _until(a, lambda: bid in a.svc.runs and len(a.running()) == 2, "router a never ran two lines")
        first, second = a.running()
        a.finish(first)
        _until(a, lambda: a.run().rec.completed == 1, "the first line was never written")
        run = a.run()
        rec = store.load(bid)
        out = tmp_path / "files" / f"{rec.output_file_id}.data"
        written = out.read_bytes()
        token = a.svc.lease.token(bid)
        assert token >= 1 and run.results.fence.token == token
        store.fence(bid, token + 1).claim()  # another router's grant, as after a takeover

        async def held_elsewhere(_bid: str) -> bool:
            return False

        a.svc.lease.acquire = held_elsewhere  # (that router holds the lease from now on)
        a.finish(second)
        _until(a, lambda: run.stopped, "the stale holder did not stop")
        a.pump(0.2)
        assert out.read_bytes() == written  # its finished line was not appended
        assert not run.feeder.in_flight and not run.ended and bid not in a.svc.runs
        assert store.load(bid).completed == rec.completed  # nor its state saved
    finally:
        a.close()


def test_a_write_queued_on_the_io_thread_before_a_takeover_is_refused_when_it_runs(tmp_path):
    """The stale holder's group of results is already queued on its I/O thread
    (behind a slow write) when another router takes the batch over and raises
    the fence: when the queued write runs, the fence refuses it, nothing is
    appended, and the run stops -- the check is made under the fence's lock at
    the write itself, not when the write was queued."""
    bid, store = _batch(tmp_path)
    a = Router(tmp_path)
    gate = threading.Event()
    try:
        _until(a, lambda: bid in a.svc.runs and len(a.running()) == 2, "router a never ran two lines")
        first, second = a.running()
        a.finish(first)
        _until(a, lambda: a.run().rec.completed == 1, "the first line was never written")
        run = a.run()
        rec = store.load(bid)
        out = tmp_path / "files" / f"{rec.output_file_id}.data"
        written = out.read_bytes()
        token = a.svc.lease.token(bid)
        a.svc.io.submit(gate.wait)  # the I/O thread is busy (a slow disk, a long fsync)
        a.finish(second)
        _until(a, lambda: run.results._flushing is not None, "the second line's write was never queued")
        store.fence(bid, token + 1).claim()  # meanwhile another router takes the batch over

        async def held_elsewhere(_bid: str) -> bool:
            return False

        a.svc.lease.acquire = held_elsewhere  # (that router holds the lease from now on)
        gate.set()
        _until(a, lambda: run.stopped, "the stale holder did not stop")
        a.pump(0.2)
        assert out.read_bytes() == written  # the queued group was not appended
        assert store.load(bid).completed == rec.completed  # nor a state saved
        assert not run.feeder.in_flight and not run.ended and bid not in a.svc.runs
    finally:
        gate.set()
        a.close()


def test_a_drain_while_the_disk_is_full_hands_on_only_what_was_written(small_disk):
    """Results a draining router holds in memory for want of room are written if
    room comes back before it exits; if not they are dropped with its lease, and
    the next holder -- which reads the batch from its files alone -- runs those
    lines again: every line ends with exactly one result, none failed."""
    bid, store = _batch(small_disk)
    a = Router(small_disk)
    try:
        _until(a, lambda: bid in a.svc.runs and len(a.running()) == 2, "router a never ran two lines")
        first, second = a.running()
        a.finish(first)
        _until(a, lambda: a.run().rec.completed == 1, "the first line was never written")
        run = a.run()
        filler = _fill(small_disk)
        a.call(a.h.tokens, second, 3000, "length")  # its result (~6 KB) meets the full disk: held in memory
        _until(a, lambda: run.results.disk_full_since is not None, "the write never met the full disk")
        drain = RouterDrain(a.h.core, a.h.loop, timeout_s=5.0, clock=a.h.clock)
        a.call(drain.start, "test")
        a.pump(0.2)
        for hd in a.running():  # the lines that took the freed slots meanwhile end too: held as well
            a.finish(hd)
        a.pump(0.5)
        # nothing runs, but results are not written: the batch is not handed on yet
        assert not run.feeder.in_flight and not run.handed_off and bid in a.svc.runs
        drain.close()
    finally:
        a.close()  # the router exits with the disk still full: the held result goes with it
    on_disk = store.load(bid)
    assert on_disk.status == m.IN_PROGRESS
    assert [r["custom_id"] for r in _results(small_disk, on_disk.output_file_id)] == ["req-0"]
    filler.unlink()

    b = Router(small_disk)
    try:

        def finish_all() -> bool:
            if bid not in b.svc.runs:
                return True
            for hd in b.running():
                b.finish(hd)
            return False

        _until(b, lambda: bid in b.svc.runs, "router b never took the batch over")
        _until(b, finish_all, "router b never finished the batch", timeout=20.0)
        rec = store.load(bid)
        assert (rec.status, rec.completed, rec.failed) == (m.COMPLETED, N, 0)
        ids = [r["custom_id"] for r in _results(small_disk, rec.output_file_id)]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(N))  # each exactly once
        assert rec.usage.output_tokens == 3 * N  # the held result was not written: its line ran again
    finally:
        b.close()


def test_two_scans_at_once_start_one_run_of_a_batch(tmp_path):
    """A create's kick scans beside the periodic scan; a scan awaits (the fence,
    claimed on the I/O thread) between taking the lease and recording its run,
    so without one scan at a time both started a run of the batch and every
    line was answered twice."""
    a = Router(tmp_path)
    try:
        bid, store = _batch(tmp_path)

        async def scans() -> None:
            await asyncio.gather(a.svc.scan(), a.svc.scan(), a.svc.scan())

        a.h.loop.run_until_complete(scans())
        jobs = a.h.core.jobs

        def finish_every_job() -> bool:
            if store.load(bid).status == m.COMPLETED:
                return True
            for key in [k for k, j in jobs.items() if j.worker is not None]:
                a.finish(int(key, 16))
            return False

        _until(a, finish_every_job, "the batch never finished", timeout=20.0)
        rec = store.load(bid)
        ids = [r["custom_id"] for r in _results(tmp_path, rec.output_file_id)]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(N))  # each exactly once
        assert (rec.completed, rec.failed) == (N, 0)
    finally:
        a.close()
