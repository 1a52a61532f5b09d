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

Requests that ask for more than one text per choice-0 stream -- ``n`` > 1,
``logprobs``, ``echo`` -- are rendered by a separate, general path
(``StreamRenderer._render_rich``, ``Accumulator``): the plain path's cost is
unchanged by their existence.  Logprobs arrive compact (token ids + float32,
shared.protocol.Delta); their token strings come from the model's tokenizer
here (router.prompts.TokenText), as vLLM's server renders them.
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
    N,
    ChatMessage,
    Delta,
    ErrorInfo,
    LogitBias,
    MinP,
    NonNegativeInt,
    Penalty,
    PositiveInt,
    RepetitionPenalty,
    RequestKind,
    SamplingParams,
    Seed,
    StopList,
    StopTokenIds,
    StructuredOutput,
    Submit,
    TaskType,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    User,
    unpack_logprobs,
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


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: Optional[str] = None
    description: Optional[str] = None
    schema: msgspec.Raw = msgspec.Raw()  # kept as the client's JSON text (msgspec: Raw is never Optional)
    strict: Optional[bool] = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsBody(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` field (its other options are ignored)."""

    json: msgspec.Raw = msgspec.Raw()
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints.  Unknown fields are ignored (as
    OpenAI does); known ones weir cannot honour are refused, not dropped."""

    model: str
    max_tokens: Optional[PositiveInt] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    n: Optional[N] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, StopList, None] = None
    seed: Optional[Seed] = None
    user: Optional[User] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logit_bias: Optional[LogitBias] = None
    response_format: Optional[ResponseFormat] = None
    ignore_eos: Optional[bool] = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's sampling extensions
    top_k: Optional[TopK] = None
    min_p: Optional[MinP] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    min_tokens: Optional[NonNegativeInt] = None
    stop_token_ids: Optional[StopTokenIds] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: msgspec.Raw = msgspec.Raw()  # vLLM's older names for structured_outputs
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # weir extensions
    priority: Optional[str] = None  # a scheduler class; may only lower the key's
    task_type: Optional[Literal["short", "long"]] = None
    fallback: Optional[bool] = None  # another configured model may answer (or header x-weir-allow-fallback)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Union[str, list]  # list: validated below (one string only)
    logprobs: Optional[TopLogprobs] = None
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
    logprobs: Optional[bool] = False
    top_logprobs: Optional[TopLogprobs] = None
    tools: Optional[list[Any]] = None


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatRequest)

_AT_PATH = re.compile(r" - at `(?:key` in `)?\$\.?([^`]*)`$")  # "at `key` in `$.logit_bias`": a dict key
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
    param = path.replace("[...]", "") or None  # a dict's value ("logit_bias[...]"): the dict
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
    allow_fallback: bool = False


def meta_from_headers(
    authorization: Optional[str],
    x_api_key: Optional[str],
    x_weir_priority: Optional[str] = None,
    x_weir_task_type: Optional[str] = None,
    x_weir_allow_fallback: Optional[str] = None,
) -> RequestMeta:
    """``x-api-key`` wins over ``Authorization: Bearer`` because it is the
    header Envoy's per-key rate limit counts."""
    key = x_api_key.strip() if x_api_key else None
    if not key and authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer":
            key = token.strip() or None
    allow = (x_weir_allow_fallback or "").strip().lower() in ("1", "true", "yes")
    return RequestMeta(key or None, x_weir_priority or None, x_weir_task_type or None, allow)


_TASK_TYPES = {"short": TaskType.SHORT, "long": TaskType.LONG}


def _given(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


def _raw_text(raw: msgspec.Raw) -> str:
    """A JSON schema as text: an object as the client wrote it, a string's content."""
    data = bytes(raw)
    if data[:1] == b'"':
        return msgspec.json.decode(data, type=str)
    return data.decode()


def _structured(req: _Sampling) -> Optional[StructuredOutput]:
    """response_format, vLLM's structured_outputs or its guided_* fields -> one
    StructuredOutput (exactly one constraint; router.prompts compiles it)."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutput(json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or not _given(rf.json_schema.schema):
                raise invalid("response_format of type json_schema needs json_schema.schema",
                              param="response_format.json_schema")
            found.append(("response_format", StructuredOutput(json=_raw_text(rf.json_schema.schema))))
        else:
            raise invalid(f"response_format type {rf.type!r} is not supported (text, json_object, json_schema)",
                          param="response_format.type", code=Code.UNSUPPORTED_VALUE)
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", StructuredOutput(
            json=_raw_text(so.json) if _given(so.json) else None, json_object=bool(so.json_object),
            regex=so.regex, choice=so.choice or [], grammar=so.grammar)))
    for name, value in (("guided_json", req.guided_json if _given(req.guided_json) else None),
                        ("guided_regex", req.guided_regex),
                        ("guided_choice", req.guided_choice), ("guided_grammar", req.guided_grammar)):
        if value is not None:
            if name == "guided_json":
                found.append((name, StructuredOutput(json=_raw_text(value))))
            elif name == "guided_regex":
                found.append((name, StructuredOutput(regex=value)))
            elif name == "guided_choice":
                found.append((name, StructuredOutput(choice=value)))
            else:
                found.append((name, StructuredOutput(grammar=value)))
    if not found:
        return None
    if len(found) > 1:
        raise invalid(f"Only one structured-output constraint per request; got {', '.join(n for n, _ in found)}",
                      param=found[1][0])
    return found[0][1]


def _check_common(req: _Sampling, meta: RequestMeta,
                  logprobs: Optional[int] = None) -> tuple[Optional[SamplingParams], TaskType, Optional[str]]:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    if req.stop is None:
        stop: list[str] = []
    elif isinstance(req.stop, str):
        stop = [req.stop]
    else:
        stop = req.stop
    # Only fields the client set: an unset one keeps the wire default (omitted on the wire).
    kw: dict[str, Any] = {}
    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        kw["top_p"] = req.top_p
    if req.seed is not None:
        kw["seed"] = req.seed
    if stop:
        kw["stop"] = stop
    if req.ignore_eos:
        kw["ignore_eos"] = True
    if req.presence_penalty:
        kw["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        kw["frequency_penalty"] = req.frequency_penalty
    if req.n is not None and req.n != 1:
        kw["n"] = req.n
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if req.top_k is not None and req.top_k not in (0, -1):
        kw["top_k"] = req.top_k
    if req.min_p:
        kw["min_p"] = req.min_p
    if req.repetition_penalty is not None and req.repetition_penalty != 1.0:
        kw["repetition_penalty"] = req.repetition_penalty
    if req.min_tokens:
        kw["min_tokens"] = req.min_tokens
    if req.stop_token_ids:
        kw["stop_token_ids"] = req.stop_token_ids
    if req.logit_bias:
        kw["logit_bias"] = req.logit_bias
    structured = _structured(req)
    if structured is not None:
        kw["structured"] = structured
    params = SamplingParams(**kw) if kw else None  # max_tokens: the router sets it
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
    n: int = 1
    logprobs: Optional[int] = None  # top-k per token (0: the token's own only); None: no logprobs
    echo: str = ""  # completions with echo: the prompt, prepended to each choice's text
    token_text: Any = None  # token id -> text (router.prompts.TokenText), set by the ingress
    request_id: Optional[str] = None  # x-request-id, for an error event's body (set by the ingress)

    @property
    def rich(self) -> bool:
        """Needs the general renderer (several choices, logprobs or echo)."""
        return self.n > 1 or self.logprobs is not None or bool(self.echo)


_id_prefix = os.urandom(4).hex()
_id_counter = 0


def new_request_id() -> str:
    """Unique per process (random prefix + counter): cheap, and never collides
    with another router process's ids in logs."""
    global _id_counter
    _id_counter += 1
    return f"{_id_prefix}{_id_counter:x}"


def _context(req: _Sampling, kind: RequestKind, request_id: str, logprobs: Optional[int] = None,
             echo: str = "") -> ResponseContext:
    prefix = "cmpl-" if kind == RequestKind.COMPLETION else "chatcmpl-"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ResponseContext(prefix + request_id, kind, req.model, int(time.time()), bool(req.stream), include_usage,
                           req.n or 1, logprobs, echo)


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
    if req.echo and req.logprobs is not None:
        # OpenAI then also returns the prompt's logprobs; weir does not compute those
        raise invalid("echo together with logprobs is not supported (prompt logprobs)", param="echo",
                      code=Code.UNSUPPORTED_VALUE)
    if req.best_of not in (None, 1):
        raise invalid("best_of is not supported", param="best_of", code=Code.UNSUPPORTED_VALUE)
    if req.suffix:
        raise invalid("suffix is not supported", param="suffix", code=Code.UNSUPPORTED_VALUE)
    params, task_type, priority = _check_common(req, meta, req.logprobs)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sub = Submit(
        request_id=request_id, model=req.model, kind=RequestKind.COMPLETION, prompt=prompt,
        params=params, max_tokens=max_tokens, priority=priority, task_type=task_type, api_key=meta.api_key,
        user=req.user, allow_fallback=bool(req.fallback) or meta.allow_fallback,
    )
    _check_shape(sub)
    return sub, _context(req, RequestKind.COMPLETION, request_id, req.logprobs, prompt if req.echo else "")


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
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.tools:
        raise invalid("tools are not supported", param="tools", code=Code.UNSUPPORTED_VALUE)
    params, task_type, priority = _check_common(req, meta, logprobs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sub = Submit(
        request_id=request_id, model=req.model, kind=RequestKind.CHAT, messages=messages,
        params=params, max_tokens=max_tokens, priority=priority, task_type=task_type, api_key=meta.api_key,
        user=req.user, allow_fallback=bool(req.fallback) or meta.allow_fallback,
    )
    _check_shape(sub)
    return sub, _context(req, RequestKind.CHAT, request_id, logprobs)


# ------------------------------------------------------------ responses

_enc = msgspec.json.Encoder()
encode = _enc.encode


class PromptTokensDetails(msgspec.Struct, frozen=True, gc=False):
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (vLLM's num_cached_tokens)


_NO_DETAILS = PromptTokensDetails()


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = _NO_DETAILS


def _usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt, completion, prompt + completion,
                 PromptTokensDetails(cached) if cached else _NO_DETAILS)


class CompletionLogprobs(msgspec.Struct, gc=False):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


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


class CompletionChoice(msgspec.Struct, gc=False):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
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
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]


class ChatCompletion(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorBody(msgspec.Struct, gc=False, omit_defaults=True):
    message: str
    type: str
    param: Optional[str]  # (no default: always in the body, null or not, as OpenAI's)
    code: Optional[str]
    request_id: Optional[str] = None  # the x-request-id of its log lines (weir's addition)


class ErrorEnvelope(msgspec.Struct, gc=False):
    error: ErrorBody


def error_body(info: ErrorInfo, request_id: Optional[str] = None) -> bytes:
    return encode(ErrorEnvelope(ErrorBody(info.message, info.type, info.param, info.code, request_id)))


def render_completion(ctx: ResponseContext, text: str, finish_reason: Optional[str],
                      prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
    usage = _usage(prompt_tokens, completion_tokens, cached_tokens)
    if ctx.kind == RequestKind.COMPLETION:
        return encode(Completion(ctx.id, "text_completion", ctx.created, ctx.model,
                                 [CompletionChoice(0, text, None, finish_reason)], usage))
    return encode(ChatCompletion(ctx.id, "chat.completion", ctx.created, ctx.model,
                                 [ChatChoice(0, AssistantMessage("assistant", text), None, finish_reason)], usage))


# ------------------------------------------------------------ logprobs, n > 1, echo

MIN_LOGPROB = -9999.0  # what vLLM's server sends for -inf (JSON has no infinity)


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def token_id_text(tid: int) -> str:
    return f"token_id:{tid}"


def _utf8(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


class _Choice:
    """One choice's output so far (the general renderers)."""

    __slots__ = ("texts", "finish", "tokens", "values", "tops", "offset", "started")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.finish: Optional[str] = None
        self.tokens: list[int] = []  # with logprobs: every token's id...
        self.values: list[float] = []  # ...[logprob, top-1..top-k logprobs] per token
        self.tops: list[int] = []  # ...and the top-k ids
        self.offset = 0  # text_offset of the next token
        self.started = False  # chat stream: the role event went


def _add_logprobs(c: _Choice, d: Delta) -> None:
    if d.token_ids and d.logprobs:
        c.tokens.extend(d.token_ids)
        c.values.extend(unpack_logprobs(d.logprobs))
        c.tops.extend(d.top_ids)


def completion_logprobs(ctx: ResponseContext, c: _Choice, start: int = 0) -> CompletionLogprobs:
    """OpenAI's completions logprobs for c's tokens from ``start`` on (as
    vLLM: top_logprobs holds the sampled token and the top k)."""
    text = ctx.token_text
    k = ctx.logprobs or 0
    row = k + 1
    tokens, token_lps, tops, offsets = [], [], [], []
    values, top_ids = c.values, c.tops
    for i in range(start, len(c.tokens)):
        s = text(c.tokens[i])
        v = values[i * row]
        tokens.append(s)
        token_lps.append(_lp(v))
        top = {s: _lp(v)}
        for j in range(k):
            t = text(top_ids[i * k + j])
            if t not in top:
                top[t] = _lp(values[i * row + 1 + j])
        tops.append(top)
        offsets.append(c.offset)
        c.offset += len(s)
    return CompletionLogprobs(tokens, token_lps, tops, offsets)


def chat_logprobs(ctx: ResponseContext, c: _Choice, start: int = 0) -> ChatLogprobs:
    """OpenAI's chat logprobs (content[]: token, logprob, bytes, top_logprobs)."""
    text = ctx.token_text
    k = ctx.logprobs or 0
    row = k + 1
    values, top_ids = c.values, c.tops
    content = []
    for i in range(start, len(c.tokens)):
        s = text(c.tokens[i])
        top = []
        for j in range(k):
            t = text(top_ids[i * k + j])
            top.append(TopLogprob(t, _lp(values[i * row + 1 + j]), _utf8(t)))
        content.append(ChatTokenLogprob(s, _lp(values[i * row]), _utf8(s), top))
    return ChatLogprobs(content)


class Accumulator:
    """A non-streamed response of any shape: choices by index, logprobs, echo."""

    __slots__ = ("ctx", "counts", "choices")

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.counts = TokenCounts()
        self.choices = [_Choice() for _ in range(max(1, ctx.n))]

    def add(self, deltas: list[Delta]) -> None:
        lp = self.ctx.logprobs is not None
        choices = self.choices
        for d in deltas:
            self.counts.add(d)
            if d.index >= len(choices):
                continue  # an engine bug; never index past the request's n
            c = choices[d.index]
            if d.text:
                c.texts.append(d.text)
            if lp:
                _add_logprobs(c, d)
            if d.choice_finish is not None:
                c.finish = d.choice_finish
            if d.finish_reason is not None:
                for other in choices:  # the last choice's reason; an abort ends every open one
                    if other.finish is None:
                        other.finish = d.finish_reason

    def render(self) -> bytes:
        ctx = self.ctx
        c = self.counts
        usage = _usage(c.prompt, c.completion_total, c.cached)
        lp = ctx.logprobs is not None
        if ctx.kind == RequestKind.COMPLETION:
            return encode(Completion(ctx.id, "text_completion", ctx.created, ctx.model, [
                CompletionChoice(i, ctx.echo + "".join(ch.texts), completion_logprobs(ctx, ch) if lp else None,
                                 ch.finish) for i, ch in enumerate(self.choices)], usage))
        return encode(ChatCompletion(ctx.id, "chat.completion", ctx.created, ctx.model, [
            ChatChoice(i, AssistantMessage("assistant", "".join(ch.texts)), chat_logprobs(ctx, ch) if lp else None,
                       ch.finish) for i, ch in enumerate(self.choices)], usage))


class TokenCounts:
    """Usage from Deltas: the engine's prompt count (first/last Delta) and the
    cumulative completion count, falling back to summing ``num_tokens``."""

    __slots__ = ("prompt", "completion", "summed", "cached")

    def __init__(self):
        self.prompt = self.completion = self.summed = self.cached = 0

    def add(self, d: Delta) -> None:
        if d.prompt_tokens:
            self.prompt = d.prompt_tokens
            self.cached = d.cached_tokens
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

    __slots__ = ("ctx", "counts", "_pre", "_post", "_usage_null", "_started", "finished", "_choices")

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
        self._choices = [_Choice() for _ in range(max(1, ctx.n))] if ctx.rich else None

    def _choice_event(self, body: bytes, finish_reason: Optional[str]) -> bytes:
        fr = b"null" if finish_reason is None else encode(finish_reason)
        return (self._pre + b'[{"index":0,' + body + b',"logprobs":null,"finish_reason":' + fr + b"}]"
                + self._usage_null + b"}\n\n")

    def render(self, deltas: list[Delta]) -> bytes:
        """SSE events for one batch; after the request's last Delta they end
        with the usage chunk (if asked for) or an error event, then [DONE]."""
        if self._choices is not None:
            return self._render_rich(deltas)
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
            out.append(b"data: " + error_body(error, self.ctx.request_id) + b"\n\n")
            out.append(SSE_DONE)
            self.finished = True
        elif finish:
            if self.ctx.include_usage:
                out.append(self.usage_event())
            out.append(SSE_DONE)
            self.finished = True
        return b"".join(out)

    def _event(self, index: int, body: bytes, logprobs: Optional[bytes], finish_reason: Optional[str]) -> bytes:
        fr = b"null" if finish_reason is None else encode(finish_reason)
        return (self._pre + b'[{"index":' + str(index).encode() + b"," + body + b',"logprobs":'
                + (logprobs or b"null") + b',"finish_reason":' + fr + b"}]" + self._usage_null + b"}\n\n")

    def _render_rich(self, deltas: list[Delta]) -> bytes:
        """The general path: events per choice (index), logprobs, echo."""
        ctx = self.ctx
        choices = self._choices
        counts = self.counts
        lp = ctx.logprobs is not None
        news: dict[int, list] = {}  # index -> [texts, tokens, first new logprob row, finish]
        for d in deltas:
            counts.add(d)
            i = d.index
            if i >= len(choices):
                continue
            c = choices[i]
            item = news.get(i)
            if item is None:
                item = news[i] = [[], 0, len(c.tokens), None]
            if d.text:
                item[0].append(d.text)
            item[1] += d.num_tokens
            if lp:
                _add_logprobs(c, d)
            if d.choice_finish is not None:
                item[3] = c.finish = d.choice_finish
        last = deltas[-1]
        error = last.error
        finish = last.finish_reason
        if finish is not None and error is None:
            for i, c in enumerate(choices):
                if c.finish is None:
                    c.finish = finish
                    item = news.get(i)
                    if item is None:
                        item = news[i] = [[], 0, len(c.tokens), None]
                    item[3] = finish
        out = []
        chat = ctx.kind == RequestKind.CHAT
        if chat and not self._started:
            for i in range(len(choices)):
                out.append(self._event(i, b'"delta":{"role":"assistant","content":""}', None, None))
        for i in sorted(news):
            texts, tokens, start, fin = news[i]
            c = choices[i]
            text = "".join(texts)
            logprobs = None
            if lp and len(c.tokens) > start:
                logprobs = encode(chat_logprobs(ctx, c, start) if chat else completion_logprobs(ctx, c, start))
            if chat:
                if text or tokens:
                    out.append(self._event(i, b'"delta":{"content":' + encode(text) + b"}", logprobs, None))
                if fin is not None:
                    out.append(self._event(i, b'"delta":{}', None, fin))
            else:
                if ctx.echo and not c.started:
                    text = ctx.echo + text
                c.started = True
                if text or tokens or fin is not None:
                    out.append(self._event(i, b'"text":' + encode(text), logprobs, fin))
        self._started = True
        if error is not None:
            out.append(b"data: " + error_body(error, self.ctx.request_id) + b"\n\n")
            out.append(SSE_DONE)
            self.finished = True
        elif finish:
            if ctx.include_usage:
                out.append(self.usage_event())
            out.append(SSE_DONE)
            self.finished = True
        return b"".join(out)

    def usage_event(self) -> bytes:
        c = self.counts
        usage = _usage(c.prompt, c.completion_total, c.cached)
        return self._pre + b'[],"usage":' + encode(usage) + b"}\n\n"


def render_models(models: list[tuple[str, int, int, str]], created: int) -> bytes:
    """OpenAI's model list; weir adds each model's context, its workers ready
    now and its state (loading / ready / unloading: models at run time)."""
    return encode({
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "weir", "max_model_len": max_len,
             "ready_workers": ready, "state": state}
            for name, max_len, ready, state in models
        ],
    })
