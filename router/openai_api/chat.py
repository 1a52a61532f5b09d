"""``/v1/chat/completions``: the request body, its parsing into a ``Submit``,
and the response's JSON shapes."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from router.openai_api.context import ResponseContext, response_context
from router.openai_api.errors import invalid
from router.openai_api.request import RequestMeta, check_submit_shape, decode_body
from router.openai_api.sampling import SamplingFields, common_fields
from router.openai_api.usage import Usage
from shared.errors import Code
from shared.protocol import ChatMessage, PositiveInt, RequestKind, Submit, TopLogprobs


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[Message]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Any] | None = None


_chat_decoder = msgspec.json.Decoder(ChatRequest)


def _message_text(m: Message, i: int) -> str:
    content = m.content
    if isinstance(content, str):
        return content
    if content is None:
        raise invalid("Message content must be a string or a list of text parts", param=f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(
                f"Content part type {part.type!r} is not supported (only 'text')",
                param=f"messages[{i}].content[{j}]",
                code=Code.UNSUPPORTED_VALUE,
            )
        texts.append(part.text)
    return "\n".join(texts)  # vLLM joins text parts the same way


def parse_chat(body: bytes, meta: RequestMeta, request_id: str) -> tuple[Submit, ResponseContext]:
    req = decode_body(_chat_decoder, body)
    messages = [ChatMessage(m.role, _message_text(m, i)) for i, m in enumerate(req.messages)]
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.tools:
        raise invalid("tools are not supported", param="tools", code=Code.UNSUPPORTED_VALUE)
    params, task_type, priority = common_fields(req, meta, logprobs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sub = Submit(
        request_id=request_id,
        model=req.model,
        kind=RequestKind.CHAT,
        messages=messages,
        params=params,
        max_tokens=max_tokens,
        priority=priority,
        task_type=task_type,
        api_key=meta.api_key,
        user=req.user,
        allow_fallback=bool(req.fallback) or meta.allow_fallback,
    )
    check_submit_shape(sub)
    return sub, response_context(req, RequestKind.CHAT, request_id, logprobs)


# ------------------------------------------------------------ response shapes


class TopLogprob(msgspec.Struct, gc=False):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, gc=False):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, gc=False):
    content: list[ChatTokenLogprob]


class AssistantMessage(msgspec.Struct, gc=False):
    role: str
    content: str


class ChatChoice(msgspec.Struct, gc=False):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
