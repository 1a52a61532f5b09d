"""What a batch's input must be: the file as a whole, and each line as a live request.

The file is checked once, streaming, before the batch runs (``check_file``):
every non-blank line a JSON object with a string ``custom_id``, no
``custom_id`` twice.  A file that fails this fails the batch (OpenAI's
``validating -> failed``, each problem named with its line).  Memory: 8 bytes
a line (a hash of its custom_id), whatever the lines hold.

Each line is then checked when it is sent, as a live request is
(``to_submit``): its ``url`` must be the batch's endpoint, its body within
the router's body limit, and the body is parsed by the endpoint's own parser
(router.api), so a bad field is the same 400 a live client gets --
written to the error file, keyed by its custom_id.  A line may stand for
several jobs, as the live request would: an embeddings line one per input,
a completions line one per prompt of a prompt list (``LineJobs``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import msgspec

from router import api
from router.api.prompt_forms import DEFAULT_MAX_PROMPTS
from router.services.batch.store import BatchError
from shared.errors import Code, error
from shared.protocol import Submit

MAX_FILE_ERRORS = 100  # problems named in a failed batch's ``errors`` (the rest are counted)


class LineJobs(NamedTuple):
    """A line as the jobs its live request would run, and how its response is rendered."""

    subs: list[Submit]
    ctx: api.ResponseContext | api.EmbeddingContext
    n: int  # completions: choices per prompt (router.lifecycle.fanout numbers them)
    echoes: list[str | None]  # completions with echo: each prompt's text (None: token ids); else []


def _chat(body: bytes, meta: api.RequestMeta, rid: str, max_prompts: int) -> LineJobs:
    sub, ctx = api.parse_chat(body, meta, rid)
    return LineJobs([sub], ctx, 1, [])


def _completions(body: bytes, meta: api.RequestMeta, rid: str, max_prompts: int) -> LineJobs:
    jobs = api.parse_completions(body, meta, rid, max_prompts)
    return LineJobs(jobs.subs, jobs.ctx, jobs.n, jobs.echoes)


def _embeddings(body: bytes, meta: api.RequestMeta, rid: str, max_prompts: int) -> LineJobs:
    subs, ctx = api.parse_embeddings(body, meta, rid)
    return LineJobs(subs, ctx, 1, [])


Parser = Callable[[bytes, api.RequestMeta, str, int], LineJobs]
LINE_PARSERS: dict[str, Parser] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/embeddings": _embeddings,
}


class LineHead(msgspec.Struct):
    custom_id: str


class BatchLine(msgspec.Struct):
    custom_id: str
    url: str = ""
    method: str = "POST"
    body: msgspec.Raw = msgspec.Raw(b"")


_head = msgspec.json.Decoder(LineHead)
_line = msgspec.json.Decoder(BatchLine)


class FileCheck(msgspec.Struct):
    lines: int  # physical lines (blank ones included): the bitmap's size
    total: int  # requests
    errors: list[BatchError]


def _key(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


def check_file(path: Path) -> FileCheck:
    """One streaming pass over the input (run on a thread: a large file takes seconds)."""
    errors: list[BatchError] = []
    keys = array("Q")
    lines = total = 0
    with open(path, "rb") as f:
        for raw in f:
            lines += 1
            if not raw.strip():
                continue
            total += 1
            try:
                head = _head.decode(raw)
            except msgspec.ValidationError as e:
                if len(errors) < MAX_FILE_ERRORS:
                    errors.append(BatchError("invalid_request", f"custom_id: {e}", line=lines, param="custom_id"))
                continue
            except (msgspec.DecodeError, RecursionError):  # (nested past the decoder's depth: not JSON to us)
                if len(errors) < MAX_FILE_ERRORS:
                    errors.append(BatchError("invalid_json_line", "This line is not valid JSON.", line=lines))
                continue
            if not head.custom_id:
                if len(errors) < MAX_FILE_ERRORS:
                    errors.append(BatchError("empty_custom_id", "custom_id is empty", line=lines, param="custom_id"))
                continue
            keys.append(_key(head.custom_id))
    if total == 0:
        errors.append(BatchError("empty_file", "The input file has no requests."))
    if len(keys) > 1:
        ordered = array("Q", sorted(keys))
        del keys
        dup = {ordered[i] for i in range(1, len(ordered)) if ordered[i] == ordered[i - 1]}
        if dup:
            errors.extend(_duplicates(path, dup))
    return FileCheck(lines, total, errors)


def _duplicates(path: Path, dup: set[int]) -> list[BatchError]:
    """Name the repeated custom_ids' later lines (a second pass, only when there are some)."""
    seen: set[int] = set()
    out: list[BatchError] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                k = _key(_head.decode(raw).custom_id)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                continue
            if k in dup:
                if k in seen and len(out) < MAX_FILE_ERRORS:
                    out.append(
                        BatchError(
                            "duplicate_custom_id", "custom_id is used by an earlier line", line=n, param="custom_id"
                        )
                    )
                seen.add(k)
    return out


def decode_line(raw: bytes) -> BatchLine | None:
    """None: a line the file check already refused (it never gets here in a validated batch)."""
    try:
        return _line.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def to_jobs(
    line: BatchLine, endpoint: str, max_body_bytes: int, request_id: str, max_prompts: int = DEFAULT_MAX_PROMPTS
) -> LineJobs:
    """The line as the live request it stands for, or RequestError (400/413) naming why not.
    ``max_prompts``: a completions line's most prompts (``router.max_prompts_per_request``)."""
    if line.url != endpoint:
        raise api.invalid(f"This line's url {line.url!r} is not the batch's endpoint {endpoint!r}.", param="url")
    if line.method.upper() != "POST":
        raise api.invalid(f"method must be POST, not {line.method!r}", param="method")
    body = bytes(line.body)
    if len(body) > max_body_bytes:
        raise api.RequestError(
            error(Code.REQUEST_TOO_LARGE, f"Request body exceeds the limit of {max_body_bytes} bytes", param="body")
        )
    parser = LINE_PARSERS.get(endpoint)
    if parser is None:
        raise api.invalid(f"The endpoint {endpoint!r} is not served by this router.", param="url")
    jobs = parser(body, api.RequestMeta(), request_id, max_prompts)
    if isinstance(jobs.ctx, api.ResponseContext) and jobs.ctx.stream:
        raise api.invalid("stream is not supported in a batch", param="stream")
    return jobs


def with_model_tools(jobs: LineJobs, tool_parser: Callable[[str], tuple[str | None, bool]]) -> None:
    """As the live ingress does once the model is known: its tool-call parser
    on a chat line's tools (``auto`` parses calls only with one) and ``auto``'s
    structural tag where vLLM constrains it.  RequestError: tools nested too
    deeply to write the tag."""
    ctx = jobs.ctx
    if isinstance(ctx, api.ResponseContext) and ctx.tools is not None:
        api.read_with_model(jobs.subs[0], ctx.tools, tool_parser)
