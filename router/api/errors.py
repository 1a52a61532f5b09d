"""OpenAI-style refusals: the exception the parsers raise and the error body
the server sends (as a response, or as an SSE event mid-stream)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import msgspec

from router.api.encoding import encode
from shared.errors import Code, error
from shared.protocol import ErrorInfo


class RequestError(Exception):
    """A request refused with an OpenAI-style error."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


def invalid(message: str, param: str | None = None, code: Code = Code.BAD_REQUEST) -> RequestError:
    return RequestError(error(code, message, param=param))


P = ParamSpec("P")
R = TypeVar("R")

NESTED_TOO_DEEPLY = "A JSON value in the request is nested too deeply"


def nesting_bounded(parse: Callable[P, R]) -> Callable[P, R]:
    """``parse`` refuses a request whose JSON nests too deeply to re-encode:
    the body decoder (msgspec) takes ~990 levels, but the parsers re-encode
    parts of it with ``json.dumps`` (tool schemas for the chat template and
    the structural tag, tool-call arguments, template kwargs), whose limit
    is Python's recursion limit less the frames above -- a 400, not the
    handler's 500."""

    @functools.wraps(parse)
    def bounded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return parse(*args, **kwargs)
        except RecursionError:
            raise invalid(NESTED_TOO_DEEPLY) from None

    return bounded


class ErrorBody(msgspec.Struct, gc=False, omit_defaults=True):
    message: str
    type: str
    param: str | None  # (no default: always in the body, null or not, as OpenAI's)
    code: str | None
    request_id: str | None = None  # the x-request-id of its log lines (weir's addition)


class ErrorEnvelope(msgspec.Struct, gc=False):
    error: ErrorBody


def error_body(info: ErrorInfo, request_id: str | None = None) -> bytes:
    return encode(ErrorEnvelope(ErrorBody(info.message, info.type, info.param, info.code, request_id)))
