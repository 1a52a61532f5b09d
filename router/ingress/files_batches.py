"""``/v1/files`` and ``/v1/batches``: OpenAI's Batch API over router.services.batch.

Files: upload (multipart, ``purpose=batch``, at most ``[batch]
max_file_bytes``), list, retrieve, ``/content``, delete.  Batches: create
(``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
retrieve, list, cancel.  Objects and statuses are OpenAI's.  Everything is
the caller's tenant's: another tenant's file or batch is 404, as if absent.
Handlers are plain functions from a request to its answer, entries of the
router's route table (router.ingress.routes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import IO, Any
from urllib.parse import parse_qs

import msgspec

from router.api.encoding import encode
from router.api.metadata import metadata_problem
from router.api.request import meta_from_headers
from router.ingress.connection import Request
from router.ingress.file_upload import MultipartToFile, Received, Upload, boundary_of
from router.ingress.routes import Answer, BodyRoute, BodySink, ErrorReply, PatternRoute, Reply, Route, Routes, Stream
from router.services.batch import rules as bm
from router.services.batch import storage
from router.services.batch.files import OUTPUT_PURPOSES, UPLOAD_PURPOSES, FileStore, StorageReservation
from router.services.batch.retention import expires_after_seconds
from router.services.batch.service import BatchService
from router.services.batch.store import BatchRecord
from router.services.batch.validate import LINE_PARSERS
from router.tenancy.ownership import may_see
from shared.errors import Code, error
from shared.protocol import ErrorInfo

log = logging.getLogger("weir.batch")

# api key (or None) -> (tenant, key digest), or the refusal (401)
Owner = Callable[[str | None], "tuple[str, str] | ErrorInfo"]

CHUNK = 256 << 10  # a download is read and sent this much at a time
FILE_THREADS = 4  # uploads' parse + write + fsync and downloads' reads (never the event loop)
STORAGE_FULL_RETRY_S = 30.0


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # the result files' expires_at (router.services.batch.retention)


_create_decoder = msgspec.json.Decoder(CreateBatch)


def _json(status: int, obj: object) -> Reply:
    return Reply(status, encode(obj))


def _bad(message: str, param: str | None = None, code: Code = Code.BAD_REQUEST) -> ErrorReply:
    return ErrorReply(error(code, message, param=param))


def _not_found(what: str, name: str) -> ErrorReply:
    return ErrorReply(error(Code.NOT_FOUND, f"No such {what}: {name!r}", param=f"{what}_id"))


# GET /v1/files and /v1/batches: OpenAI's bounds and defaults of ``limit``
FILES_LIMIT = (10_000, 10_000)
BATCHES_LIMIT = (100, 20)


class PageQuery(msgspec.Struct):
    after: str | None
    limit: int
    purpose: str | None


def page_query(query: bytes, bounds: tuple[int, int]) -> PageQuery | ErrorReply:
    """``after``, ``limit`` (1..bounds[0], default bounds[1]) and ``purpose`` of a list's query string."""
    try:
        qs = parse_qs(query.decode("utf-8"), strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        return _bad("The query string is malformed.")
    raw = qs.get("limit", [str(bounds[1])])[-1]
    if not raw.isdigit() or not 1 <= int(raw) <= bounds[0]:
        return _bad(f"limit must be an integer from 1 to {bounds[0]}; got {raw!r}", "limit")
    order = qs.get("order", ["desc"])[-1]
    if order != "desc":
        return _bad("Only order=desc (newest first) is supported.", "order", Code.UNSUPPORTED_VALUE)
    return PageQuery(qs.get("after", [None])[-1], int(raw), qs.get("purpose", [None])[-1])


def _page(rows: list[dict[str, Any]], limit: int) -> Reply:
    """OpenAI's list object: ``rows`` holds one more than ``limit`` when there are more."""
    more = len(rows) > limit
    rows = rows[:limit]
    return _json(
        200,
        {
            "object": "list",
            "data": rows,
            "first_id": rows[0]["id"] if rows else None,
            "last_id": rows[-1]["id"] if rows else None,
            "has_more": more,
        },
    )


def _storage_full(e: OSError, what: str = "file") -> ErrorReply:
    log.error("a %s could not be written: %s", what, e)
    return ErrorReply(
        error(
            Code.STORAGE_FULL,
            f"The {what} could not be stored: the server's storage is full. Nothing was kept; try again later.",
            param=what if what == "file" else None,
            retry_after=STORAGE_FULL_RETRY_S,
        )
    )


async def _chunks(
    loop: asyncio.AbstractEventLoop, pool: concurrent.futures.Executor, f: IO[bytes], size: int
) -> AsyncGenerator[bytes, None]:
    """``size`` bytes of ``f``, read a chunk at a time on the file pool; the file closes however it ends."""
    try:
        left = size
        while left > 0:
            chunk = await loop.run_in_executor(pool, f.read, min(CHUNK, left))
            if not chunk:
                return  # (shorter than it was: the server drops the connection)
            left -= len(chunk)
            yield chunk
    finally:
        f.close()


def batch_routes(svc: BatchService, owner_of: Owner, max_file_bytes: int) -> Routes:
    files_store: FileStore = svc.files
    pool = concurrent.futures.ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="file-io")

    def who(req: Request) -> tuple[str, str] | ErrorReply:
        meta = meta_from_headers(req.header(b"authorization"), req.header(b"x-api-key"))
        got = owner_of(meta.api_key)
        return ErrorReply(got) if isinstance(got, ErrorInfo) else got

    def listed(page: Callable[[], Answer]) -> Awaitable[Answer]:
        """A list page, made and encoded on a thread (a page may hold 10,000 objects)."""

        async def later() -> Answer:
            await svc.indexed.wait()
            answer: Answer = await svc.off_loop(page)
            return answer

        return later()

    # ------------------------------------------------------------ files

    def files(req: Any) -> Answer | Awaitable[Answer]:
        owner = who(req)
        if isinstance(owner, ErrorReply):
            return owner
        if req.method == b"GET":
            return listed(lambda: list_files(req, owner))
        return ErrorReply(error(Code.METHOD_NOT_ALLOWED, "use GET or POST"), b"allow: GET, POST\r\n")

    def list_files(req: Any, owner: tuple[str, str]) -> Answer:
        q = page_query(req.query, FILES_LIMIT)
        if isinstance(q, ErrorReply):
            return q
        rows = svc.index.files_page(owner[0], q.after, q.limit, q.purpose)
        if rows is None:
            return ErrorReply(error(Code.NOT_FOUND, f"No such file: {q.after!r}", param="after"))
        return _page([f.public() for f in rows], q.limit)

    def upload(req: Any) -> BodySink | ErrorReply:
        """POST /v1/files, from its head: the body streams into the returned
        Upload (router.ingress.file_upload) as it arrives; ``uploaded`` answers."""
        owner = who(req)
        if isinstance(owner, ErrorReply):
            return owner
        boundary = boundary_of(req.header(b"content-type"))
        if boundary is None:
            return _bad("Malformed upload: the body must be multipart/form-data with a boundary", "file")
        length = (req.header(b"content-length") or "").strip()
        declared = max(1, int(length) - storage.FRAMING_BYTES) if length.isdigit() else 0
        body = MultipartToFile(files_store, boundary, max_file_bytes)
        # Room taken now, before anything is written, so uploads of one tenant at
        # once each count the others' (before the index is built: checked at the end).
        held = svc.index.reserve(owner[0], svc.limits(*owner) if svc.indexed.is_set() else None, declared)
        if isinstance(held, ErrorInfo):
            body.discard()
            return ErrorReply(held)  # (the body is read and dropped, then this answered)
        return Upload(pool, body, lambda got: uploaded(owner, held, got), lambda: svc.index.release(held))

    async def uploaded(owner: tuple[str, str], held: StorageReservation, got: Received | ErrorInfo | OSError) -> Answer:
        """The whole body was read and written (or refused): keep the file in
        place of its hold, or leave nothing and release the hold."""
        try:
            return await keep(owner, held, got)
        finally:
            svc.index.release(held)  # (nothing if the file took its place)

    async def keep(owner: tuple[str, str], held: StorageReservation, got: Received | ErrorInfo | OSError) -> Answer:
        if isinstance(got, OSError):
            return _storage_full(got)
        if isinstance(got, ErrorInfo):
            return ErrorReply(got)
        refusal: ErrorReply | None = None
        purpose = got.fields.get("purpose", "").strip()
        expires_s = None
        if purpose not in UPLOAD_PURPOSES:
            refusal = _bad(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}", "purpose")
        elif got.file is None:
            refusal = _bad("a `file` part is required", "file")
        elif got.blank:
            refusal = _bad("The file is empty.", "file")
        elif "expires_after[anchor]" in got.fields or "expires_after[seconds]" in got.fields:
            expiry = expires_after_seconds(
                got.fields.get("expires_after[anchor]", ""), got.fields.get("expires_after[seconds]", "")
            )
            if isinstance(expiry, str):
                refusal = _bad(f"expires_after: {expiry}", "expires_after")
            else:
                expires_s = expiry
        if refusal is None and got.file is not None:  # the size known, before the file is kept
            await svc.indexed.wait()
            refused = svc.index.settle(held, svc.limits(*owner), got.file.size)
            refusal = None if refused is None else ErrorReply(refused)
        loop = asyncio.get_running_loop()
        if refusal is not None or got.file is None:
            if got.file is not None:
                await loop.run_in_executor(pool, got.file.discard)
            return refusal or _bad("a `file` part is required", "file")
        try:
            meta = await loop.run_in_executor(
                pool, files_store.commit, got.file, owner[0], got.filename or "upload.jsonl", purpose, expires_s, held
            )
        except OSError as e:
            return _storage_full(e)
        return _json(200, meta.public())

    def file_item(req: Any) -> Answer | Awaitable[Answer]:
        """GET / DELETE /v1/files/{id}: the meta read (and the delete) on the API thread."""
        owner = who(req)
        if isinstance(owner, ErrorReply):
            return owner
        fid = req.path[len(b"/v1/files/") :].decode("utf-8", "replace")
        if req.method == b"GET":

            def retrieve() -> Answer:
                meta = svc.files.get(owner[0], fid)
                return _not_found("file", fid) if meta is None else _json(200, meta.public())

            return svc.off_loop(retrieve)
        if req.method == b"DELETE":

            def delete() -> Answer:
                if not svc.files.delete(owner[0], fid):
                    return _not_found("file", fid)
                return _json(200, {"id": fid, "object": "file", "deleted": True})

            return svc.off_loop(delete)
        return ErrorReply(error(Code.METHOD_NOT_ALLOWED, "use GET or DELETE"), b"allow: GET, DELETE\r\n")

    def file_content(req: Any) -> Answer | Awaitable[Answer]:
        owner = who(req)
        if isinstance(owner, ErrorReply):
            return owner
        fid = req.path[len(b"/v1/files/") : -len(b"/content")].decode("utf-8", "replace")

        async def content() -> Answer:
            meta = await svc.off_loop(lambda: svc.files.get(owner[0], fid))
            if meta is None:
                return _not_found("file", fid)
            ctype = (
                b"application/jsonl"
                if meta.purpose in (*UPLOAD_PURPOSES, *OUTPUT_PURPOSES)
                else b"application/octet-stream"
            )
            return await download(fid, ctype)

        return content()

    async def download(fid: str, ctype: bytes) -> Answer:
        """The file's bytes in chunks, each read on the file pool as the socket takes the last."""
        loop = asyncio.get_running_loop()
        try:
            f, size = await loop.run_in_executor(pool, files_store.open_data, fid)
        except OSError:
            return _not_found("file", fid)
        return Stream(200, size, _chunks(loop, pool, f, size), ctype)

    # ------------------------------------------------------------ batches

    def batches(req: Any) -> Answer | Awaitable[Answer]:
        owner = who(req)
        if isinstance(owner, ErrorReply):
            return owner
        if req.method == b"GET":
            return listed(lambda: list_batches(req, owner))
        if req.method != b"POST":
            return ErrorReply(error(Code.METHOD_NOT_ALLOWED, "use GET or POST"), b"allow: GET, POST\r\n")
        return create_batch(req, owner)

    def list_batches(req: Any, owner: tuple[str, str]) -> Answer:
        q = page_query(req.query, BATCHES_LIMIT)
        if isinstance(q, ErrorReply):
            return q
        rows = svc.list(owner[0], q.after, q.limit)
        if rows is None:
            return ErrorReply(error(Code.NOT_FOUND, f"No such batch: {q.after!r}", param="after"))
        return _page([r.public() for r in rows], q.limit)

    def create_batch(req: Any, owner: tuple[str, str]) -> Answer | Awaitable[Answer]:
        """The body is checked here; the input file, the tenant's room and the
        new state are read and written on the API thread, one create at a
        time (so the active-batch count of creates at once is exact)."""
        try:
            body = _create_decoder.decode(req.body)
        except msgspec.ValidationError as e:
            return _bad(f"Invalid request: {e}")
        except msgspec.DecodeError:
            return _bad("The body is not valid JSON.")
        if body.endpoint not in bm.ENDPOINTS:
            return _bad(f"endpoint must be one of {', '.join(bm.ENDPOINTS)}", "endpoint")
        if body.endpoint not in LINE_PARSERS:
            return _bad(
                f"The endpoint {body.endpoint} is not served by this router.", "endpoint", Code.UNSUPPORTED_VALUE
            )
        bad_metadata = metadata_problem(body.metadata)
        if bad_metadata is not None:
            return _bad(bad_metadata, "metadata")
        if body.completion_window not in svc.windows:
            return _bad(f"completion_window must be one of {', '.join(svc.windows)}", "completion_window")
        out_expires_s = None
        if body.output_expires_after is not None:
            got = expires_after_seconds(
                body.output_expires_after.get("anchor"), body.output_expires_after.get("seconds")
            )
            if isinstance(got, str):
                return _bad(f"output_expires_after: {got}", "output_expires_after")
            out_expires_s = got

        def make() -> Answer:  # (the API thread)
            meta = svc.files.get(owner[0], body.input_file_id)
            if meta is None:
                return _not_found("input_file", body.input_file_id)
            if meta.purpose != "batch":
                return _bad("The input file's purpose must be batch.", "input_file_id")
            refused = storage.batch_refusal(svc.index.usage(owner[0]), svc.limits(*owner))
            if refused is not None:
                return ErrorReply(refused)
            try:
                rec = svc.create(
                    owner[0], owner[1], meta.id, body.endpoint, body.completion_window, body.metadata, out_expires_s
                )
            except OSError as e:
                return _storage_full(e, "batch")
            return _json(200, rec.public())

        async def created() -> Answer:
            await svc.indexed.wait()
            answer: Answer = await svc.off_loop(make)
            if isinstance(answer, Reply):
                svc.kick()
            return answer

        return created()

    def lookup(owner: tuple[str, str], bid: str) -> BatchRecord | None | Awaitable[BatchRecord | None]:
        """The tenant's batch: as it runs here (memory), else its state file read on the API thread."""
        run = svc.runs.get(bid)
        if run is not None:
            return run.rec if may_see(run.rec.owner, owner[0]) else None
        return svc.off_loop(lambda: svc.visible(owner[0], bid))

    def batch_item(req: Any) -> Answer | Awaitable[Answer]:
        owner = who(req)
        if isinstance(owner, ErrorReply):
            return owner
        bid = req.path[len(b"/v1/batches/") :].decode("utf-8", "replace")

        def shown(rec: BatchRecord | None) -> Answer:
            return _not_found("batch", bid) if rec is None else _json(200, rec.public())

        got = lookup(owner, bid)
        if got is None or isinstance(got, BatchRecord):
            return shown(got)

        async def later(pending: Awaitable[BatchRecord | None]) -> Answer:
            return shown(await pending)

        return later(got)

    def batch_cancel(req: Any) -> Answer | Awaitable[Answer]:
        owner = who(req)
        if isinstance(owner, ErrorReply):
            return owner
        bid = req.path[len(b"/v1/batches/") : -len(b"/cancel")].decode("utf-8", "replace")

        async def cancel() -> Answer:
            got = lookup(owner, bid)
            rec = got if got is None or isinstance(got, BatchRecord) else await got
            if rec is None:
                return _not_found("batch", bid)
            if rec.status in bm.TERMINAL or rec.status in (bm.FINALIZING,):
                return _bad(f"Cannot cancel a batch whose status is {rec.status}.", "batch_id")
            try:
                return _json(200, (await svc.cancel(rec)).public())
            except OSError as e:
                return _storage_full(e, "cancel")

        return cancel()

    exact = {b"/v1/files": Route(b"*", files), b"/v1/batches": Route(b"*", batches)}
    bodies: dict[bytes, BodyRoute] = {b"/v1/files": upload}
    patterns = [
        PatternRoute(b"/v1/files/", (b"/content",), b"GET", "/v1/files/{id}/content", file_content),
        PatternRoute(b"/v1/files/", (), b"*", "/v1/files/{id}", file_item),
        PatternRoute(b"/v1/batches/", (b"/cancel",), b"POST", "/v1/batches/{id}/cancel", batch_cancel),
        PatternRoute(b"/v1/batches/", (), b"GET", "/v1/batches/{id}", batch_item),
    ]
    return Routes(exact, patterns, bodies)


def owner_of_key(core: Any) -> Owner:
    """The caller's tenant and key digest, from the router's keys as reloaded
    (``core.keys``: router.tenancy.identity.Keys), by router.tenancy.ownership's rule."""
    from router.tenancy.ownership import caller_of

    def owner(api_key: str | None) -> tuple[str, str] | ErrorInfo:
        got = caller_of(core.keys.by_key, api_key)
        return got if isinstance(got, ErrorInfo) else (got.tenant, got.key)

    return owner
