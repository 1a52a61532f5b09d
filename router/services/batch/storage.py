"""What each tenant keeps in the Batch API's directory, and whether it may keep more.

``StorageIndex`` is the one owner of the per-tenant accounting: every file and
batch by tenant, with its size and status.  The stores (router.services.batch.files,
router.services.batch.store) tell it each object they write or delete; it is built
from the directory at start and read again every ``housekeeping_interval_s``
(``refresh``), both on a thread, so it also learns what other routers
sharing the directory did.  Lists (``GET /v1/files``, ``GET /v1/batches``)
are pages of it: they read no disk and see only the caller's tenant.

An upload reserves room while it is written (``reserve``: its count, and the
bytes it declared: a ``StorageReservation``), so uploads of one tenant running
at once cannot each pass the limits on what is stored: each counts the others'
reservations.  A reservation is settled to the file's size once it is known
(``settle``: checked again), and ends exactly once: turned into the file by
``put_file``, or ``release``d.

``upload_refusal`` and ``batch_refusal`` decide from a tenant's usage and
limits alone (pure); ``reap`` deletes expired files and old ended batches
(router.services.batch.retention decides which), on a thread.
"""

from __future__ import annotations

import bisect
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from router.services.batch import retention
from router.services.batch import rules as m
from router.services.batch.files import StorageReservation
from shared.errors import Code, error
from shared.protocol import ErrorInfo

if TYPE_CHECKING:
    from router.services.batch.files import FileMeta, FileStore
    from router.services.batch.store import BatchRecord, BatchStore
    from shared.config import ApiKey, BatchConfig, TenantConfig

log = logging.getLogger("weir.batch")

# Before an upload is read, its body (Content-Length) less this is taken as a
# lower bound of the file's size: the multipart framing and the other fields.
FRAMING_BYTES = 64 << 10
QUOTA_RETRY_AFTER_S = 60.0  # a hint: room comes back when files are deleted or expire, batches end
# Uploads of one tenant in progress at once: each may hold router.ingress.file_upload's
# HIGH_WATER (256 KiB) in memory while the disk catches up, so this bounds a
# tenant's share of router memory (shared.errors' text says 32: keep them one).
MAX_UPLOADS_IN_PROGRESS = 32
UPLOADS_RETRY_AFTER_S = 1.0


class StorageLimits(NamedTuple):
    """What a tenant may keep: files, their bytes, batches not ended."""

    files: int
    file_bytes: int
    active_batches: int


class StorageUse(NamedTuple):
    """What a tenant keeps (stored, and reserved by uploads in progress), against its ``StorageLimits``."""

    files: int
    file_bytes: int
    active_batches: int


_FIELDS = ("max_stored_files", "max_stored_file_bytes", "max_active_batches")


def limits_for(bcfg: BatchConfig, key: ApiKey | None, tenant: TenantConfig | None) -> StorageLimits:
    """The [batch] defaults, or what the key and its tenant set (both: the smaller)."""
    out = []
    for f in _FIELDS:
        own = [v for x in (key, tenant) if x is not None and (v := getattr(x, f)) is not None]
        out.append(min(own) if own else getattr(bcfg, f))
    return StorageLimits(*out)


def upload_refusal(usage: StorageUse, limits: StorageLimits, size: int) -> ErrorInfo | None:
    """May the tenant keep one more file of ``size`` bytes?  (Before the
    upload is read, ``size`` is a lower bound of it.)"""
    if usage.files + 1 > limits.files:
        return error(
            Code.FILES_LIMIT,
            f"This tenant keeps {usage.files} files, its limit (max_stored_files = {limits.files}); "
            "delete some, or wait for them to expire.",
            param="max_stored_files",
            retry_after=QUOTA_RETRY_AFTER_S,
        )
    if usage.file_bytes + size > limits.file_bytes:
        return error(
            Code.FILE_BYTES_LIMIT,
            f"This file ({size} bytes) would take this tenant's files over its limit "
            f"(max_stored_file_bytes = {limits.file_bytes}; {usage.file_bytes} used).",
            param="max_stored_file_bytes",
        )
    return None


def batch_refusal(usage: StorageUse, limits: StorageLimits) -> ErrorInfo | None:
    """May the tenant start one more batch?"""
    if usage.active_batches + 1 > limits.active_batches:
        return error(
            Code.ACTIVE_BATCHES_LIMIT,
            f"This tenant has {usage.active_batches} batches not yet ended, its limit "
            f"(max_active_batches = {limits.active_batches}); wait for one to end or cancel one.",
            param="max_active_batches",
            retry_after=QUOTA_RETRY_AFTER_S,
        )
    return None


class _Sorted:
    """Objects of one kind by id, and their ids in (created_at, id) order."""

    __slots__ = ("by_id", "keys")

    def __init__(self) -> None:
        self.by_id: dict[str, tuple[int, object]] = {}  # id -> (created_at, object)
        self.keys: list[tuple[int, str]] = []

    def put(self, oid: str, created_at: int, obj: object) -> object | None:
        old = self.by_id.get(oid)
        if old is None:
            bisect.insort(self.keys, (created_at, oid))
        elif old[0] != created_at:
            self.keys.remove((old[0], oid))
            bisect.insort(self.keys, (created_at, oid))
        self.by_id[oid] = (created_at, obj)
        return None if old is None else old[1]

    def drop(self, oid: str) -> object | None:
        old = self.by_id.pop(oid, None)
        if old is None:
            return None
        i = bisect.bisect_left(self.keys, (old[0], oid))
        del self.keys[i]
        return old[1]

    def newest_first(self, after: str | None) -> Iterator[str] | None:
        """Ids, newest first, from just after ``after``; None if ``after`` is unknown."""
        if after is None:
            end = len(self.keys)
        else:
            got = self.by_id.get(after)
            if got is None:
                return None
            end = bisect.bisect_left(self.keys, (got[0], after))
        return (self.keys[i][1] for i in range(end - 1, -1, -1))


class _Tenant:
    __slots__ = ("files", "batches", "file_bytes", "active", "held_files", "held_bytes")

    def __init__(self) -> None:
        self.files = _Sorted()
        self.batches = _Sorted()
        self.file_bytes = 0
        self.active: set[str] = set()  # batch ids not ended
        self.held_files = 0  # uploads in progress (StorageReservation), counted with the stored files
        self.held_bytes = 0

    def usage(self) -> StorageUse:
        return StorageUse(len(self.files.by_id) + self.held_files, self.file_bytes + self.held_bytes, len(self.active))


class StorageIndex:
    """Every tenant's files and batches, in memory (one lock: the stores write
    from the batch I/O thread, the API reads on the loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[str, _Tenant] = {}
        self._file_owner: dict[str, str] = {}
        self._batch_owner: dict[str, str] = {}

    def _tenant(self, owner: str) -> _Tenant:
        t = self._by.get(owner)
        if t is None:
            t = self._by[owner] = _Tenant()
        return t

    # ------------------------------------------------------------ what the stores tell it

    def put_file(self, meta: FileMeta, reservation: StorageReservation | None = None) -> None:
        """A file written (``reservation``: the upload's, which it replaces at once)."""
        with self._lock:
            if reservation is not None:
                self._release(reservation)
            t = self._tenant(meta.owner)
            old = t.files.put(meta.id, meta.created_at, meta)
            t.file_bytes += meta.bytes - (old.bytes if old is not None else 0)  # type: ignore[attr-defined]
            self._file_owner[meta.id] = meta.owner

    def drop_file(self, file_id: str) -> None:
        with self._lock:
            owner = self._file_owner.pop(file_id, None)
            t = self._by.get(owner) if owner is not None else None
            if t is not None:
                old = t.files.drop(file_id)
                if old is not None:
                    t.file_bytes -= old.bytes  # type: ignore[attr-defined]

    def put_batch(self, rec: BatchRecord) -> None:
        with self._lock:
            t = self._tenant(rec.owner)
            t.batches.put(rec.id, rec.created_at, rec)
            if rec.status in m.TERMINAL:
                t.active.discard(rec.id)
            else:
                t.active.add(rec.id)
            self._batch_owner[rec.id] = rec.owner

    def drop_batch(self, batch_id: str) -> None:
        with self._lock:
            owner = self._batch_owner.pop(batch_id, None)
            t = self._by.get(owner) if owner is not None else None
            if t is not None:
                t.batches.drop(batch_id)
                t.active.discard(batch_id)

    # ------------------------------------------------------------ uploads in progress

    def reserve(self, owner: str, limits: StorageLimits | None, size: int) -> StorageReservation | ErrorInfo:
        """Reserve room for an upload of at least ``size`` bytes, or why not
        (``limits`` None: taken unchecked, ``settle`` checks it)."""
        with self._lock:
            t = self._tenant(owner)
            if t.held_files >= MAX_UPLOADS_IN_PROGRESS:
                return error(
                    Code.UPLOADS_IN_PROGRESS,
                    f"This tenant has {t.held_files} uploads in progress, the most at once "
                    f"({MAX_UPLOADS_IN_PROGRESS}); send this one when one of them has ended.",
                    param="file",
                    retry_after=UPLOADS_RETRY_AFTER_S,
                )
            if limits is not None:
                refused = upload_refusal(t.usage(), limits, size)
                if refused is not None:
                    return refused
            t.held_files += 1
            t.held_bytes += size
            return StorageReservation(owner, size)

    def settle(self, reservation: StorageReservation, limits: StorageLimits, size: int) -> ErrorInfo | None:
        """The upload is ``size`` bytes: its reservation becomes that if the tenant has
        room for it beside everything else stored and reserved; else it is released."""
        with self._lock:
            if not reservation.live:
                raise ValueError("settle of a reservation already ended")
            t = self._tenant(reservation.owner)
            u = t.usage()
            without = StorageUse(u.files - 1, u.file_bytes - reservation.bytes, u.active_batches)
            refused = upload_refusal(without, limits, size)
            if refused is not None:
                self._release(reservation)
                return refused
            t.held_bytes += size - reservation.bytes
            reservation.bytes = size
            return None

    def release(self, reservation: StorageReservation) -> None:
        """The upload ends without a file (refused, client gone, disk full); a second call does nothing."""
        with self._lock:
            self._release(reservation)

    def _release(self, reservation: StorageReservation) -> None:
        if not reservation.live:
            return
        reservation.live = False
        t = self._tenant(reservation.owner)
        t.held_files -= 1
        t.held_bytes -= reservation.bytes

    # ------------------------------------------------------------ what the API reads

    def usage(self, owner: str) -> StorageUse:
        """What counts against the tenant's limits: stored, and reserved by uploads in progress."""
        with self._lock:
            t = self._by.get(owner)
            return StorageUse(0, 0, 0) if t is None else t.usage()

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(t for t, u in self._by.items() if u.files.by_id or u.batches.by_id)

    def files_page(
        self, owner: str, after: str | None, limit: int, purpose: str | None, now: float | None = None
    ) -> list[FileMeta] | None:
        """Up to ``limit`` + 1 of the tenant's files, newest first (the extra one: there are more),
        expired ones left out; None if ``after`` is not one of its files."""
        now = time.time() if now is None else now
        with self._lock:
            t = self._by.get(owner)
            if t is None:
                return None if after is not None else []
            ids = t.files.newest_first(after)
            if ids is None:
                return None
            out: list[FileMeta] = []
            for fid in ids:
                meta: FileMeta = t.files.by_id[fid][1]  # type: ignore[assignment]
                if (purpose is None or meta.purpose == purpose) and not retention.expired(meta.expires_at, now):
                    out.append(meta)
                    if len(out) > limit:
                        break
            return out

    def batches_page(self, owner: str, after: str | None, limit: int) -> list[BatchRecord] | None:
        """As ``files_page``, for batches (as last saved or read)."""
        with self._lock:
            t = self._by.get(owner)
            if t is None:
                return None if after is not None else []
            ids = t.batches.newest_first(after)
            if ids is None:
                return None
            out: list[BatchRecord] = []
            for bid in ids:
                out.append(t.batches.by_id[bid][1])  # type: ignore[arg-type]
                if len(out) > limit:
                    break
            return out

    # ------------------------------------------------------------ what housekeeping reads

    def _snapshot(self) -> tuple[dict[str, str], dict[str, str]]:
        with self._lock:
            return dict(self._file_owner), dict(self._batch_owner)

    def _expired_files(self, now: float) -> list[str]:
        """Files past their expires_at, but not the input of a batch that still runs."""
        with self._lock:
            out = []
            for t in self._by.values():
                inputs = {t.batches.by_id[b][1].input_file_id for b in t.active}  # type: ignore[attr-defined]
                for fid, (_, meta) in t.files.by_id.items():
                    if retention.expired(meta.expires_at, now) and fid not in inputs:  # type: ignore[attr-defined]
                        out.append(fid)
            return out

    def _old_batches(self, now: float, retention_s: float) -> list[str]:
        with self._lock:
            out = []
            for t in self._by.values():
                for bid, (_, rec) in t.batches.by_id.items():
                    r: BatchRecord = rec  # type: ignore[assignment]
                    if retention.batch_reapable(r.status, r.stamps, r.created_at, now, retention_s):
                        out.append(bid)
            return out

    def _running_elsewhere(self) -> list[str]:
        with self._lock:
            return [b for t in self._by.values() for b in t.active]

    # ------------------------------------------------------------ on a thread

    def refresh(self, files: FileStore, batches: BatchStore, local: frozenset[str] = frozenset()) -> None:
        """Read the directory again: objects another router made or deleted,
        and the status of batches not run here (``local``: those that are).
        Only what changed is read."""
        known_files, known_batches = self._snapshot()  # before the listing: what is put after stays
        names = _names(files.dir, ".json")
        for fid in known_files.keys() - names:
            self.drop_file(fid)
        for fid in names - known_files.keys():
            meta = files.read_meta(fid)
            if meta is not None:
                self.put_file(meta)
        ids = _names(batches.dir, "")
        for bid in known_batches.keys() - ids:
            self.drop_batch(bid)
        for bid in (ids - known_batches.keys()) | (set(self._running_elsewhere()) - local):
            rec = batches.load(bid)
            if rec is not None:
                self.put_batch(rec)

    def reap(self, files: FileStore, batches: BatchStore, now: float, retention_s: float) -> list[str]:
        """Delete expired files and batches ended more than ``retention_s`` ago; the batch ids deleted."""
        for fid in self._expired_files(now):
            self.drop_file(fid)
            files.remove(fid)
        files.remove_stale_temps(now)  # uploads (and atomic writes) of a router that died mid-write
        gone = self._old_batches(now, retention_s)
        for bid in gone:
            self.drop_batch(bid)
            shutil.rmtree(batches.path(bid), ignore_errors=True)
        return gone


def _names(directory: Path, suffix: str) -> set[str]:
    """Object ids in a store's directory (``file-*<suffix>``, ``batch_*``)."""
    out = set()
    try:
        with os.scandir(directory) as it:
            for e in it:
                n = e.name
                if suffix and n.startswith("file-") and n.endswith(suffix):
                    out.add(n[: -len(suffix)])
                elif not suffix and n.startswith("batch_"):
                    out.add(n)
    except OSError:
        pass
    return out
