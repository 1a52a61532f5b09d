"""``POST /tokenize`` and ``POST /detokenize`` as the ingress answers them:
with the router's own tokenizer (no engine hop), in vLLM's shapes
(router.api.tokenize).  Each call is one request of the caller's
budgets (router.tenancy.budgets: 429 when empty).  A long text is tokenized on a
tokenizer thread, as prompts are (router.lifecycle.prompts: ``encode_batch`` releases
the GIL), so the event loop never stalls on it; there it takes its tenant's
turn and never goes ahead of a prompt, and too many waiting is a 503
(router.lifecycle.tokenizer_queue).  Pipelined requests wait behind it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from router import api
from router.api import tokenize as tokenize_api
from router.ingress.connection import Connection, Request
from router.ingress.headers import ratelimit_headers
from router.ingress.routes import JSON
from router.lifecycle.models import ServedModel
from router.lifecycle.prompts import INLINE_MAX_CHARS, BadInput, ModelPrompts
from router.tenancy.buckets import BudgetAnswer, Hold
from router.tenancy.identity import Identity
from shared.errors import Code, error

log = logging.getLogger("weir.http")

BUSY_RETRY_S = 1.0  # tokenizer_busy: a 1 MiB call takes about this long


def _answer(conn: Connection, req: Request, label: str, body: Callable[[], bytes], extra: bytes = b"") -> None:
    """200 with ``body()``, or its RequestError as the error response."""
    try:
        data = body()
    except api.RequestError as e:
        return conn.respond_error(req, e.info, label)
    except Exception:
        log.exception("%s failed", label)
        return conn.respond_error(req, error(Code.INTERNAL, "Internal error"), label)
    conn.respond(req, 200, JSON, data, label, extra)


def _tokenizer(conn: Connection, req: Request, model: str, label: str) -> tuple[ServedModel, Identity] | None:
    """The model's tokenizer and the caller, or None after answering why not.
    Where API keys are configured a valid one is needed, as for generation
    (vLLM's --api-key guards only /v1/).  An alias is resolved as generation
    resolves it ([[aliases]]), drawn by the request's session header if any."""
    meta = api.meta_from_headers(req.header(b"authorization"), req.header(b"x-api-key"), None, None, None)
    who = conn.ingress.core.identify(meta.api_key)
    if not isinstance(who, Identity):
        conn.respond_error(req, who, label)
        return None
    try:  # an alias: the model its session's requests go to first (without one, its first target)
        routing = conn.ingress.agent.routing(req.headers)
    except api.RequestError as e:
        conn.respond_error(req, e.info, label)
        return None
    served = conn.ingress.core.served_model(model, routing.session if routing is not None else "")
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
    return served, who


def _charged(
    conn: Connection, req: Request, label: str, who: Identity, inline: bool, work: Callable[[], bytes]
) -> None:
    """Charge the call one request of its budgets (router.tenancy.budgets), then run
    ``work``: inline when short, else on a tokenizer thread in its tenant's
    turn (router.lifecycle.tokenizer_queue) -- refused, with its request given back,
    when too many of its calls are waiting there."""
    core = conn.ingress.core

    def go(got: BudgetAnswer) -> None:
        if not isinstance(got, Hold):
            return conn.respond_error(req, got, label)
        rl = ratelimit_headers(got.ratelimit) if got.ratelimit is not None else b""
        if inline:
            return _answer(conn, req, label, work, rl)
        fut = core.off_loop(who.tenant, work, alive=lambda: not conn.closed)
        if fut is None:
            core.quota.release(got, 0, refund_request=True)
            busy = error(
                Code.TOKENIZER_BUSY,
                "Too many tokenize calls of this tenant are waiting for the tokenizer; retry shortly.",
                retry_after=BUSY_RETRY_S,
            )
            return conn.respond_error(req, busy, label)
        fut.add_done_callback(lambda f: None if f.cancelled() else _answer(conn, req, label, f.result, rl))

    conn.busy = True  # (pipelined requests wait for this answer)
    got = core.charge_call(who, go)
    if got is not None:
        go(got)


def tokenize(conn: Connection, req: Request, label: str) -> None:
    """A prompt or a chat -> its token ids, exactly as a generation request's."""
    try:
        job = tokenize_api.parse_tokenize(req.body)
    except api.RequestError as e:
        return conn.respond_error(req, e.info, label)
    found = _tokenizer(conn, req, job.model, label)
    if found is None:
        return
    served, who = found
    prompts, max_len = served.prompts, served.config.max_model_len
    work = partial(answer_tokenize, prompts, job, max_len)
    _charged(conn, req, label, who, job.chars <= INLINE_MAX_CHARS, work)


def detokenize(conn: Connection, req: Request, label: str) -> None:
    """Token ids -> their text (special tokens kept, as vLLM decodes them)."""
    try:
        parsed = tokenize_api.parse_detokenize(req.body)
    except api.RequestError as e:
        return conn.respond_error(req, e.info, label)
    found = _tokenizer(conn, req, parsed.model or "", label)
    if found is None:
        return
    served, who = found
    # (decoding an id costs about what encoding ~4 characters does)
    inline = len(parsed.tokens) * 4 <= INLINE_MAX_CHARS
    _charged(conn, req, label, who, inline, partial(answer_detokenize, served.prompts, parsed))


def answer_tokenize(prompts: ModelPrompts, job: tokenize_api.TokenizeJob, max_model_len: int) -> bytes:
    """The response body (RequestError for a chat the template refuses)."""
    if job.chat is not None:
        try:
            text = prompts.render_chat(job.chat)
        except BadInput as e:
            raise api.invalid(str(e), param=e.param or "messages") from None
        except Exception as e:  # the template's raise_exception, or no template
            raise api.invalid(f"The chat template failed: {e}", param="messages") from None
    else:
        assert job.text is not None
        text = job.text
    ids = prompts.encode(text, job.add_special_tokens)
    strs = prompts.token_strs(ids) if job.return_token_strs else None
    return tokenize_api.tokenize_body(ids, max_model_len, strs)


def answer_detokenize(prompts: ModelPrompts, req: tokenize_api.DetokenizeRequest) -> bytes:
    # (ids outside the vocabulary decode to nothing: the tokenizer skips them, as under vLLM)
    return tokenize_api.detokenize_body(prompts.decode(req.tokens))
