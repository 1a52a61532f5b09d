"""OpenAI-compatible request decoding and response rendering (pure, no I/O).

The HTTP server (``router.http_server``) feeds request bodies and a few
headers in and gets a ``Submit`` plus a ``ResponseContext`` back; it feeds
``Delta`` batches to a ``StreamRenderer`` (SSE) or accumulates them and calls
``render_completion`` once.  Every refusal is a ``RequestError`` carrying an
``ErrorInfo`` whose ``status`` is the HTTP status.

Streaming chunks are built from per-stream byte templates around a
msgspec-encoded text: 3x cheaper than encoding a Struct per event (0.2 vs
0.7 us measured) and safe, because every variable part (id, model, text,
finish reason) is still JSON-encoded by msgspec.  Tests check the templates
against plain JSON.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Literal, Optional, Union

import msgspec

from router.admission import check_shape
from shared.errors import Code, error
from shared.protocol import (
    ChatMessage,
    Delta,
    ErrorInfo,
    Penalty,
    PositiveInt,
    RequestKind,
    SamplingParams,
    StopList,
    Submit,
    TaskType,
    Temperature,
    TopP,
)

# OpenAI's documented default for the legacy completions endpoint (vLLM uses
# it too); chat leaves max_tokens unset = the rest of the model's context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class RequestError(Exception):
    """A request refused with an OpenAI-style error."""

    def __init__(self, info: ErrorInfo):
        super().__init__(info.message)
        self.info = info


def invalid(message: str, param: Optional[str] = None, code: Code = Code.BAD_REQUEST) -> RequestError:
    return RequestError(error(code, message, param=param))


# ------------------------------------------------------------ request bodies
# Ranges are the wire protocol's own types (shared.protocol): declared once.


class StreamOptions(msgspec.Struct):
    include_usage: Optional[bool] = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints.  Unknown fields are ignored (as
    OpenAI does); known ones weir cannot honour are refused, not dropped."""

    model: str
    max_tokens: Optional[PositiveInt] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, StopList, None] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logprobs: Any = None  # int for completions, bool for chat: refused if set
    ignore_eos: Optional[bool] = False  # vLLM's extension: generate exactly max_tokens
    # weir extensions
    priority: Optional[str] = None  # a scheduler class; may only lower the key's
    task_type: Optional[Literal["short", "long"]] = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Union[str, list]  # list: validated below (one string only)
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(msgspec.Struct):
    type: str
    text: Optional[str] = None


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Message]
    max_completion_tokens: Optional[PositiveInt] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatRequest)

_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def _from_validation_error(e: msgspec.ValidationError) -> RequestError:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`";
    OpenAI clients want the offending field in ``param``."""
    text = str(e)
    at = _AT_PATH.search(text)
    path = at.group(1) if at else ""
    message = text[: at.start()] if at else text
    missing = _MISSING.match(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    param = path or None
    return invalid(f"{message} (at '{param}')" if param else message, param=param)


def _decode(decoder: msgspec.json.Decoder, body: bytes):
    if not body:
        raise invalid("Request body is empty; expected a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise _from_validation_error(e) from None
    except msgspec.DecodeError as e:
        raise invalid(f"Malformed JSON body: {e}") from None
    except RecursionError:  # msgspec's answer to absurdly deep nesting
        raise invalid("Malformed JSON body: nested too deeply") from None


class RequestMeta(msgspec.Struct, gc=False):
    """What the ingress takes from HTTP headers (see ``meta_from_headers``)."""

    api_key: Optional[str] = None
    priority: Optional[str] = None
    task_type: Optional[str] = None


def meta_from_headers(
    authorization: Optional[str],
    x_api_key: Optional[str],
    x_weir_priority: Optional[str] = None,
    x_weir_task_type: Optional[str] = None,
) -> RequestMeta:
    """``x-api-key`` wins over ``Authorization: Bearer`` because it is the
    header Envoy's per-key rate limit counts."""
    key = x_api_key.strip() if x_api_key else None
    if not key and authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer":
            key = token.strip() or None
    return RequestMeta(key or None, x_weir_priority or None, x_weir_task_type or None)


_TASK_TYPES = {"short": TaskType.SHORT, "long": TaskType.LONG}


def _check_common(req: _Sampling, meta: RequestMeta) -> tuple[Optional[SamplingParams], TaskType, Optional[str]]:
    if req.n is not None and req.n != 1:
        raise invalid("Only n=1 is supported", param="n", code=Code.UNSUPPORTED_VALUE)
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    if req.logprobs not in (None, False):
        raise invalid("logprobs are not supported", param="logprobs", code=Code.UNSUPPORTED_VALUE)
    if req.stop is None:
        stop: list[str] = []
    elif isinstance(req.stop, str):
        stop = [req.stop]
    else:
        stop = req.stop
    params = None
    if (req.temperature is not None or req.top_p is not None or req.seed is not None or stop or req.ignore_eos
            or req.presence_penalty or req.frequency_penalty):
        params = SamplingParams(
            max_tokens=0,  # the router sets it from Submit.max_tokens / the context
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=stop,
            ignore_eos=bool(req.ignore_eos),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
        )
    if req.task_type is not None:
        task_type = _TASK_TYPES[req.task_type]
    elif meta.task_type is not None:
        task_type = _TASK_TYPES.get(meta.task_type.strip().lower())
        if task_type is None:
            raise invalid("x-weir-task-type must be 'short' or 'long'", param="x-weir-task-type")
    else:
        task_type = TaskType.AUTO
    return params, task_type, req.priority or meta.priority


class ResponseContext(msgspec.Struct, gc=False):
    """What rendering a response needs to know about its request."""

    id: str
    kind: RequestKind
    model: str
    created: int
    stream: bool
    include_usage: bool


_id_prefix = os.urandom(4).hex()
_id_counter = 0


def new_request_id() -> str:
    """Unique per process (random prefix + counter): cheap, and never collides
    with another router process's ids in logs."""
    global _id_counter
    _id_counter += 1
    return f"{_id_prefix}{_id_counter:x}"


def _context(req: _Sampling, kind: RequestKind, request_id: str) -> ResponseContext:
    prefix = "cmpl-" if kind == RequestKind.COMPLETION else "chatcmpl-"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ResponseContext(prefix + request_id, kind, req.model, int(time.time()), bool(req.stream), include_usage)


def parse_completion(body: bytes, meta: RequestMeta, request_id: str) -> tuple[Submit, ResponseContext]:
    req = _decode(_completion_decoder, body)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif prompt and all(isinstance(p, str) for p in prompt):
            raise invalid("Only one prompt per request is supported", param="prompt", code=Code.UNSUPPORTED_VALUE)
        else:
            raise invalid("prompt must be a string (token-id prompts are not supported)", param="prompt",
                          code=Code.UNSUPPORTED_VALUE)
    if req.echo:
        raise invalid("echo is not supported", param="echo", code=Code.UNSUPPORTED_VALUE)
    if req.best_of not in (None, 1):
        raise invalid("best_of is not supported", param="best_of", code=Code.UNSUPPORTED_VALUE)
    if req.suffix:
        raise invalid("suffix is not supported", param="suffix", code=Code.UNSUPPORTED_VALUE)
    params, task_type, priority = _check_common(req, meta)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sub = Submit(
        request_id=request_id, model=req.model, kind=RequestKind.COMPLETION, prompt=prompt,
        params=params, max_tokens=max_tokens, priority=priority, task_type=task_type, api_key=meta.api_key,
    )
    _check_shape(sub)
    return sub, _context(req, RequestKind.COMPLETION, request_id)


def _check_shape(sub: Submit) -> None:
    """The same shape rules as for ZeroMQ submissions (router.admission), at once."""
    err = check_shape(sub)
    if err is not None:
        raise RequestError(err)


def _message_text(m: Message, i: int) -> str:
    content = m.content
    if isinstance(content, str):
        return content
    if content is None:
        raise invalid("Message content must be a string or a list of text parts", param=f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(f"Content part type {part.type!r} is not supported (only 'text')",
                          param=f"messages[{i}].content[{j}]", code=Code.UNSUPPORTED_VALUE)
        texts.append(part.text)
    return "\n".join(texts)  # vLLM joins text parts the same way


def parse_chat(body: bytes, meta: RequestMeta, request_id: str) -> tuple[Submit, ResponseContext]:
    req = _decode(_chat_decoder, body)
    messages = [ChatMessage(m.role, _message_text(m, i)) for i, m in enumerate(req.messages)]
    if req.top_logprobs:
        raise invalid("logprobs are not supported", param="top_logprobs", code=Code.UNSUPPORTED_VALUE)
    if req.tools:
        raise invalid("tools are not supported", param="tools", code=Code.UNSUPPORTED_VALUE)
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise invalid("response_format other than text is not supported", param="response_format",
                      code=Code.UNSUPPORTED_VALUE)
    params, task_type, priority = _check_common(req, meta)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sub = Submit(
        request_id=request_id, model=req.model, kind=RequestKind.CHAT, messages=messages,
        params=params, max_tokens=max_tokens, priority=priority, task_type=task_type, api_key=meta.api_key,
    )
    _check_shape(sub)
    return sub, _context(req, RequestKind.CHAT, request_id)


# ------------------------------------------------------------ responses

_enc = msgspec.json.Encoder()
encode = _enc.encode


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct, gc=False):
    index: int
    text: str
    logprobs: None
    finish_reason: Optional[str]


class Completion(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(msgspec.Struct, gc=False):
    role: str
    content: str


class ChatChoice(msgspec.Struct, gc=False):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Optional[str]


class ChatCompletion(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorBody(msgspec.Struct, gc=False):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorEnvelope(msgspec.Struct, gc=False):
    error: ErrorBody


def error_body(info: ErrorInfo) -> bytes:
    return encode(ErrorEnvelope(ErrorBody(info.message, info.type, info.param, info.code)))


def render_completion(ctx: ResponseContext, text: str, finish_reason: Optional[str],
                      prompt_tokens: int, completion_tokens: int) -> bytes:
    usage = Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    if ctx.kind == RequestKind.COMPLETION:
        return encode(Completion(ctx.id, "text_completion", ctx.created, ctx.model,
                                 [CompletionChoice(0, text, None, finish_reason)], usage))
    return encode(ChatCompletion(ctx.id, "chat.completion", ctx.created, ctx.model,
                                 [ChatChoice(0, AssistantMessage("assistant", text), None, finish_reason)], usage))


class TokenCounts:
    """Usage from Deltas: the engine's prompt count (first/last Delta) and the
    cumulative completion count, falling back to summing ``num_tokens``."""

    __slots__ = ("prompt", "completion", "summed")

    def __init__(self):
        self.prompt = self.completion = self.summed = 0

    def add(self, d: Delta) -> None:
        if d.prompt_tokens:
            self.prompt = d.prompt_tokens
        if d.completion_tokens > self.completion:
            self.completion = d.completion_tokens
        self.summed += d.num_tokens

    @property
    def completion_total(self) -> int:
        return max(self.completion, self.summed)


SSE_DONE = b"data: [DONE]\n\n"


class StreamRenderer:
    """Turns one request's Delta batches into SSE bytes (no HTTP framing).

    One ``render`` call per ``on_deltas`` batch: the batch's text becomes one
    chunk event (fewer events, same text), so the server writes it at once.
    """

    __slots__ = ("ctx", "counts", "_pre", "_post", "_usage_null", "_started", "finished")

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self.counts = TokenCounts()
        head = b'data: {"id":' + encode(ctx.id) + b',"object":'
        head += b'"text_completion"' if ctx.kind == RequestKind.COMPLETION else b'"chat.completion.chunk"'
        head += b',"created":' + str(ctx.created).encode() + b',"model":' + encode(ctx.model) + b',"choices":'
        self._pre = head  # followed by the choices array
        self._usage_null = b',"usage":null' if ctx.include_usage else b""
        self._started = False
        self.finished = False

    def _choice_event(self, body: bytes, finish_reason: Optional[str]) -> bytes:
        fr = b"null" if finish_reason is None else encode(finish_reason)
        return (self._pre + b'[{"index":0,' + body + b',"logprobs":null,"finish_reason":' + fr + b"}]"
                + self._usage_null + b"}\n\n")

    def render(self, deltas: list[Delta]) -> bytes:
        """SSE events for one batch; after the request's last Delta they end
        with the usage chunk (if asked for) or an error event, then [DONE]."""
        counts = self.counts
        texts = []
        tokens = 0
        for d in deltas:
            counts.add(d)
            tokens += d.num_tokens
            if d.text:
                texts.append(d.text)
        last = deltas[-1]
        finish = last.finish_reason
        error = last.error
        text = "".join(texts)
        out = []
        # A batch that carries tokens gets an event even when their text is
        # still empty (a byte-level BPE token can end mid-character): as vLLM's
        # server does, so a client sees the first token when it is made.
        if self.ctx.kind == RequestKind.COMPLETION:
            if text or tokens or (finish and error is None):
                out.append(self._choice_event(b'"text":' + encode(text), None if error else finish))
        else:
            if not self._started:
                out.append(self._choice_event(b'"delta":{"role":"assistant","content":""}', None))
            if text or tokens:
                out.append(self._choice_event(b'"delta":{"content":' + encode(text) + b"}", None))
            if finish and error is None:
                out.append(self._choice_event(b'"delta":{}', finish))
        self._started = True
        if error is not None:
            out.append(b"data: " + error_body(error) + b"\n\n")
            out.append(SSE_DONE)
            self.finished = True
        elif finish:
            if self.ctx.include_usage:
                out.append(self.usage_event())
            out.append(SSE_DONE)
            self.finished = True
        return b"".join(out)

    def usage_event(self) -> bytes:
        c = self.counts
        usage = Usage(c.prompt, c.completion_total, c.prompt + c.completion_total)
        return self._pre + b'[],"usage":' + encode(usage) + b"}\n\n"


def render_models(models: list[tuple[str, int, int]], created: int) -> bytes:
    """OpenAI's model list; weir adds each model's context and its workers ready now."""
    return encode({
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "weir", "max_model_len": max_len,
             "ready_workers": ready}
            for name, max_len, ready in models
        ],
    })
