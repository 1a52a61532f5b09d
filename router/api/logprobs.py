"""One choice's output as the general renderers collect it, and its logprobs
in OpenAI's two shapes (completions and chat).

Logprobs arrive compact (token ids + float32, shared.protocol.Delta); their
token strings come from the model's tokenizer (``ResponseContext.token_text``,
router.lifecycle.prompts.TokenText), as vLLM's server renders them.
"""

from __future__ import annotations

from router.api.chat import ChatLogprobs, ChatTokenLogprob, TopLogprob
from router.api.completions import CompletionLogprobs
from router.api.context import ResponseContext
from shared.protocol import Delta, unpack_logprobs

MIN_LOGPROB = -9999.0  # what vLLM's server sends for -inf (JSON has no infinity)


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def token_id_text(tid: int) -> str:
    return f"token_id:{tid}"


def _utf8(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


class ChoiceState:
    """One choice's output so far (the general renderers)."""

    __slots__ = ("texts", "finish", "tokens", "values", "tops", "offset", "started", "stop_reason", "ids", "prompt")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.finish: str | None = None
        self.tokens: list[int] = []  # with logprobs: every token's id...
        self.values: list[float] = []  # ...[logprob, top-1..top-k logprobs] per token
        self.tops: list[int] = []  # ...and the top-k ids
        self.offset = 0  # text_offset of the next token
        self.started = False  # chat stream: the role event went
        self.stop_reason: str | int | None = None  # the stop string / token id that ended it
        self.ids: list[int] = []  # return_token_ids: every generated token's id
        self.prompt: Delta | None = None  # echo with logprobs: the Delta with its prompt's logprobs


def add_logprobs(c: ChoiceState, d: Delta) -> None:
    if d.token_ids and d.logprobs:
        c.tokens.extend(d.token_ids)
        c.values.extend(unpack_logprobs(d.logprobs))
        c.tops.extend(d.top_ids)


def add_prompt_logprobs(ctx: ResponseContext, choices: list[ChoiceState], d: Delta) -> None:
    """Echo with logprobs: a Delta's prompt logprobs belong to every choice of
    its prompt (choices i * n .. i * n + n - 1); the first attempt's are kept
    (a resumed one's prompt holds the tokens already generated)."""
    n = ctx.echo_logprobs
    if not n or not d.prompt_top_ids:
        return
    first = d.index - d.index % n
    for c in choices[first : first + n]:
        if c.prompt is None:
            c.prompt = d


def completion_logprobs(
    ctx: ResponseContext, c: ChoiceState, start: int = 0, with_prompt: bool = False
) -> CompletionLogprobs:
    """OpenAI's completions logprobs for c's tokens from ``start`` on (as
    vLLM: top_logprobs holds the sampled token and the top k); ``with_prompt``
    (echo): its prompt's tokens first, the first of them without a logprob."""
    text = ctx.token_text
    k = ctx.logprobs or 0
    row = k + 1
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if with_prompt and c.prompt is not None:
        ids = c.prompt.prompt_top_ids
        pvalues = unpack_logprobs(c.prompt.prompt_logprobs)
        count = len(pvalues) // row + 1  # the prompt's tokens (the first has no row)
        ptops = ids[count:]
        for i in range(count):
            s = text(ids[i])
            tokens.append(s)
            offsets.append(c.offset)
            c.offset += len(s)
            if i == 0:
                token_lps.append(None)
                tops.append(None)
                continue
            v = pvalues[(i - 1) * row]
            token_lps.append(_lp(v))
            top = {s: _lp(v)}
            for j in range(k):
                t = text(ptops[(i - 1) * k + j])
                if t not in top:
                    top[t] = _lp(pvalues[(i - 1) * row + 1 + j])
            tops.append(top)
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


def chat_logprobs(ctx: ResponseContext, c: ChoiceState, start: int = 0) -> ChatLogprobs:
    """OpenAI's chat logprobs (content[]: token, logprob, bytes, top_logprobs)."""
    text = ctx.token_text
    k = ctx.logprobs or 0
    row = k + 1
    values, top_ids = c.values, c.tops
    content: list[ChatTokenLogprob] = []
    for i in range(start, len(c.tokens)):
        s = text(c.tokens[i])
        top: list[TopLogprob] = []
        for j in range(k):
            t = text(top_ids[i * k + j])
            top.append(TopLogprob(t, _lp(values[i * row + 1 + j]), _utf8(t)))
        content.append(ChatTokenLogprob(s, _lp(values[i * row]), _utf8(s), top))
    return ChatLogprobs(content)
