"""``/v1/embeddings``: the request body, its parsing into one ``Submit`` per
input, and the response's JSON shape (OpenAI's, with vLLM's usage).

``input`` is a string, a list of strings, a list of token ids, or a list of
token-id lists (up to ``MAX_EMBEDDING_INPUTS``).  Each input becomes its own
job (``RequestKind.EMBEDDING``): admitted, priced as prefill only (its
prompt's KV, nothing generated), budgeted and scheduled like any request;
the response is written once every input has its vector.

vLLM's own request fields are honoured where weir can (``dimensions``,
``encoding_format``, ``endianness``, ``embed_dtype`` float32,
``add_special_tokens`` true, ``use_activation`` true) and refused where it
cannot (``truncate_prompt_tokens``, ``padding``, ``truncation_side``, other
dtypes, chat-style ``messages``) -- never dropped silently.
"""

from __future__ import annotations

import array
import base64
import sys
import time
from typing import Any, Literal

import msgspec

from router.api.errors import invalid
from router.api.request import TASK_TYPES, RequestMeta, check_submit_shape, decode_body
from shared.errors import Code
from shared.protocol import INT64_MAX, PositiveInt, RequestKind, Submit, TaskType, User

# OpenAI's bound on inputs per request (vLLM sets none): each is a job.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any]  # list: strings, token ids, or token-id lists (checked below)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: User | None = None
    # vLLM's extensions
    add_special_tokens: bool = True
    use_activation: bool | None = None  # None/true: normalized, vLLM's default
    embed_dtype: str = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    truncate_prompt_tokens: int | None = None
    padding: str | None = None
    truncation_side: str | None = None
    messages: msgspec.Raw = msgspec.Raw()
    # weir's extensions
    priority: str | None = None
    task_type: Literal["short", "long"] | None = None


class EmbeddingContext(msgspec.Struct, gc=False):
    """What rendering the response needs."""

    id: str
    model: str
    created: int
    base64: bool
    big_endian: bool  # vectors are float32 little-endian on the wire: swap for "big" (and "native" on a BE host)
    count: int  # inputs


_decoder = msgspec.json.Decoder(EmbeddingRequest)
_BIG_HOST = sys.byteorder == "big"


def _refuse(param: str, why: str) -> None:
    raise invalid(f"{param} {why} is not supported", param=param, code=Code.UNSUPPORTED_VALUE)


def _token_ids(value: list[Any], param: str) -> list[int]:
    for t in value:
        if type(t) is not int or not 0 <= t <= INT64_MAX:
            raise invalid(f"{param} must hold token ids (integers >= 0)", param=param)
    if not value:
        raise invalid("input must not hold an empty token list", param=param)
    return value


def _inputs(value: str | list[Any]) -> list[str | list[int]]:
    """The request's inputs, each a string or a token-id list (vLLM's four forms)."""
    if isinstance(value, str):
        items: list[str | list[int]] = [value]
    elif not value:
        raise invalid("input must not be empty", param="input")
    elif all(isinstance(x, str) for x in value):
        items = list(value)
    elif all(type(x) is int for x in value):
        items = [_token_ids(value, "input")]
    elif all(isinstance(x, list) for x in value):
        items = [_token_ids(x, "input") for x in value]
    else:
        raise invalid("input must be a string, a list of strings, a list of token ids or a list of them", "input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise invalid(f"input holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} per request", param="input")
    if any(x == "" for x in items):
        raise invalid("input must not hold an empty string", param="input")
    return items


def _task_type(field: str | None, meta: RequestMeta) -> TaskType:
    """As the generation endpoints: the body's ``task_type``, else the header."""
    if field is not None:
        return TASK_TYPES[field]
    if meta.task_type is None:
        return TaskType.AUTO
    task_type = TASK_TYPES.get(meta.task_type.strip().lower())
    if task_type is None:
        raise invalid("x-weir-task-type must be 'short' or 'long'", param="x-weir-task-type")
    return task_type


def parse_embeddings(body: bytes, meta: RequestMeta, request_id: str) -> tuple[list[Submit], EmbeddingContext]:
    req = decode_body(_decoder, body)
    if len(req.messages) and bytes(req.messages) != b"null":
        _refuse("messages", "(chat-style embedding input)")
    if req.truncate_prompt_tokens is not None:
        _refuse("truncate_prompt_tokens", "(inputs over the context are refused)")
    if req.padding is not None:
        _refuse("padding", "")
    if req.truncation_side is not None:
        _refuse("truncation_side", "")
    if req.embed_dtype != "float32":
        _refuse("embed_dtype", f"{req.embed_dtype!r} (float32 only)")
    if not req.add_special_tokens:
        _refuse("add_special_tokens", "false")
    if req.use_activation is False:
        _refuse("use_activation", "false (vectors are normalized)")
    task_type = _task_type(req.task_type, meta)
    subs = []
    for i, item in enumerate(_inputs(req.input)):
        sub = Submit(
            request_id=f"{request_id}-{i}",
            model=req.model,
            kind=RequestKind.EMBEDDING,
            priority=req.priority or meta.priority,
            task_type=task_type,
            routing=meta.routing,
            api_key=meta.api_key,
            user=req.user,
            dimensions=req.dimensions,
        )
        if isinstance(item, str):
            sub.prompt = item
        else:
            sub.prompt_token_ids = item
        check_submit_shape(sub)
        subs.append(sub)
    big = req.endianness == "big" or (req.endianness == "native" and _BIG_HOST)
    ctx = EmbeddingContext(
        "embd-" + request_id, req.model, int(time.time()), req.encoding_format == "base64", big, len(subs)
    )
    return subs, ctx


# ------------------------------------------------------------ response shape


class EmbeddingData(msgspec.Struct, gc=False):
    index: int
    object: str
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, gc=False):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class EmbeddingList(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_vector(packed: bytes, as_base64: bool, big_endian: bool) -> list[float] | str:
    """One vector from the wire (float32 little-endian) as the client asked:
    floats, or base64 of the float32 bytes (what the openai SDK decodes)."""
    if as_base64 and not big_endian:
        return base64.b64encode(packed).decode("ascii")
    a = array.array("f")
    a.frombytes(packed)
    if _BIG_HOST:  # the wire is little-endian
        a.byteswap()
    if not as_base64:
        return a.tolist()
    if not _BIG_HOST:
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def render_embeddings(ctx: EmbeddingContext, vectors: list[bytes], prompt_tokens: int) -> EmbeddingList:
    data = [EmbeddingData(i, "embedding", encode_vector(v, ctx.base64, ctx.big_endian)) for i, v in enumerate(vectors)]
    return EmbeddingList(ctx.id, "list", ctx.created, ctx.model, data, EmbeddingUsage(prompt_tokens, prompt_tokens))
