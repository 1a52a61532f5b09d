"""``/tokenize`` and ``/detokenize``: vLLM's request and response shapes
(vllm/entrypoints/serve/tokenize/protocol.py), answered by the router with
its own tokenizer -- the one every prompt is tokenized with, so the ids are
exactly those a completion or chat request would send to the engine.

Parsing and rendering are here, pure; the ingress (router.ingress.tokenize)
picks the model and runs its tokenizer, on a tokenizer thread for long texts.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.api.chat import ChatRequest, Message, chat_options
from router.api.chat import _chat_message as chat_message
from router.api.encoding import encode
from router.api.errors import invalid, nesting_bounded
from router.api.request import decode_body
from router.api.tools import ChatTool, ToolSpec
from shared.protocol import NonNegativeInt, RequestKind, Submit


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[NonNegativeInt]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


class TokenizeJob(msgspec.Struct):
    """A parsed /tokenize: the text to tokenize or the chat to render first."""

    model: str
    text: str | None  # a prompt
    chat: Submit | None  # messages, rendered with the model's chat template
    add_special_tokens: bool
    return_token_strs: bool

    @property
    def chars(self) -> int:
        if self.text is not None:
            return len(self.text)
        assert self.chat is not None
        tools = self.chat.chat.tools if self.chat.chat is not None else None
        return sum(len(m.content) for m in self.chat.messages) + len(tools or "")


def _model(model: str | None) -> str:
    if not model:
        # (vLLM serves one model and takes its name as the default; weir serves several)
        raise invalid("model is required", param="model")
    return model


@nesting_bounded
def parse_tokenize(body: bytes) -> TokenizeJob:
    req = decode_body(_tokenize_decoder, body)
    model = _model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("give exactly one of prompt (a string) or messages", param="prompt")
    if req.messages is None:
        assert req.prompt is not None
        special = True if req.add_special_tokens is None else req.add_special_tokens
        return TokenizeJob(model, req.prompt, None, special, bool(req.return_token_strs))
    if not req.messages:
        raise invalid("messages must be a non-empty list", param="messages")
    special = False if req.add_special_tokens is None else req.add_special_tokens
    # The chat path's own checks and options (chat_template refused as there):
    # the ids are those a chat completion with these fields would be given.
    # vLLM's /tokenize shows the tools to the template whatever the choice.
    as_chat = ChatRequest(
        model=model,
        messages=req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template=req.chat_template,
        chat_template_kwargs=req.chat_template_kwargs,
        add_special_tokens=special,
    )
    spec = None if req.tools is None else ToolSpec([t.function for t in req.tools], "none")
    messages = [chat_message(m, i) for i, m in enumerate(req.messages)]
    chat = Submit(
        request_id="tokenize", model=model, kind=RequestKind.CHAT, messages=messages, chat=chat_options(as_chat, spec)
    )
    return TokenizeJob(model, None, chat, special, bool(req.return_token_strs))


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    req = decode_body(_detokenize_decoder, body)
    _model(req.model)
    return req


def tokenize_body(ids: list[int], max_model_len: int, strs: list[str] | None) -> bytes:
    """/tokenize's response: the ids (and their strings, when asked for)."""
    return encode(TokenizeResponse(len(ids), max_model_len, ids, strs))


def detokenize_body(text: str) -> bytes:
    return encode(DetokenizeResponse(text))
