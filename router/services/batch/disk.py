"""The batch directory's two primitives: new object ids, and writes that are whole or absent.

Below the stores (router.services.batch.files, router.services.batch.store):
both name their objects with ``new_id`` and write their state with
``write_atomic``, and neither needs the other for it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Either the old content or all of ``data``, never a part, even if killed."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
