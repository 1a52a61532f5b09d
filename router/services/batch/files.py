"""Files on disk: ``/v1/files`` (purpose ``batch`` uploads, batch output and error files).

One directory (``[batch] directory``/files): ``<id>.data`` holds the bytes,
``<id>.json`` what OpenAI's file object shows plus its owner (the tenant
that uploaded it; other tenants are told it does not exist).  Every write
is atomic -- a temporary file, fsync, rename, fsync of the directory -- so
a router killed mid-upload leaves either the whole file or none.

Uploads are written as they arrive (``stage`` -> ``FileWriter.write`` ...
-> ``commit`` or ``discard``) and downloads read in chunks (``open_data``),
so no file is ever whole in memory; every call here blocks on the disk and
runs on a thread, never on the event loop.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import IO, Protocol

import msgspec

from router.services.batch.disk import fsync_dir, new_id, write_atomic
from router.services.batch.retention import expired
from router.tenancy.ownership import may_see

UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSES = ("batch_output",)


class FileMeta(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    owner: str
    status: str = "processed"
    expires_at: int | None = None  # gone (404, then deleted) from then on: expires_after

    def public(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": self.status,
            "expires_at": self.expires_at,
            "status_details": None,
        }


_meta_decoder = msgspec.json.Decoder(FileMeta)


class StorageReservation:
    """The room an upload in progress takes (one file, ``bytes``) until it is
    kept (``StorageIndex.put_file``) or ``StorageIndex.release``d: exactly once
    (router.services.batch.storage takes and settles it)."""

    __slots__ = ("owner", "bytes", "live")

    def __init__(self, owner: str, size: int) -> None:
        self.owner = owner
        self.bytes = size
        self.live = True


class FileIndex(Protocol):
    """What the store tells of each file it makes or deletes (router.services.batch.storage.StorageIndex)."""

    def put_file(self, meta: FileMeta, reservation: StorageReservation | None = None) -> None: ...

    def drop_file(self, file_id: str) -> None: ...


# A temporary file (an upload being written, an atomic write) untouched this
# long belongs to a router that died mid-write: the reaper removes it.  Live
# ones are written to at least every few seconds (Envoy's stream idle timeout
# ends a stalled upload long before this).
STALE_TEMP_S = 3600.0


class FileWriter:
    """An upload being written: a temporary file beside the store's files,
    renamed into place by ``FileStore.commit`` or removed by ``discard``."""

    def __init__(self, directory: Path) -> None:
        self.tmp = directory / f".upload-{secrets.token_hex(8)}.tmp"
        self._f: IO[bytes] | None = open(self.tmp, "xb")
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        assert self._f is not None
        self._f.write(data)
        self.size += len(data)

    def seal(self) -> None:
        """Everything written is on disk (fsync); OSError (disk full) propagates."""
        assert self._f is not None
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None

    def discard(self) -> None:
        """Nothing of it is left (whatever state it is in; never raises)."""
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass  # (a full disk fails the close's flush: the file goes anyway)
            self._f = None
        self.tmp.unlink(missing_ok=True)


def _new_meta(
    owner: str, filename: str, purpose: str, size: int, expires_after_s: int | None, file_id: str | None = None
) -> FileMeta:
    now = int(time.time())
    return FileMeta(
        id=file_id or new_id("file-"),
        bytes=size,
        created_at=now,
        filename=filename,
        purpose=purpose,
        owner=owner,
        expires_at=None if expires_after_s is None else now + expires_after_s,
    )


class FileStore:
    def __init__(self, directory: Path, index: FileIndex | None = None) -> None:
        self.dir = directory / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = index  # told of every file made or deleted (router.services.batch.storage)

    def data_path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.data"

    def _meta_path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.json"

    def create(
        self, owner: str, filename: str, purpose: str, data: bytes, expires_after_s: int | None = None
    ) -> FileMeta:
        meta = _new_meta(owner, filename, purpose, len(data), expires_after_s)
        write_atomic(self.data_path(meta.id), data)
        write_atomic(self._meta_path(meta.id), msgspec.json.encode(meta))  # last: the file exists from here
        self._indexed(meta)
        return meta

    def stage(self) -> FileWriter:
        """A new upload's writer (committed, or discarded, by its caller)."""
        return FileWriter(self.dir)

    def commit(
        self,
        writer: FileWriter,
        owner: str,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
        reservation: StorageReservation | None = None,
    ) -> FileMeta:
        """A sealed upload becomes a file: its data renamed into place, then its
        meta written (the file exists from there), counted in place of the
        upload's ``reservation``.  Any failure (a full disk) leaves neither behind."""
        meta = _new_meta(owner, filename, purpose, writer.size, expires_after_s)
        data = self.data_path(meta.id)
        try:
            os.replace(writer.tmp, data)
            fsync_dir(self.dir)
            write_atomic(self._meta_path(meta.id), msgspec.json.encode(meta))
        except BaseException:
            self._meta_path(meta.id).unlink(missing_ok=True)
            data.unlink(missing_ok=True)
            writer.discard()
            raise
        self._indexed(meta, reservation)
        return meta

    def open_data(self, file_id: str) -> tuple[IO[bytes], int]:
        """A file's bytes to read in chunks, and their size now (OSError: gone)."""
        f = open(self.data_path(file_id), "rb")
        return f, os.fstat(f.fileno()).st_size

    def register(
        self, owner: str, file_id: str, filename: str, purpose: str, expires_after_s: int | None = None
    ) -> FileMeta:
        """A file written in place (a batch's output or errors) becomes visible."""
        size = self.data_path(file_id).stat().st_size
        meta = _new_meta(owner, filename, purpose, size, expires_after_s, file_id)
        write_atomic(self._meta_path(file_id), msgspec.json.encode(meta))
        self._indexed(meta)
        return meta

    def _indexed(self, meta: FileMeta, reservation: StorageReservation | None = None) -> None:
        if self.index is not None:
            self.index.put_file(meta, reservation)

    def read_meta(self, file_id: str) -> FileMeta | None:
        """A file's metadata whoever owns it (housekeeping only: the API goes through ``get``)."""
        try:
            return _meta_decoder.decode(self._meta_path(file_id).read_bytes())
        except (OSError, msgspec.DecodeError):
            return None

    def remove_stale_temps(self, now: float) -> int:
        """Delete temporary files (``.*.tmp``) untouched for ``STALE_TEMP_S``; how many."""
        n = 0
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    if e.name.startswith(".") and e.name.endswith(".tmp"):
                        try:
                            if e.stat().st_mtime < now - STALE_TEMP_S:
                                os.unlink(e.path)
                                n += 1
                        except OSError:
                            pass  # (gone meanwhile: committed, discarded or reaped by another router)
        except OSError:
            pass
        return n

    def remove(self, file_id: str) -> None:
        """Delete a file whoever owns it (the reaper: it expired)."""
        self._meta_path(file_id).unlink(missing_ok=True)  # first: gone for readers from here
        self.data_path(file_id).unlink(missing_ok=True)

    def get(self, owner: str, file_id: str) -> FileMeta | None:
        if not _safe_id(file_id):
            return None
        try:
            meta = _meta_decoder.decode(self._meta_path(file_id).read_bytes())
        except (OSError, msgspec.DecodeError):
            return None
        if not may_see(meta.owner, owner) or expired(meta.expires_at, time.time()):
            return None  # an expired file is gone before the reaper deletes it
        return meta

    def delete(self, owner: str, file_id: str) -> bool:
        if self.get(owner, file_id) is None:
            return False
        self._meta_path(file_id).unlink(missing_ok=True)  # first: gone for readers from here
        self.data_path(file_id).unlink(missing_ok=True)
        if self.index is not None:
            self.index.drop_file(file_id)
        return True


def _safe_id(file_id: str) -> bool:
    return file_id.startswith("file-") and file_id[5:].isalnum() and len(file_id) <= 64
