"""``POST /tokenize`` and ``POST /detokenize`` as the ingress answers them:
with the router's own tokenizer (no engine hop), in vLLM's shapes
(router.openai_api.tokenize).  A long text is tokenized on the tokenizing
thread, as prompts are (router.prompts: ``encode_batch`` releases the GIL),
so the event loop never stalls on it; pipelined requests wait behind it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from router import openai_api as api
from router.http_routes import JSON
from router.model_registry import ServedModel
from router.openai_api import tokenize as tokenize_api
from router.prompts import INLINE_MAX_CHARS
from shared.errors import Code, error

if TYPE_CHECKING:
    from router.http_server import HttpConnection, _Request

log = logging.getLogger("weir.http")


def _answer(conn: HttpConnection, req: _Request, label: str, body: Callable[[], bytes]) -> None:
    """200 with ``body()``, or its RequestError as the error response."""
    try:
        data = body()
    except api.RequestError as e:
        return conn.respond_error(req, e.info, label)
    except Exception:
        log.exception("%s failed", label)
        return conn.respond_error(req, error(Code.INTERNAL, "Internal error"), label)
    conn.respond(req, 200, JSON, data, label)


def _tokenizer(conn: HttpConnection, req: _Request, model: str, label: str) -> ServedModel | None:
    """The model's tokenizer, or None after answering why not.  Where API
    keys are configured a valid one is needed, as for generation (vLLM's
    --api-key guards only /v1/)."""
    meta = api.meta_from_headers(req.header(b"authorization"), req.header(b"x-api-key"), None, None, None)
    refused = conn.ingress.core.check_key(meta.api_key)
    if refused is not None:
        conn.respond_error(req, refused, label)
        return None
    served = conn.ingress.core.served_model(model)
    if served is None:
        conn.respond_error(
            req, error(Code.MODEL_NOT_FOUND, f"The model `{model}` does not exist.", param="model"), label
        )
        return None
    if not served.prompts.exact:
        conn.respond_error(
            req,
            error(Code.UNSUPPORTED_VALUE, f"The model `{model}` has no tokenizer (simulated)", param="model"),
            label,
        )
        return None
    return served


def tokenize(conn: HttpConnection, req: _Request, label: str) -> None:
    """A prompt or a chat -> its token ids, exactly as a generation request's."""
    try:
        job = tokenize_api.parse_tokenize(req.body)
    except api.RequestError as e:
        return conn.respond_error(req, e.info, label)
    served = _tokenizer(conn, req, job.model, label)
    if served is None:
        return
    prompts, max_len = served.prompts, served.config.max_model_len
    if job.chars <= INLINE_MAX_CHARS:
        return _answer(conn, req, label, lambda: tokenize_api.answer_tokenize(prompts, job, max_len))
    conn.busy = True  # (pipelined requests wait for this answer)
    fut = conn.ingress.core.off_loop(tokenize_api.answer_tokenize, prompts, job, max_len)
    fut.add_done_callback(lambda f: _answer(conn, req, label, f.result))


def detokenize(conn: HttpConnection, req: _Request, label: str) -> None:
    """Token ids -> their text (special tokens kept, as vLLM decodes them)."""
    try:
        parsed = tokenize_api.parse_detokenize(req.body)
    except api.RequestError as e:
        return conn.respond_error(req, e.info, label)
    served = _tokenizer(conn, req, parsed.model or "", label)
    if served is None:
        return
    prompts = served.prompts
    if len(parsed.tokens) * 4 <= INLINE_MAX_CHARS:  # (decoding an id costs about what encoding ~4 characters does)
        return _answer(conn, req, label, lambda: tokenize_api.answer_detokenize(prompts, parsed))
    conn.busy = True
    fut = conn.ingress.core.off_loop(tokenize_api.answer_detokenize, prompts, parsed)
    fut.add_done_callback(lambda f: _answer(conn, req, label, f.result))
