"""``/v1/chat/completions``: the request body, its parsing into a ``Submit``,
and the response's JSON shapes."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from router.api.context import ResponseContext, response_context
from router.api.errors import invalid, nesting_bounded
from router.api.request import RequestMeta, check_submit_shape, decode_body
from router.api.sampling import SamplingFields, common_fields
from router.api.tools import ChatTool, ToolCall, ToolChoice, ToolSpec, template_tools, tool_constraint, tool_spec
from router.api.usage import Usage
from shared.errors import Code
from shared.protocol import (
    ChatMessage,
    ChatOptions,
    PositiveInt,
    RequestKind,
    SamplingParams,
    Submit,
    ToolCallRef,
    TopLogprobs,
)


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class MessageFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] | None = None


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str = ""
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class Message(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    name: str | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[Message]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template fields (router.lifecycle.prompts renders them as vLLM does)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    chat_template: str | None = None  # refused: a request may not bring its own template
    reasoning_effort: str | None = None  # to the template, as vLLM passes it (with enable_thinking)
    return_token_ids: bool | None = None  # vLLM's: prompt_token_ids on the response, token_ids per choice
    # vLLM's chat extensions weir does not implement: refused unless left at their defaults
    echo: bool = False
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprob_token_ids: list[int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


# (field, its default): a request that sets one otherwise is refused, never served without it
_UNSUPPORTED_EXTRAS = (
    ("echo", False),
    ("return_tokens_as_token_ids", None),
    ("prompt_logprobs", None),
    ("truncate_prompt_tokens", None),
    ("skip_special_tokens", True),
    ("spaces_between_special_tokens", True),
    ("use_beam_search", False),
    ("length_penalty", 1.0),
    ("allowed_token_ids", None),
    ("bad_words", None),
    ("logprob_token_ids", None),
    ("mm_processor_kwargs", None),
    ("vllm_xargs", None),
)


def _refuse_unsupported_extras(req: ChatRequest) -> None:
    for name, default in _UNSUPPORTED_EXTRAS:
        value = getattr(req, name)
        if value != default and not (value == [] and default is None) and not (value is False and default is None):
            raise invalid(f"{name} is not supported by this server", param=name, code=Code.UNSUPPORTED_VALUE)


_chat_decoder = msgspec.json.Decoder(ChatRequest)


def _message_text(m: Message, i: int) -> str:
    content = m.content
    if isinstance(content, str):
        return content
    if content is None:
        if m.role == "assistant":
            return ""  # an assistant turn that only called tools (vLLM renders it empty)
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


def _chat_message(m: Message, i: int) -> ChatMessage:
    calls: list[ToolCallRef] = []
    if m.tool_calls:
        if m.role != "assistant":
            raise invalid("Only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
        for c in m.tool_calls:
            args = c.function.arguments
            text = args if isinstance(args, str) else "" if args is None else json.dumps(args, ensure_ascii=False)
            calls.append(ToolCallRef(c.id, c.function.name, text))
    return ChatMessage(m.role, _message_text(m, i), calls, m.tool_call_id, m.name)


def chat_options(req: ChatRequest, spec: ToolSpec | None) -> ChatOptions | None:
    """The chat-template fields as the router renders them (None: all defaults)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    if req.continue_final_message and req.messages and req.messages[-1].content is None:
        raise invalid(
            'continue_final_message is set but the final message has no "content" to continue!',
            param="continue_final_message",
        )
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None:  # vLLM: an explicit field wins over chat_template_kwargs
        kwargs = dict(kwargs or {})
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = req.reasoning_effort != "none"
        kwargs["reasoning_effort"] = req.reasoning_effort
    if req.chat_template is not None or (kwargs and kwargs.get("chat_template") is not None):
        raise invalid(
            "Chat template is passed with request, but this server does not trust request chat templates. "
            "Refused request with untrusted chat template.",
            param="chat_template",
        )
    if kwargs and "tokenize" in kwargs:
        raise invalid("Found unexpected chat template kwargs from request: {'tokenize'}", param="chat_template_kwargs")
    opts = ChatOptions(
        tools=template_tools(spec) if spec is not None else None,
        tool_choice=spec.choice if spec is not None else "none",
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=json.dumps(kwargs, ensure_ascii=False) if kwargs else None,
        documents=json.dumps(req.documents, ensure_ascii=False) if req.documents is not None else None,
        add_special_tokens=req.add_special_tokens,
    )
    return None if opts == _DEFAULT_OPTIONS else opts


_DEFAULT_OPTIONS = ChatOptions()


@nesting_bounded
def parse_chat(body: bytes, meta: RequestMeta, request_id: str) -> tuple[Submit, ResponseContext]:
    req = decode_body(_chat_decoder, body)
    _refuse_unsupported_extras(req)
    messages = [_chat_message(m, i) for i, m in enumerate(req.messages)]
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    spec = tool_spec(req.tools, req.tool_choice, req.parallel_tool_calls)
    params, task_type, priority = common_fields(req, meta, logprobs)
    constraint = tool_constraint(spec) if spec is not None else None
    if constraint is not None:
        if params is not None and params.structured is not None:
            raise invalid(
                "You can only either use constraints for structured outputs or tools, not both.", param="tool_choice"
            )
        params = msgspec.structs.replace(params or SamplingParams(), structured=constraint)
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
        routing=meta.routing,
        api_key=meta.api_key,
        user=req.user,
        allow_fallback=bool(req.fallback) or meta.allow_fallback,
        chat=chat_options(req, spec),
        return_token_ids=bool(req.return_token_ids),
    )
    check_submit_shape(sub)
    ctx = response_context(req, RequestKind.CHAT, request_id, logprobs)
    ctx.return_token_ids = sub.return_token_ids
    if spec is not None and spec.choice != "none":
        ctx.tools = spec  # the ingress sets the model's parser on it
    return sub, ctx


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


class AssistantMessage(msgspec.Struct, gc=False, omit_defaults=True):
    role: str
    content: str | None  # None: only tool calls (always in the body, as OpenAI's)
    tool_calls: list[ToolCall] = []


class ChatChoice(msgspec.Struct, gc=False):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletion(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
