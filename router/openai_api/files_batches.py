"""``/v1/files`` and ``/v1/batches``: OpenAI's Batch API over router.batch.

Files: upload (multipart, ``purpose=batch``, at most ``[batch]
max_file_bytes``), list, retrieve, ``/content``, delete.  Batches: create
(``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
retrieve, list, cancel.  Objects and statuses are OpenAI's.  Everything is
the caller's tenant's: another tenant's file or batch is 404, as if absent.
Handlers are plain functions from a request to its answer, entries of the
router's route table (router.http_routes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from python_multipart.multipart import MultipartParser, parse_options_header

from router.batch import model as bm
from router.batch.files import OUTPUT_PURPOSES, UPLOAD_PURPOSES
from router.batch.service import BatchService
from router.batch.validate import PARSERS
from router.http_routes import Answer, PatternRoute, Refusal, Reply, Route, Routes
from router.openai_api.encoding import encode
from router.openai_api.request import meta_from_headers
from shared.errors import Code, error
from shared.protocol import ErrorInfo

# api key (or None) -> (tenant, key digest), or the refusal (401)
Owner = Callable[[str | None], "tuple[str, str] | ErrorInfo"]


class Request(Protocol):
    @property
    def method(self) -> bytes: ...

    @property
    def path(self) -> bytes: ...

    @property
    def body(self) -> bytes: ...

    def header(self, name: bytes) -> str | None: ...


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted, not applied: files stay until deleted


_create_decoder = msgspec.json.Decoder(CreateBatch)


def _json(status: int, obj: object) -> Reply:
    return Reply(status, encode(obj))


def _bad(message: str, param: str | None = None, code: Code = Code.BAD_REQUEST) -> Refusal:
    return Refusal(error(code, message, param=param))


def _not_found(what: str, name: str) -> Refusal:
    return Refusal(error(Code.NOT_FOUND, f"No such {what}: {name!r}", param=f"{what}_id"))


def parse_multipart(content_type: str | None, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """Form fields by name -> (filename or None, bytes); ValueError if it is not multipart."""
    ctype, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise ValueError("the body must be multipart/form-data with a boundary")
    parts: dict[str, tuple[str | None, bytes]] = {}
    state: dict[str, Any] = {"field": b"", "value": b"", "headers": {}, "data": []}

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["field"].lower()] = state["value"]
        state["field"], state["value"] = b"", b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        state["data"].append(data[start:end])

    def on_part_end() -> None:
        _, disp = parse_options_header(state["headers"].get(b"content-disposition", b""))
        name = disp.get(b"name")
        if name is not None:
            filename = disp.get(b"filename")
            parts[name.decode("utf-8", "replace")] = (
                None if filename is None else filename.decode("utf-8", "replace"),
                b"".join(state["data"]),
            )
        state["headers"], state["data"] = {}, []

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    parser.write(body)
    parser.finalize()
    return parts


def batch_routes(svc: BatchService, owner_of: Owner, max_file_bytes: int) -> Routes:
    def who(req: Request) -> tuple[str, str] | Refusal:
        meta = meta_from_headers(req.header(b"authorization"), req.header(b"x-api-key"))
        got = owner_of(meta.api_key)
        return Refusal(got) if isinstance(got, ErrorInfo) else got

    # ------------------------------------------------------------ files

    def files(req: Any) -> Answer:
        owner = who(req)
        if isinstance(owner, Refusal):
            return owner
        if req.method == b"GET":
            return _json(
                200, {"object": "list", "data": [f.public() for f in svc.files.list(owner[0])], "has_more": False}
            )
        if req.method != b"POST":
            return Refusal(error(Code.METHOD_NOT_ALLOWED, "use GET or POST"), b"allow: GET, POST\r\n")
        if len(req.body) > max_file_bytes:
            return Refusal(
                error(Code.REQUEST_TOO_LARGE, f"The file exceeds the limit of {max_file_bytes} bytes", param="file")
            )
        try:
            parts = parse_multipart(req.header(b"content-type"), req.body)
        except Exception as e:  # python_multipart raises its own errors on malformed input
            return _bad(f"Malformed upload: {e}", "file")
        purpose = parts.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
        if purpose not in UPLOAD_PURPOSES:
            return _bad(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}", "purpose")
        upload = parts.get("file")
        if upload is None:
            return _bad("a `file` part is required", "file")
        filename, data = upload
        if len(data) > max_file_bytes:
            return Refusal(
                error(Code.REQUEST_TOO_LARGE, f"The file exceeds the limit of {max_file_bytes} bytes", param="file")
            )
        if not data.strip():
            return _bad("The file is empty.", "file")
        meta = svc.files.create(owner[0], filename or "upload.jsonl", purpose, data)
        return _json(200, meta.public())

    def file_item(req: Any) -> Answer:
        owner = who(req)
        if isinstance(owner, Refusal):
            return owner
        fid = req.path[len(b"/v1/files/") :].decode("utf-8", "replace")
        if req.method == b"GET":
            meta = svc.files.get(owner[0], fid)
            return _not_found("file", fid) if meta is None else _json(200, meta.public())
        if req.method == b"DELETE":
            if not svc.files.delete(owner[0], fid):
                return _not_found("file", fid)
            return _json(200, {"id": fid, "object": "file", "deleted": True})
        return Refusal(error(Code.METHOD_NOT_ALLOWED, "use GET or DELETE"), b"allow: GET, DELETE\r\n")

    def file_content(req: Any) -> Answer:
        owner = who(req)
        if isinstance(owner, Refusal):
            return owner
        fid = req.path[len(b"/v1/files/") : -len(b"/content")].decode("utf-8", "replace")
        meta = svc.files.get(owner[0], fid)
        if meta is None:
            return _not_found("file", fid)
        try:
            data = svc.files.data_path(fid).read_bytes()
        except OSError:
            return _not_found("file", fid)
        ctype = (
            b"application/jsonl"
            if meta.purpose in (*UPLOAD_PURPOSES, *OUTPUT_PURPOSES)
            else b"application/octet-stream"
        )
        return Reply(200, data, ctype)

    # ------------------------------------------------------------ batches

    def batches(req: Any) -> Answer:
        owner = who(req)
        if isinstance(owner, Refusal):
            return owner
        if req.method == b"GET":
            rows = [r.public() for r in svc.list(owner[0])]
            return _json(
                200,
                {
                    "object": "list",
                    "data": rows,
                    "first_id": rows[0]["id"] if rows else None,
                    "last_id": rows[-1]["id"] if rows else None,
                    "has_more": False,
                },
            )
        if req.method != b"POST":
            return Refusal(error(Code.METHOD_NOT_ALLOWED, "use GET or POST"), b"allow: GET, POST\r\n")
        try:
            body = _create_decoder.decode(req.body)
        except msgspec.ValidationError as e:
            return _bad(f"Invalid request: {e}")
        except msgspec.DecodeError:
            return _bad("The body is not valid JSON.")
        if body.endpoint not in bm.ENDPOINTS:
            return _bad(f"endpoint must be one of {', '.join(bm.ENDPOINTS)}", "endpoint")
        if body.endpoint not in PARSERS:
            return _bad(
                f"The endpoint {body.endpoint} is not served by this router.", "endpoint", Code.UNSUPPORTED_VALUE
            )
        if body.completion_window not in svc.windows:
            return _bad(f"completion_window must be one of {', '.join(svc.windows)}", "completion_window")
        meta = svc.files.get(owner[0], body.input_file_id)
        if meta is None:
            return _not_found("input_file", body.input_file_id)
        if meta.purpose != "batch":
            return _bad("The input file's purpose must be batch.", "input_file_id")
        rec = svc.create(owner[0], owner[1], meta.id, body.endpoint, body.completion_window, body.metadata)
        svc.kick()
        return _json(200, rec.public())

    def batch_item(req: Any) -> Answer:
        owner = who(req)
        if isinstance(owner, Refusal):
            return owner
        bid = req.path[len(b"/v1/batches/") :].decode("utf-8", "replace")
        rec = svc.get(owner[0], bid)
        return _not_found("batch", bid) if rec is None else _json(200, rec.public())

    def batch_cancel(req: Any) -> Answer:
        owner = who(req)
        if isinstance(owner, Refusal):
            return owner
        bid = req.path[len(b"/v1/batches/") : -len(b"/cancel")].decode("utf-8", "replace")
        rec = svc.get(owner[0], bid)
        if rec is None:
            return _not_found("batch", bid)
        if rec.status in bm.TERMINAL or rec.status in (bm.FINALIZING,):
            return _bad(f"Cannot cancel a batch whose status is {rec.status}.", "batch_id")
        return _json(200, svc.cancel(rec).public())

    exact = {b"/v1/files": Route(b"*", files), b"/v1/batches": Route(b"*", batches)}
    patterns = [
        PatternRoute(b"/v1/files/", (b"/content",), b"GET", "/v1/files/{id}/content", file_content),
        PatternRoute(b"/v1/files/", (), b"*", "/v1/files/{id}", file_item),
        PatternRoute(b"/v1/batches/", (b"/cancel",), b"POST", "/v1/batches/{id}/cancel", batch_cancel),
        PatternRoute(b"/v1/batches/", (), b"GET", "/v1/batches/{id}", batch_item),
    ]
    return Routes(exact, patterns)


def owner_of_key(core: Any) -> Owner:
    """The caller's tenant and key digest, from the router's keys as reloaded
    (``core.keys``: router.admission.Keys); no keys: everyone is the anonymous tenant."""
    from router.admission import ANONYMOUS_TENANT, malformed_key
    from shared.keys import digest, well_formed

    def owner(api_key: str | None) -> tuple[str, str] | ErrorInfo:
        keys = core.keys
        if api_key and not well_formed(api_key):  # the rule Envoy applies (shared.keys)
            return malformed_key()
        if not keys.by_key:
            return ANONYMOUS_TENANT, ""
        h = digest(api_key) if api_key else ""
        key = keys.by_key.get(h)
        if key is None:
            return error(Code.INVALID_API_KEY, "Incorrect API key provided.")
        return key.tenant, h

    return owner
