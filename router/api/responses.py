"""``/v1/responses``: the request body, its translation into a chat request,
and the response object (pure, no I/O).

A Responses request is a chat turn: ``instructions`` become the system
message, the stored conversation of ``previous_response_id`` comes next
(its instructions are not carried over, as OpenAI does), then ``input``
(text, or items: messages, ``function_call`` and ``function_call_output``).
The turn is rendered as a chat-completions body and parsed by
``router.api.chat.parse_chat``: one set of sampling, tool and
structured-output rules for both endpoints.  Refusals name the Responses
field (``input``, ``max_output_tokens``, ``text.format``) in ``param``.

Fields weir cannot honour are refused with a 400, never ignored: ``include``,
``reasoning`` with options, ``truncation: "auto"``, ``prompt``,
``conversation``, and input items other than messages and function calls.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

import msgspec

from router.api.chat import parse_chat
from router.api.context import ResponseContext
from router.api.encoding import encode
from router.api.errors import RequestError, invalid
from router.api.metadata import metadata_problem
from router.api.request import RequestMeta, decode_body
from router.api.usage import TokenCounts
from shared.errors import Code, error
from shared.protocol import PositiveInt, Submit, Temperature, TopP, User

DEFAULT_TEMPERATURE = 1.0  # the response object shows what sampled (OpenAI's defaults)
DEFAULT_TOP_P = 1.0


class TextConfig(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields weir reads; unknown ones are ignored, as OpenAI does."""

    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: User | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    # vLLM's sampling extras on its Responses endpoint: passed to the chat
    # request as they are (checked there, refusals naming the same field)
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    # OpenAI's, not honoured: refused when given
    prompt: Any = None
    conversation: Any = None


_decoder = msgspec.json.Decoder(ResponsesRequest)


def decode_responses(body: bytes) -> ResponsesRequest:
    """The body, checked for what needs no stored state (before anything is looked up or reserved)."""
    req = decode_body(_decoder, body)
    unsupported = (
        ("include", bool(req.include), "include is not supported (no logprobs or reasoning content to add)"),
        ("reasoning", bool(req.reasoning), "reasoning options are not supported (the models served do not reason)"),
        (
            "truncation",
            req.truncation == "auto",
            'truncation "auto" is not supported; a prompt over the context is refused',
        ),
        ("prompt", req.prompt is not None, "prompt templates are not supported; send instructions and input"),
        (
            "conversation",
            req.conversation is not None,
            "conversation objects are not supported; use previous_response_id",
        ),
    )
    for param, refused, why in unsupported:
        if refused:
            raise invalid(why, param=param, code=Code.UNSUPPORTED_VALUE)
    bad_metadata = metadata_problem(req.metadata)
    if bad_metadata is not None:
        raise invalid(bad_metadata, param="metadata")
    if req.background and req.stream:
        raise invalid("background with stream is not supported", param="background", code=Code.UNSUPPORTED_VALUE)
    if req.background and req.store is False:
        raise invalid(
            "background needs store: a background response is only read back from the store", param="background"
        )
    if req.previous_response_id is not None and not req.previous_response_id:
        raise invalid("previous_response_id must not be empty", param="previous_response_id")
    input_messages(req)  # checks the items now; the turn renders them again with the history
    return req


# ------------------------------------------------------------ input -> chat messages


def _parts_text(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(text, str):
            raise invalid(
                f"content part type {kind!r} is not supported (only input_text and output_text)",
                param=f"{where}[{j}]",
                code=Code.UNSUPPORTED_VALUE,
            )
        parts.append({"type": "text", "text": text})
    return parts


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages (OpenAI chat shape)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"role {role!r} is not one of user, system, developer, assistant", param=f"{where}.role")
            content = _parts_text(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
                raise invalid("a function_call item needs call_id, name and arguments (strings)", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls of one turn: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or output is None:
                raise invalid("a function_call_output item needs call_id and output", param=where)
            text = _parts_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise invalid(
                f"input item type {kind!r} is not supported (message, function_call, function_call_output)",
                param=f"{where}.type",
                code=Code.UNSUPPORTED_VALUE,
            )
    if not out:
        raise invalid("input must not be empty", param="input")
    return out


# ------------------------------------------------------------ the chat request


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise invalid(
                f"tool type {t.get('type')!r} is not supported (function tools only)",
                param=f"tools[{i}]",
                code=Code.UNSUPPORTED_VALUE,
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice must be none, auto, required or a function", param="tool_choice")


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"text.format type {kind!r} is not one of text, json_object, json_schema", param="text.format")


_PARAMS = (  # the chat field a refusal names -> the Responses field
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
    ("response_format", "text.format"),
)


_VLLM_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
)


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("user", req.user),
        ("parallel_tool_calls", req.parallel_tool_calls),
        *((name, getattr(req, name)) for name in _VLLM_EXTRAS),
    ):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = _chat_tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None:
        fmt = _response_format(req.text.format)
        if fmt is not None:
            body["response_format"] = fmt
    return body


class Turn(msgspec.Struct, kw_only=True):
    """One response in the making: what its object echoes, and the
    conversation stored for ``previous_response_id`` (no instructions)."""

    id: str
    created_at: int
    req: ResponsesRequest
    history: list[dict[str, Any]]  # previous conversation + this input
    message_id: str


def _hex_id() -> str:
    return os.urandom(12).hex()


def new_response_id() -> str:
    return "resp_" + _hex_id()


def build_turn(
    req: ResponsesRequest, previous: list[dict[str, Any]] | None, meta: RequestMeta, request_id: str
) -> tuple[Submit, ResponseContext, Turn]:
    """The chat Submit for this turn, its context and the Turn; ``previous``:
    the stored conversation of ``previous_response_id`` (already looked up)."""
    history = [*(previous or []), *input_messages(req)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    try:
        sub, ctx = parse_chat(encode(chat_body(req, messages)), meta, request_id)
    except RequestError as e:
        param = e.info.param or ""
        for chat_name, ours in _PARAMS:
            if param.startswith(chat_name):
                param = ours
                break
        raise RequestError(msgspec.structs.replace(e.info, param=param or None)) from None
    turn = Turn(
        id=new_response_id(), created_at=int(time.time()), req=req, history=history, message_id="msg_" + _hex_id()
    )
    ctx.id = turn.id
    ctx.stream = bool(req.stream)
    return sub, ctx, turn


# ------------------------------------------------------------ the response object


def message_item(turn: Turn, text: str, status: str) -> dict[str, Any]:
    content = (
        [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    )
    return {"id": turn.message_id, "type": "message", "role": "assistant", "status": status, "content": content}


def usage_object(counts: TokenCounts) -> dict[str, Any]:
    out = counts.completion_total
    return {
        "input_tokens": counts.prompt,
        "input_tokens_details": {"cached_tokens": counts.cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts.prompt + out,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason in ("abort", "cancelled"):
        return "cancelled", None
    return "completed", None


def response_object(
    turn: Turn,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete: dict[str, Any] | None = None,
    err: dict[str, Any] | None = None,
) -> dict[str, Any]:
    req = turn.req
    fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
    return {
        "id": turn.id,
        "object": "response",
        "created_at": turn.created_at,
        "status": status,
        "background": bool(req.background),
        "error": err,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": req.model,
        "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "service_tier": req.service_tier or "auto",
        "store": req.store is not False,
        "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": DEFAULT_TOP_P if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage,
        "user": req.user,
    }


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the chat messages a continuation prepends."""
    msgs: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            msgs.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = msgs[-1] if msgs else None
            if last is not None and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return msgs


def not_found(response_id: str, param: str) -> RequestError:
    """OpenAI's 404 for an id it does not know (never stored, expired, evicted or deleted)."""
    return RequestError(error(Code.NOT_FOUND, f"Response with id '{response_id}' not found.", param=param))
