"""Per-tenant storage through the real /v1/files and /v1/batches handlers, in
process: the real BatchService and its stores over a temporary directory,
with a stand-in core (keys and config only: nothing is generated here).

Refusals name the limit; expires_after / output_expires_after are applied
and an expired file is gone; the reaper deletes; lists are paged and served
from the per-tenant index without reading the disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import router.services.batch.files as files_mod
from router.ingress.files_batches import batch_routes, owner_of_key
from router.ingress.routes import ErrorReply, Reply, Routes
from router.services.batch import rules as m
from router.services.batch.service import BatchService
from router.tenancy.identity import Keys
from shared.config import loads

KEY_A, KEY_A2, KEY_B = "sk-a", "sk-a-small", "sk-b"
CONFIG = f"""
[batch]
directory = "batches"
max_stored_files = 4
max_stored_file_bytes = 100000
max_active_batches = 5

[[api_keys]]
key = "{KEY_A}"
tenant = "a"

[[api_keys]]
key = "{KEY_A2}"
tenant = "a"
max_stored_files = 2

[[api_keys]]
key = "{KEY_B}"
tenant = "b"

[[tenants]]
name = "a"
max_stored_file_bytes = 300
max_active_batches = 1
"""


class Req:
    def __init__(self, method: str, path: str, key: str, body: bytes = b"", ctype: str | None = None) -> None:
        self.method = method.encode()
        p, _, q = path.partition("?")
        self.path, self.query, self.body = p.encode(), q.encode(), body
        self._headers = {b"authorization": f"Bearer {key}"}
        if ctype is not None:
            self._headers[b"content-type"] = ctype
        if body:
            self._headers[b"content-length"] = str(len(body))

    def header(self, name: bytes) -> str | None:
        return self._headers.get(name)


class Api:
    def __init__(self, svc: BatchService, routes: Routes) -> None:
        self.svc, self.routes = svc, routes

    def call(self, req: Req) -> tuple[int, dict[str, Any]]:
        body_route = self.routes.bodies.get(req.path) if req.method == b"POST" else None
        if body_route is not None:  # an upload: its body streams into the route's sink, as the server feeds it
            got = asyncio.get_event_loop().run_until_complete(self._stream(body_route, req))
            return self._answer(got)
        route = self.routes.exact.get(req.path)
        handler = (
            route.handler
            if route is not None
            else next(p.handler for p in self.routes.patterns if p.matches(req.path, req.method))
        )

        async def on_the_loop() -> Any:  # (as the server calls a handler)
            got = handler(req)  # type: ignore[arg-type]
            return got if isinstance(got, (Reply, ErrorReply)) else await got

        return self._answer(asyncio.get_event_loop().run_until_complete(on_the_loop()))

    @staticmethod
    async def _stream(body_route: Any, req: Req) -> Any:
        sink = body_route(req)
        if isinstance(sink, ErrorReply):
            return sink
        for i in range(0, len(req.body), 65536):
            sink.feed(req.body[i : i + 65536])
        return await sink.finish()

    @staticmethod
    def _answer(got: Any) -> tuple[int, dict[str, Any]]:
        if isinstance(got, ErrorReply):
            i = got.info
            return i.status, {"error": {"code": i.code, "param": i.param, "message": i.message, "retry": i.retry_after}}
        return got.status, json.loads(got.body)

    def upload(self, key: str, data: bytes, **fields: str) -> tuple[int, dict[str, Any]]:
        b = "XBOUNDARYX"
        parts = [f'--{b}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()]
        for name, value in fields.items():
            parts.append(f'--{b}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
        parts.append(
            f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n".encode()
            + data
            + f"\r\n--{b}--\r\n".encode()
        )
        return self.call(Req("POST", "/v1/files", key, b"".join(parts), f"multipart/form-data; boundary={b}"))

    def batch(self, key: str, file_id: str, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h", **extra}
        return self.call(Req("POST", "/v1/batches", key, json.dumps(body).encode()))


LINE = b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}\n'


@pytest.fixture
def root(tmp_path: Path, request: pytest.FixtureRequest):
    """The config's directory: ``tmp_path``, or (parametrized "tmpfs") a 1 MiB
    tmpfs, a real filesystem that fills up (ENOSPC)."""
    if getattr(request, "param", None) != "tmpfs":
        yield tmp_path
        return
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def api(root: Path):
    cfg = loads(CONFIG, str(root))
    core = types.SimpleNamespace(
        cfg=cfg,
        keys=Keys(cfg),
        metrics=types.SimpleNamespace(registry=CollectorRegistry()),
        batch_tenants=None,
        on_keys_reloaded=[],
    )
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    svc = BatchService(core, cfg)  # type: ignore[arg-type]
    loop.run_until_complete(svc.housekeep())  # the index built from the directory, as at start
    try:
        yield Api(svc, batch_routes(svc, owner_of_key(core), cfg.batch.max_file_bytes))
    finally:
        svc.io.shutdown()
        svc.housekeeping.shutdown()
        svc.pages.shutdown()
        loop.close()
        asyncio.set_event_loop(None)


def test_file_count_limit_per_tenant_and_per_key_refused_with_429_naming_it(api: Api):
    for _ in range(2):
        assert api.upload(KEY_A, LINE)[0] == 200
    status, body = api.upload(KEY_A2, LINE)  # this key's own limit: 2 files of its tenant
    assert status == 429 and body["error"]["code"] == "file_count_limit_exceeded"
    assert body["error"]["param"] == "max_stored_files" and body["error"]["retry"] > 0
    for _ in range(2):
        assert api.upload(KEY_A, LINE)[0] == 200  # the other key: the [batch] default, 4
    status, body = api.upload(KEY_A, LINE)
    assert status == 429 and "max_stored_files = 4" in body["error"]["message"]
    assert api.upload(KEY_B, LINE)[0] == 200  # another tenant is not affected
    seen = api.svc.tenants()  # /admin/tenants: what each stores against its tenant's limits
    assert seen["a"]["storage"]["files"] == 4 and seen["a"]["storage"]["limits"]["file_bytes"] == 300
    assert seen["b"]["storage"]["files"] == 1 and seen["b"]["storage"]["limits"]["files"] == 4
    _, listed = api.call(Req("GET", "/v1/files", KEY_A))
    victim = listed["data"][0]["id"]
    assert api.call(Req("DELETE", f"/v1/files/{victim}", KEY_A))[0] == 200
    assert api.upload(KEY_A, LINE)[0] == 200  # room again once one is deleted


def test_file_bytes_limit_of_the_tenant_refused_with_413_before_and_after_the_body_is_read(api: Api):
    assert api.upload(KEY_A, LINE * 3)[0] == 200  # 3 lines of 75 bytes: 225 of the tenant's 300
    status, body = api.upload(KEY_A, LINE * 2)
    assert status == 413 and body["error"]["code"] == "file_storage_limit_exceeded"
    assert body["error"]["param"] == "max_stored_file_bytes"
    assert api.upload(KEY_A, LINE)[0] == 200  # 300: exactly full
    assert api.upload(KEY_B, LINE * 100)[0] == 200  # tenant b: the [batch] default
    assert api.upload(KEY_A, b"x" * 100_000)[1]["error"]["code"] == "file_storage_limit_exceeded"  # (before parsing)


def test_active_batch_limit_refused_with_429_and_room_again_when_one_ends(api: Api):
    _, f = api.upload(KEY_A, LINE)
    status, first = api.batch(KEY_A, f["id"])
    assert status == 200
    status, body = api.batch(KEY_A, f["id"])
    assert status == 429 and body["error"]["code"] == "active_batch_limit_exceeded"
    assert body["error"]["param"] == "max_active_batches"
    rec = api.svc.store.load(first["id"])
    rec.move(m.FAILED)
    api.svc.store.save(rec)  # it ended
    assert api.batch(KEY_A, f["id"])[0] == 200


def test_expires_after_sets_expires_at_and_an_expired_file_is_404_then_reaped(api: Api, monkeypatch):
    status, f = api.upload(KEY_A, LINE, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"})
    assert status == 200 and f["expires_at"] == f["created_at"] + 3600
    status, body = api.upload(KEY_A, LINE, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"})
    assert status == 400 and body["error"]["param"] == "expires_after"
    assert api.call(Req("GET", f"/v1/files/{f['id']}", KEY_A))[1]["expires_at"] == f["expires_at"]
    later = time.time() + 3601
    monkeypatch.setattr(files_mod, "time", types.SimpleNamespace(time=lambda: later))
    assert api.call(Req("GET", f"/v1/files/{f['id']}", KEY_A))[0] == 404  # gone at expires_at
    assert api.call(Req("GET", f"/v1/files/{f['id']}/content", KEY_A))[0] == 404
    assert api.svc.files.data_path(f["id"]).exists()
    api.svc.index.reap(api.svc.files, api.svc.store, later, api.svc.bcfg.finished_retention_s)
    assert not api.svc.files.data_path(f["id"]).exists()
    assert api.call(Req("GET", "/v1/files", KEY_A))[1]["data"] == []


def test_output_expires_after_is_validated_and_kept_for_the_result_files(api: Api):
    _, f = api.upload(KEY_A, LINE)
    bad = api.batch(KEY_A, f["id"], output_expires_after={"anchor": "created_at", "seconds": 10})
    assert bad[0] == 400 and bad[1]["error"]["param"] == "output_expires_after"
    status, b = api.batch(KEY_A, f["id"], output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert status == 200
    rec = api.svc.store.load(b["id"])
    assert rec.output_expires_after_s == 7200
    # the result file, registered at the batch's end (router.services.batch.results), expires 7200 s after it is made
    api.svc.files.data_path(rec.output_file_id).write_bytes(b"{}\n")
    meta = api.svc.files.register("a", rec.output_file_id, "out.jsonl", "batch_output", rec.output_expires_after_s)
    assert meta.public()["expires_at"] == meta.created_at + 7200


def test_an_ended_batch_is_deleted_after_its_retention_and_is_404_then(api: Api):
    _, f = api.upload(KEY_A, LINE)
    _, b = api.batch(KEY_A, f["id"])
    rec = api.svc.store.load(b["id"])
    rec.move(m.CANCELLED)
    api.svc.store.save(rec)
    retention = api.svc.bcfg.finished_retention_s
    assert api.svc.index.reap(api.svc.files, api.svc.store, time.time() + retention - 60, retention) == []
    assert api.call(Req("GET", f"/v1/batches/{b['id']}", KEY_A))[0] == 200
    assert api.svc.index.reap(api.svc.files, api.svc.store, time.time() + retention + 1, retention) == [b["id"]]
    assert api.call(Req("GET", f"/v1/batches/{b['id']}", KEY_A))[0] == 404
    assert api.call(Req("GET", "/v1/batches", KEY_A))[1]["data"] == []
    assert not api.svc.store.path(b["id"]).exists()


def test_lists_are_paged_per_tenant_and_read_no_disk(api: Api, monkeypatch):
    ids = []
    for _ in range(4):
        ids.append(api.upload(KEY_A, LINE)[1]["id"])
        time.sleep(0.001)
    api.upload(KEY_B, LINE)
    rec = api.svc.store.load(api.batch(KEY_A, ids[0])[1]["id"])
    rec.move(m.FAILED)
    api.svc.store.save(rec)
    b2 = api.batch(KEY_A, ids[0])[1]["id"]

    def no_disk(*a: Any, **k: Any) -> Any:
        raise AssertionError("a list read the disk")

    monkeypatch.setattr(Path, "read_bytes", no_disk)
    monkeypatch.setattr(Path, "glob", no_disk)
    monkeypatch.setattr(os, "scandir", no_disk)
    monkeypatch.setattr(os, "listdir", no_disk)
    seen: list[str] = []
    after = ""
    while True:
        status, page = api.call(Req("GET", f"/v1/files?limit=3{after}", KEY_A))
        assert status == 200 and page["object"] == "list"
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        seen += [x["id"] for x in page["data"]]
        if not page["has_more"]:
            break
        after = f"&after={page['last_id']}"
    assert len(seen) == 4 and set(seen) == set(ids)  # newest first (ids made in the same second: by id then)
    status, page = api.call(Req("GET", "/v1/batches?limit=1", KEY_A))
    assert status == 200 and page["has_more"] and page["data"][0]["id"] == page["first_id"] == page["last_id"]
    status, rest = api.call(Req("GET", f"/v1/batches?limit=1&after={page['last_id']}", KEY_A))
    assert not rest["has_more"] and {page["first_id"], rest["first_id"]} >= {b2}
    assert api.call(Req("GET", "/v1/batches", KEY_B))[1]["data"] == []
    assert api.call(Req("GET", "/v1/files?limit=0", KEY_A))[0] == 400
    status, body = api.call(Req("GET", f"/v1/files?after={seen[0]}", KEY_B))
    assert status == 404 and body["error"]["param"] == "after"  # another tenant's cursor


def _body(data: bytes, key: str = KEY_A2, purpose: str = "batch") -> Req:
    b = "XBOUNDARYX"
    raw = (
        f'--{b}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
        f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'.encode()
        + data
        + f"\r\n--{b}--\r\n".encode()
    )
    return Req("POST", "/v1/files", key, raw, f"multipart/form-data; boundary={b}")


def _at_once(api: Api, reqs: list[Req]) -> list[int]:
    """Uploads of one tenant at once, as the server runs them: every head
    accepted (or refused), then every body fed, then all answered together."""

    async def run() -> list[int]:
        route = api.routes.bodies[b"/v1/files"]
        sinks = [route(r) for r in reqs]
        for sink, r in zip(sinks, reqs):
            if not isinstance(sink, ErrorReply):
                sink.feed(r.body)
        got = await asyncio.gather(*(s.finish() for s in sinks if not isinstance(s, ErrorReply)))
        return [s.info.status for s in sinks if isinstance(s, ErrorReply)] + [Api._answer(a)[0] for a in got]

    return asyncio.get_event_loop().run_until_complete(run())


def _stored(api: Api) -> list[str]:
    return [n for n in os.listdir(api.svc.files.dir) if n.endswith(".data")]


def test_uploads_of_one_tenant_at_once_cannot_pass_its_limits_together(api: Api):
    # KEY_A2 may keep 2 files: of 3 uploads at once, 2 are kept and one refused
    statuses = _at_once(api, [_body(LINE) for _ in range(3)])
    assert sorted(statuses) == [200, 200, 429]
    assert len(_stored(api)) == 2 and api.svc.index.usage("a").files == 2
    # tenant a may keep 300 bytes: of 3 uploads of 150 bytes each (a key of 4 files), 2 fit
    for f in _stored(api):
        api.call(Req("DELETE", f"/v1/files/{f.removesuffix('.data')}", KEY_A))
    statuses = _at_once(api, [_body(LINE * 2, KEY_A) for _ in range(3)])
    assert sorted(statuses) == [200, 200, 413]
    assert api.svc.index.usage("a") == (2, 300, 0)


def test_an_upload_that_ends_without_a_file_returns_its_room_exactly_once(api: Api):
    route = api.routes.bodies[b"/v1/files"]

    async def run() -> None:
        gone = route(_body(LINE))  # the client leaves mid-body
        assert api.svc.index.usage("a").files == 1  # held while it is written
        gone.feed(_body(LINE).body[:40])
        gone.abort()
        gone.abort()
        bad = _body(LINE, purpose="other")
        refused = route(bad)
        refused.feed(bad.body)
        assert (await refused.finish()).info.status == 400  # another purpose

    asyncio.get_event_loop().run_until_complete(run())
    assert api.svc.index.usage("a") == (0, 0, 0) and _stored(api) == []
    # the room came back once: the key's 2 files can still be kept, not more
    assert sorted(_at_once(api, [_body(LINE) for _ in range(3)])) == [200, 200, 429]


@pytest.mark.parametrize("root", ["tmpfs"], indirect=True)
def test_a_batch_created_on_a_full_disk_is_507_and_leaves_nothing(api: Api, root: Path):
    _, f = api.upload(KEY_A, LINE)
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass  # full
    finally:
        os.close(fd)
    status, body = api.batch(KEY_A, f["id"])
    assert status == 507 and body["error"]["code"] == "insufficient_storage" and body["error"]["retry"] > 0
    assert os.listdir(api.svc.store.dir) == [] and api.svc.index.usage("a").active_batches == 0
    filler.unlink()
    assert api.batch(KEY_A, f["id"])[0] == 200  # room again


def test_a_tenants_item_calls_read_and_write_the_disk_off_the_event_loop(api: Api, monkeypatch):
    """Retrieve, download, delete and cancel read metas and state files, and
    write (fsync) cancels, on a thread: on a slow or shared (NFS) directory one
    tenant's calls must not stall the loop every other tenant's streams run on."""
    _, f = api.upload(KEY_A, LINE)
    _, other = api.upload(KEY_A, LINE)
    _, b = api.batch(KEY_A, f["id"])
    loop_thread = threading.get_ident()  # (the test's loop runs in this thread)
    on_loop: list[str] = []

    def watch(name: str, real: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if threading.get_ident() == loop_thread:
                on_loop.append(name)
            return real(*a, **k)

        return call

    monkeypatch.setattr(Path, "read_bytes", watch("read", Path.read_bytes))
    monkeypatch.setattr(Path, "unlink", watch("unlink", Path.unlink))
    monkeypatch.setattr(os, "fsync", watch("fsync", os.fsync))
    assert api.call(Req("GET", f"/v1/files/{f['id']}", KEY_A))[0] == 200
    assert api.call(Req("GET", f"/v1/files/{f['id']}", KEY_B))[0] == 404
    assert api.call(Req("GET", f"/v1/batches/{b['id']}", KEY_A))[0] == 200
    assert api.call(Req("GET", f"/v1/batches/{b['id']}", KEY_B))[0] == 404
    assert api.call(Req("POST", f"/v1/batches/{b['id']}/cancel", KEY_B))[0] == 404
    status, cancelled = api.call(Req("POST", f"/v1/batches/{b['id']}/cancel", KEY_A))
    assert status == 200 and cancelled["status"] == "cancelling"
    assert api.svc.store.cancel_requested(b["id"])
    assert api.call(Req("DELETE", f"/v1/files/{other['id']}", KEY_B))[0] == 404
    assert api.call(Req("DELETE", f"/v1/files/{other['id']}", KEY_A))[0] == 200
    assert on_loop == []
