"""/v1/files through router.ingress.http_server on a real loopback socket: uploads are
parsed and written as they arrive, downloads sent in chunks, and no request
body is held after its response starts.

The server is the real one with the real Batch API routes over a real
BatchService (its stores, index and limits) in a temporary directory; only
the generation core (unused here) and the router core's key table holder are
stand-ins.  Memory is what
``tracemalloc`` sees the whole process allocate (the server runs on a thread
of this process), so "never whole in memory" is measured, not inferred.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import tracemalloc
import types
from pathlib import Path

import prometheus_client
import pytest
import uvloop

from router.ingress.files_batches import batch_routes, owner_of_key
from router.ingress.http_server import HttpConnection, start_http_server
from router.observe.metrics import RouterMetrics
from router.services.batch.files import FileStore, FileWriter
from router.services.batch.service import BatchService
from router.tenancy.identity import Keys
from shared.config import loads

MB = 1 << 20
BOUNDARY = "weirtestboundary7MA4YWxkTrZu0gW"
CONFIG = """
[batch]
directory = "{root}"
max_file_bytes = {max_file_bytes}

[[api_keys]]
key = "sk-a"
tenant = "tenant-a"

[[api_keys]]
key = "sk-b"
tenant = "tenant-b"
"""


class SlowWriter(FileWriter):
    """The real writer on a slow disk: each write takes a while."""

    def write(self, data):
        time.sleep(0.002)
        super().write(data)


class SlowStore(FileStore):
    def stage(self):
        return SlowWriter(self.dir)


class Srv:
    def __init__(self, port: int, store: FileStore, loop, conns: set[HttpConnection]):
        self.port = port
        self.store = store
        self.loop = loop
        self.conns = conns

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=20)

    def leftovers(self) -> list[str]:
        return sorted(os.listdir(self.store.dir))


@contextlib.contextmanager
def serve(root: Path, *, max_file_bytes: int = 64 * MB, max_body_bytes: int = 64 * 1024, store_cls=FileStore):
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = loads(CONFIG.format(root=root, max_file_bytes=max_file_bytes), str(root))
    registry = prometheus_client.CollectorRegistry()
    core = types.SimpleNamespace(
        cfg=cfg,
        keys=Keys(cfg),
        metrics=types.SimpleNamespace(registry=registry),
        batch_tenants=None,
        on_keys_reloaded=[],
    )
    metrics = RouterMetrics(registry)
    conns: set[HttpConnection] = set()

    async def start():
        svc = BatchService(core, cfg)  # type: ignore[arg-type]
        await svc.housekeep()  # the index built from the directory, as at start
        svc.files = store_cls(root, svc.files.index)
        routes = batch_routes(svc, owner_of_key(core), max_file_bytes)
        server = await start_http_server(
            types.SimpleNamespace(),  # type: ignore[arg-type]
            types.SimpleNamespace(),  # type: ignore[arg-type]
            metrics,
            "127.0.0.1",
            0,
            max_body_bytes=max_body_bytes,
            connections=conns,
            extra_routes=routes,
            max_upload_bytes=max_file_bytes,
        )
        return svc, server

    svc, srv = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield Srv(srv.sockets[0].getsockname()[1], svc.files, loop, conns)
    finally:
        loop.call_soon_threadsafe(srv.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        for pool in (svc.io, svc.housekeeping, svc.pages):
            pool.shutdown()


# ------------------------------------------------------------ raw HTTP


def _head(extra: str = "", key: str = "sk-a", length: int | None = None, path: str = "/v1/files") -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: x",
        f"Authorization: Bearer {key}",
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}",
    ]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def _preamble(filename: str = "in.jsonl", purpose: str = "batch") -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()


CLOSE = f"\r\n--{BOUNDARY}--\r\n".encode()
LINE = b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}\n'


def _chunk_of(n: int) -> bytes:
    return (LINE * (n // len(LINE) + 1))[:n]


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (Content-Length framed)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError(f"closed before a response: {buf!r}")
        buf += got
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        got = sock.recv(65536)
        if not got:
            break
        body += got
    return status, headers, body


def upload(srv: Srv, size: int, piece: int = MB, **kw) -> tuple[int, dict, bytes, str]:
    """Upload a ``size``-byte file, sent ``piece`` bytes at a time (one buffer
    reused: the client holds a piece, never the file); its sha256 too."""
    chunk = _chunk_of(piece)
    pre = _preamble(**kw)
    sha = hashlib.sha256()
    with srv.connect() as s:
        s.sendall(_head(length=len(pre) + size + len(CLOSE)) + pre)
        left = size
        while left > 0:
            part = chunk if left >= piece else chunk[:left]
            s.sendall(part)
            sha.update(part)
            left -= len(part)
        s.sendall(CLOSE)
        status, headers, body = read_response(s)
    return status, headers, body, sha.hexdigest()


def _traced_peak_during(fn) -> tuple[int, int, object]:
    """(peak above the start, current above the start after ``fn``, fn's result)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = fn()
        time.sleep(0.2)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base, current - base, got


# ------------------------------------------------------------ uploads


def test_an_upload_is_written_as_it_arrives_never_whole_in_memory_even_on_a_slow_disk(tmp_path):
    size = 24 * MB
    with serve(tmp_path, store_cls=SlowStore) as srv:
        peak, after, got = _traced_peak_during(lambda: upload(srv, size))
        status, _, body, sha = got  # type: ignore[misc]
        assert status == 200, body
        meta = json.loads(body)
        assert meta["bytes"] == size and meta["purpose"] == "batch" and meta["filename"] == "in.jsonl"
        on_disk = hashlib.sha256(srv.store.data_path(meta["id"]).read_bytes()).hexdigest()
        assert on_disk == sha
        assert srv.leftovers() == sorted([f"{meta['id']}.data", f"{meta['id']}.json"])
    # The client sends a MiB at a time into a disk slower than the socket: the
    # server stops reading while its writer lags, so what it holds is bounded.
    assert peak < 4 * MB, f"peak {peak / MB:.1f} MiB held during a {size // MB} MiB upload"
    assert after < 1 * MB


def test_the_request_body_is_released_when_the_response_starts(tmp_path):
    """A keep-alive connection (Envoy keeps them an hour) holds no body once answered."""
    size = 16 * MB
    with serve(tmp_path, max_body_bytes=32 * MB) as srv, srv.connect() as s:
        piece = b"x" * MB  # not JSON: a 400 from /v1/batches once the whole body is read

        def send() -> int:
            s.sendall(
                b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size
            )
            for _ in range(size // MB):
                s.sendall(piece)
            status, headers, _ = read_response(s)
            assert headers.get("connection", "keep-alive") != "close"
            return status

        peak, after, status = _traced_peak_during(send)
        assert status == 400
        assert peak >= size  # (a JSON body is parsed whole: it was held while it was read)
        assert after < 1 * MB, f"{after / MB:.1f} MiB still held after the response"
        s.sendall(b"GET /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n\r\n")
        assert read_response(s)[0] == 200  # the same connection serves on


def test_an_upload_over_the_limit_is_413_at_once_and_leaves_nothing(tmp_path):
    with serve(tmp_path, max_file_bytes=MB) as srv, srv.connect() as s:
        s.sendall(_head() + b"%x\r\n%b\r\n" % (len(_preamble()), _preamble()))
        piece = _chunk_of(64 * 1024)
        status = None
        try:
            for _ in range(64):  # up to 4 MiB, chunked: no length to refuse on
                s.sendall(b"%x\r\n%b\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = read_response(s)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        deadline = time.monotonic() + 5
        while srv.leftovers() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.leftovers() == []


def test_a_client_gone_after_its_whole_body_leaves_a_kept_file_counted_once(tmp_path):
    """As OpenAI: a create that succeeded server-side made the file, answer
    delivered or not; it counts against the tenant, so nothing is uncounted."""
    size = MB // 4
    pre = _preamble()
    with serve(tmp_path) as srv:
        with srv.connect() as s:
            s.sendall(_head(length=len(pre) + size + len(CLOSE)) + pre + _chunk_of(size) + CLOSE)
        deadline = time.monotonic() + 10
        while srv.store.index.usage("tenant-a") != (1, size, 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.store.index.usage("tenant-a") == (1, size, 0)  # kept, and counted (its hold: now the file)
        names = srv.leftovers()
        assert len([n for n in names if n.endswith(".json")]) == 1 and not [n for n in names if n.endswith(".tmp")]


@pytest.mark.parametrize("path", ["/v1/files/file-0123abcd", "/v1/files/file-0123abcd/content", "/v1/filesx"])
def test_only_the_upload_route_takes_an_upload_sized_body_others_are_413_at_the_request_limit(tmp_path, path):
    """Only POST /v1/files streams its body to disk; any other path under it
    (a file's id, a typo) gathers its body in memory, so it gets the request
    limit, not max_file_bytes -- before any key is checked."""
    with serve(tmp_path, max_file_bytes=64 * MB) as srv:
        with srv.connect() as s:
            s.settimeout(5)
            s.sendall(_head(key="nobody", length=32 * MB, path=path))  # announced, not sent
            status, _, body = read_response(s)
            assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        with srv.connect() as s:
            s.settimeout(5)
            s.sendall(_head(key="nobody", path=path))
            piece = _chunk_of(16 * 1024)
            try:
                for _ in range(64):  # 1 MiB, chunked: refused once past the 64 KiB request limit
                    s.sendall(b"%x\r\n%b\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):
                pass
            status, _, body = read_response(s)
            assert status == 413


def test_a_client_gone_mid_upload_leaves_nothing(tmp_path):
    with serve(tmp_path) as srv:
        with srv.connect() as s:
            s.sendall(_head(length=50 * MB) + _preamble() + _chunk_of(3 * MB))
            deadline = time.monotonic() + 5
            while not any(n.startswith(".upload-") for n in srv.leftovers()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert any(n.startswith(".upload-") for n in srv.leftovers())  # it was being written
        deadline = time.monotonic() + 5
        while srv.leftovers() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.leftovers() == []


@pytest.mark.parametrize(
    ("preamble", "message"),
    [
        (_preamble(purpose="fine-tune"), "purpose must be one of"),
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode(),
            "a `file` part is required",
        ),
    ],
)
def test_a_bad_upload_is_400_and_leaves_nothing(tmp_path, preamble, message):
    with serve(tmp_path) as srv, srv.connect() as s:
        body = preamble + (LINE * 3 if b'name="file"' in preamble else b"") + CLOSE
        s.sendall(_head(length=len(body)) + body)
        status, _, out = read_response(s)
        assert status == 400 and message in json.loads(out)["error"]["message"]
        assert srv.leftovers() == []


def test_a_truncated_body_is_400_and_leaves_nothing(tmp_path):
    with serve(tmp_path) as srv, srv.connect() as s:
        body = _preamble() + LINE * 10  # no closing boundary
        s.sendall(_head(length=len(body)) + body)
        status, _, out = read_response(s)
        assert status == 400 and "closing boundary" in json.loads(out)["error"]["message"]
        assert srv.leftovers() == []


def test_an_unknown_key_is_401_before_anything_is_written(tmp_path):
    with serve(tmp_path) as srv, srv.connect() as s:
        body = _preamble() + LINE * 1000 + CLOSE
        s.sendall(_head(key="sk-nope", length=len(body)) + body)
        status, _, out = read_response(s)
        assert status == 401 and json.loads(out)["error"]["code"] == "invalid_api_key"
        assert srv.leftovers() == []


# ------------------------------------------------------------ disk full


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs: a real filesystem that runs out of space (ENOSPC)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_an_upload_that_meets_a_full_disk_is_507_and_leaves_nothing(tiny_disk):
    with serve(tiny_disk) as srv:
        status, headers, body, _ = upload(srv, 3 * MB)
        assert status == 507, body
        err = json.loads(body)["error"]
        assert err["code"] == "insufficient_storage" and err["type"] == "server_error"
        assert int(headers["retry-after"]) >= 1
        assert srv.leftovers() == []
        assert srv.store.index.usage("tenant-a") == (0, 0, 0)  # the upload's room returned
        # The disk is free again: the next upload that fits is kept.
        status, _, body, sha = upload(srv, MB // 2)
        assert status == 200, body
        fid = json.loads(body)["id"]
        assert hashlib.sha256(srv.store.data_path(fid).read_bytes()).hexdigest() == sha
        assert srv.store.index.usage("tenant-a") == (1, MB // 2, 0)  # counted once, as the file


# ------------------------------------------------------------ downloads


def test_a_download_is_sent_in_chunks_as_the_client_reads(tmp_path):
    size = 24 * MB
    store = FileStore(tmp_path)
    w = store.stage()
    sha = hashlib.sha256()
    piece = _chunk_of(MB)
    for _ in range(size // MB):
        w.write(piece)
        sha.update(piece)
    w.seal()
    meta = store.commit(w, "tenant-a", "in.jsonl", "batch")
    with serve(tmp_path) as srv:

        def fetch(key: str) -> tuple[int, int, str]:
            with srv.connect() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
                s.sendall(
                    f"GET /v1/files/{meta.id}/content HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {key}\r\n\r\n".encode()
                )
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += s.recv(65536)
                head, rest = buf.split(b"\r\n\r\n", 1)
                status = int(head.split()[1])
                length = int(
                    next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
                )
                got = hashlib.sha256(rest)
                n = len(rest)
                while n < length:
                    data = s.recv(256 * 1024)
                    if not data:
                        break
                    got.update(data)
                    n += len(data)
                    if n < 8 * MB:
                        time.sleep(0.001)  # a slow reader at first: the server must wait for it
                return status, n, got.hexdigest()

        peak, _, (status, n, digest) = _traced_peak_during(lambda: fetch("sk-a"))  # type: ignore[misc]
        assert status == 200 and n == size and digest == sha.hexdigest()
        assert peak < 4 * MB, f"peak {peak / MB:.1f} MiB held during a {size // MB} MiB download"
        with srv.connect() as s:  # another tenant: as if absent
            s.sendall(
                f"GET /v1/files/{meta.id}/content HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-b\r\n\r\n".encode()
            )
            assert read_response(s)[0] == 404
