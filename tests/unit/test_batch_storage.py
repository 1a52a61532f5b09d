"""Per-tenant storage of the Batch API, its pure parts: the quota decision, the
limits a key and its tenant resolve to, the retention math, and the usage
index's accounting and pages (router.services.batch.storage, router.services.batch.retention)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from router.services.batch import retention
from router.services.batch import rules as m
from router.services.batch.files import FileMeta, FileStore, StorageReservation
from router.services.batch.storage import (
    MAX_UPLOADS_IN_PROGRESS,
    StorageIndex,
    StorageLimits,
    StorageUse,
    batch_refusal,
    limits_for,
    upload_refusal,
)
from router.services.batch.store import BatchStore
from shared.config import ApiKey, BatchConfig, TenantConfig
from shared.errors import Code, code_of


def test_limits_are_the_batch_defaults_unless_the_key_or_tenant_sets_its_own_and_the_smaller_wins():
    b = BatchConfig(max_stored_files=100, max_stored_file_bytes=1000, max_active_batches=10)
    key = ApiKey(key="k", tenant="t", max_stored_files=5)
    tenant = TenantConfig(name="t", max_stored_files=50, max_active_batches=20)
    assert limits_for(b, None, None) == StorageLimits(100, 1000, 10)
    assert limits_for(b, None, tenant) == StorageLimits(50, 1000, 20)  # a tenant may raise a default
    assert limits_for(b, key, None) == StorageLimits(5, 1000, 10)
    assert limits_for(b, key, tenant) == StorageLimits(5, 1000, 20)
    assert limits_for(b, ApiKey(key="k", tenant="t", max_stored_files=500), tenant).files == 50


def test_an_upload_is_refused_at_the_count_limit_with_429_and_over_the_bytes_limit_with_413():
    lim = StorageLimits(files=3, file_bytes=100, active_batches=1)
    assert upload_refusal(StorageUse(2, 50, 0), lim, 50) is None  # exactly full after it: allowed
    count = upload_refusal(StorageUse(3, 0, 0), lim, 1)
    assert count is not None and code_of(count) is Code.FILES_LIMIT
    assert (count.status, count.param, count.code) == (429, "max_stored_files", "file_count_limit_exceeded")
    assert count.retry_after and count.retry_after > 0
    size = upload_refusal(StorageUse(2, 50, 0), lim, 51)
    assert size is not None and code_of(size) is Code.FILE_BYTES_LIMIT
    assert (size.status, size.param) == (413, "max_stored_file_bytes")
    assert "max_stored_file_bytes = 100" in size.message and "50 used" in size.message
    assert upload_refusal(StorageUse(0, 0, 0), StorageLimits(0, 100, 1), 1) is not None  # a limit of 0: none at all


def test_a_batch_is_refused_at_the_active_batch_limit():
    lim = StorageLimits(files=3, file_bytes=100, active_batches=2)
    assert batch_refusal(StorageUse(0, 0, 1), lim) is None
    got = batch_refusal(StorageUse(0, 0, 2), lim)
    assert got is not None and (got.status, got.code, got.param) == (
        429,
        "active_batch_limit_exceeded",
        "max_active_batches",
    )


@pytest.mark.parametrize(
    "anchor, seconds, want",
    [
        ("created_at", 3600, 3600),
        ("created_at", 2_592_000, 2_592_000),
        ("created_at", "7200", 7200),  # a multipart form field
        ("created_at", 3599, "between 3600 and 2592000"),
        ("created_at", 2_592_001, "between 3600 and 2592000"),
        ("created_at", True, "integer"),
        ("created_at", 3600.5, "integer"),
        ("created_at", None, "integer"),
        ("last_active_at", 3600, "anchor"),
        (None, 3600, "anchor"),
    ],
)
def test_expires_after_takes_openais_anchor_and_bounds(anchor, seconds, want):
    got = retention.expires_after_seconds(anchor, seconds)
    if isinstance(want, int):
        assert got == want
    else:
        assert isinstance(got, str) and want in got


def test_retention_math():
    assert not retention.expired(None, 1e12)
    assert not retention.expired(100, 99.9) and retention.expired(100, 100)
    stamps = {"completed_at": 1000}
    assert not retention.batch_reapable(m.IN_PROGRESS, {}, 0, 1e12, 0)  # running: never
    assert not retention.batch_reapable(m.COMPLETED, stamps, 0, 1999, 1000)
    assert retention.batch_reapable(m.COMPLETED, stamps, 0, 2000, 1000)
    assert retention.batch_reapable(m.FAILED, {}, 500, 1500, 1000)  # no end stamp: from its creation


def _meta(fid: str, owner: str, created: int, size: int = 10, purpose: str = "batch", expires_at=None) -> FileMeta:
    return FileMeta(
        id=fid, bytes=size, created_at=created, filename="f", purpose=purpose, owner=owner, expires_at=expires_at
    )


def test_the_index_counts_each_tenants_files_bytes_and_active_batches(tmp_path: Path):
    idx = StorageIndex()
    idx.put_file(_meta("file-a1", "a", 1, 10))
    idx.put_file(_meta("file-a2", "a", 2, 30))
    idx.put_file(_meta("file-b1", "b", 1, 5))
    idx.put_file(_meta("file-a2", "a", 2, 40))  # the same file again: counted once, its new size
    assert (
        idx.usage("a") == StorageUse(2, 50, 0)
        and idx.usage("b") == StorageUse(1, 5, 0)
        and idx.usage("c") == StorageUse(0, 0, 0)
    )
    idx.drop_file("file-a1")
    idx.drop_file("file-a1")
    assert idx.usage("a") == StorageUse(1, 40, 0)
    store = BatchStore(tmp_path, idx)
    now = int(time.time())
    rec = store.new(
        owner="a",
        key_digest="",
        input_file_id="file-a2",
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=now,
        expires_at=now + 60,
    )
    assert idx.usage("a").active_batches == 1
    rec.move(m.IN_PROGRESS)
    rec.move(m.EXPIRED)
    store.save(rec)
    assert idx.usage("a").active_batches == 0 and idx.usage("b").active_batches == 0


def test_pages_are_newest_first_from_after_with_has_more_and_one_tenants_only():
    idx = StorageIndex()
    for i in range(5):
        idx.put_file(_meta(f"file-a{i}", "a", 100 + i, purpose="batch" if i % 2 else "batch_output"))
    idx.put_file(_meta("file-b0", "b", 200))
    first = idx.files_page("a", None, 2, None)
    assert [f.id for f in first] == ["file-a4", "file-a3", "file-a2"]  # limit + 1: there are more
    assert [f.id for f in idx.files_page("a", "file-a3", 2, None)] == ["file-a2", "file-a1", "file-a0"]
    assert [f.id for f in idx.files_page("a", "file-a1", 2, None)] == ["file-a0"]
    assert [f.id for f in idx.files_page("a", None, 10, "batch")] == ["file-a3", "file-a1"]
    assert idx.files_page("a", "file-b0", 2, None) is None  # another tenant's id is no cursor
    assert idx.files_page("c", None, 2, None) == []
    idx.put_file(_meta("file-a9", "a", 300, expires_at=1000))
    assert idx.files_page("a", None, 1, None, now=999)[0].id == "file-a9"
    assert idx.files_page("a", None, 1, None, now=1000)[0].id == "file-a4"  # expired: not listed


def test_the_index_learns_another_routers_files_and_deletions_from_the_directory(tmp_path: Path):
    mine, other = StorageIndex(), StorageIndex()
    files_mine, files_other = FileStore(tmp_path, mine), FileStore(tmp_path, other)
    batches = BatchStore(tmp_path, mine)
    a = files_other.create("a", "x.jsonl", "batch", b"{}\n")
    files_mine.create("a", "y.jsonl", "batch", b"{}\n{}\n")
    assert mine.usage("a").files == 1
    mine.refresh(files_mine, batches)
    assert mine.usage("a") == StorageUse(2, 9, 0)
    files_other.delete("a", a.id)
    mine.refresh(files_mine, batches)
    assert mine.usage("a") == StorageUse(1, 6, 0)


def test_the_reaper_deletes_expired_files_but_not_a_running_batchs_input_and_old_ended_batches(tmp_path: Path):
    idx = StorageIndex()
    files, batches = FileStore(tmp_path, idx), BatchStore(tmp_path, idx)
    keep = files.create("a", "k", "batch", b"{}\n")
    gone = files.create("a", "g", "batch", b"{}\n", expires_after_s=3600)
    used = files.create("a", "u", "batch", b"{}\n", expires_after_s=3600)
    now = int(time.time())
    run = batches.new(
        owner="a",
        key_digest="",
        input_file_id=used.id,
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=now,
        expires_at=now + 86400,
    )
    old = batches.new(
        owner="a",
        key_digest="",
        input_file_id=keep.id,
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=now,
        expires_at=now + 86400,
    )
    old.move(m.CANCELLED, now=now)
    batches.save(old)
    assert files.get("a", gone.id) is not None
    later = now + 3601
    assert idx.reap(files, batches, later, retention_s=7200) == []  # the batch ended 3601 s ago
    assert not files.data_path(gone.id).exists() and files.read_meta(gone.id) is None
    assert files.data_path(used.id).exists() and files.data_path(keep.id).exists()
    assert idx.usage("a") == StorageUse(2, 6, 1)
    assert idx.reap(files, batches, now + 7200, retention_s=7200) == [old.id]
    assert not batches.path(old.id).exists() and batches.load(old.id) is None and batches.load(run.id) is not None


def test_storage_limits_load_from_the_config_and_a_negative_one_is_refused():
    from shared.config import ConfigError, loads

    cfg = loads('[batch]\nmax_active_batches = 3\n[[tenants]]\nname = "t"\nmax_stored_files = 7\n')
    assert limits_for(cfg.batch, None, cfg.tenants[0]) == StorageLimits(7, 10 << 30, 3)
    with pytest.raises(ConfigError, match="max_stored_file_bytes"):
        loads('[[tenants]]\nname = "t"\nmax_stored_file_bytes = -1\n')
    with pytest.raises(ConfigError, match="housekeeping_interval_s"):
        loads("[batch]\nhousekeeping_interval_s = 0\n")


def test_the_reaper_removes_a_dead_routers_upload_temps_and_leaves_live_ones(tmp_path: Path):
    """A router killed mid-upload leaves ``.upload-*.tmp``; untouched for an hour, the reaper deletes it."""
    import os

    from router.services.batch.files import STALE_TEMP_S

    files, batches = FileStore(tmp_path), BatchStore(tmp_path)
    dead, live = files.stage(), files.stage()
    dead.write(b"half an upload")
    live.write(b"being written")
    now = time.time()
    os.utime(dead.tmp, (now - STALE_TEMP_S - 1, now - STALE_TEMP_S - 1))
    kept = files.create("t", "in.jsonl", "batch", b"x\n")
    StorageIndex().reap(files, batches, now, 86400.0)
    assert not dead.tmp.exists() and live.tmp.exists()
    assert files.get("t", kept.id) is not None
    live.discard()


def test_an_upload_holds_room_until_its_file_takes_its_place_or_it_is_released_once(tmp_path: Path):
    idx = StorageIndex()
    store = FileStore(tmp_path, idx)
    lim = StorageLimits(files=3, file_bytes=100, active_batches=1)
    first = idx.reserve("t", lim, 40)
    assert isinstance(first, StorageReservation) and idx.usage("t") == StorageUse(1, 40, 0)
    second = idx.reserve("t", lim, 60)  # 100: exactly full with both held
    assert isinstance(second, StorageReservation)
    over = idx.reserve("t", lim, 1)  # the holds count: no room
    assert not isinstance(over, StorageReservation) and code_of(over) is Code.FILE_BYTES_LIMIT
    unchecked = idx.reserve("t", None, 0)  # before the index is built (a chunked body: no size yet)
    assert isinstance(unchecked, StorageReservation) and idx.usage("t") == StorageUse(3, 100, 0)
    # the first turns out 50 bytes: no room beside the second's 60
    got = idx.settle(first, lim, 50)
    assert got is not None and code_of(got) is Code.FILE_BYTES_LIMIT and not first.live
    idx.release(first)  # released already: nothing changes
    assert idx.usage("t").files == 2
    # the second is written whole: its file takes its place, counted once
    assert idx.settle(second, lim, 55) is None and idx.usage("t") == StorageUse(2, 55, 0)
    w = store.stage()
    w.write(b"x" * 55)
    w.seal()
    store.commit(w, "t", "f", "batch", reservation=second)
    assert not second.live
    idx.release(second)
    assert idx.usage("t") == StorageUse(2, 55, 0)  # the file in the hold's place + the unchecked hold
    idx.release(unchecked)
    assert idx.usage("t") == StorageUse(1, 55, 0)


def test_a_tenant_has_at_most_32_uploads_in_progress_whatever_its_storage_limits():
    idx = StorageIndex()
    roomy = StorageLimits(files=10_000, file_bytes=10**12, active_batches=1)
    held = [idx.reserve("t", roomy, 1) for _ in range(MAX_UPLOADS_IN_PROGRESS)]
    assert all(isinstance(h, StorageReservation) for h in held)
    over = idx.reserve("t", roomy, 1)
    assert not isinstance(over, StorageReservation) and code_of(over) is Code.UPLOADS_IN_PROGRESS
    assert (over.status, over.param) == (429, "file") and over.retry_after
    assert not isinstance(idx.reserve("t", None, 0), StorageReservation)  # before the index is built too
    assert isinstance(idx.reserve("u", roomy, 1), StorageReservation)  # another tenant is not affected
    idx.release(held[0])  # type: ignore[arg-type]
    assert isinstance(idx.reserve("t", roomy, 1), StorageReservation)  # one ended: room for one more
