"""SSE streaming: one request's Delta batches -> ``data:`` events.

Chunks are built from per-stream byte templates around a msgspec-encoded
text: 3x cheaper than encoding a Struct per event (0.2 vs 0.7 us measured)
and safe, because every variable part (id, model, text, finish reason) is
still JSON-encoded by msgspec.  Tests check the templates against plain JSON.

Requests that ask for more than one text per choice-0 stream -- ``n`` > 1,
``logprobs``, ``echo`` -- are rendered by a separate, general path
(``StreamRenderer._render_rich``): the plain path's cost is unchanged by
their existence.
"""

from __future__ import annotations

from typing import Any

from router.openai_api.context import ResponseContext
from router.openai_api.encoding import encode
from router.openai_api.errors import error_body
from router.openai_api.logprobs import ChoiceState, add_logprobs, chat_logprobs, completion_logprobs
from router.openai_api.tools import ChoiceToolStream, tool_finish_reason
from router.openai_api.usage import TokenCounts
from shared.protocol import Delta, RequestKind

SSE_DONE = b"data: [DONE]\n\n"


class StreamRenderer:
    """Turns one request's Delta batches into SSE bytes (no HTTP framing).

    One ``render`` call per ``on_deltas`` batch: the batch's text becomes one
    chunk event (fewer events, same text), so the server writes it at once.
    """

    __slots__ = ("ctx", "counts", "_pre", "_usage_null", "_started", "finished", "_choices", "_tools")

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.counts = TokenCounts()
        head = b'data: {"id":' + encode(ctx.id) + b',"object":'
        head += b'"text_completion"' if ctx.kind == RequestKind.COMPLETION else b'"chat.completion.chunk"'
        head += b',"created":' + str(ctx.created).encode() + b',"model":' + encode(ctx.model)
        head += b',"system_fingerprint":' + encode(ctx.fingerprint) + b',"choices":'
        self._pre = head  # followed by the choices array
        self._usage_null = b',"usage":null' if ctx.include_usage else b""
        self._started = False
        self.finished = False
        self._choices = [ChoiceState() for _ in range(max(1, ctx.n))] if ctx.rich else None
        spec = ctx.tools
        parses = spec is not None and spec.parses and ctx.kind == RequestKind.CHAT
        self._tools = [ChoiceToolStream(spec) for _ in range(max(1, ctx.n))] if parses else None

    def _choice_event(self, body: bytes, finish_reason: str | None) -> bytes:
        fr = b"null" if finish_reason is None else encode(finish_reason)
        return (
            self._pre
            + b'[{"index":0,'
            + body
            + b',"logprobs":null,"finish_reason":'
            + fr
            + b"}]"
            + self._usage_null
            + b"}\n\n"
        )

    def render(self, deltas: list[Delta]) -> bytes:
        """SSE events for one batch; after the request's last Delta they end
        with the usage chunk (if asked for) or an error event, then [DONE]."""
        if self._choices is not None:
            return self._render_rich(deltas, self._choices)
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

    def _event(self, index: int, body: bytes, logprobs: bytes | None, finish_reason: str | None) -> bytes:
        fr = b"null" if finish_reason is None else encode(finish_reason)
        return (
            self._pre
            + b'[{"index":'
            + str(index).encode()
            + b","
            + body
            + b',"logprobs":'
            + (logprobs or b"null")
            + b',"finish_reason":'
            + fr
            + b"}]"
            + self._usage_null
            + b"}\n\n"
        )

    def _render_rich(self, deltas: list[Delta], choices: list[ChoiceState]) -> bytes:
        """The general path: events per choice (index), logprobs, echo."""
        ctx = self.ctx
        counts = self.counts
        lp = ctx.logprobs is not None
        news: dict[int, list[Any]] = {}  # index -> [texts, tokens, first new logprob row, finish]
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
                add_logprobs(c, d)
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
            if chat and self._tools is not None:
                out.extend(self._tool_events(i, self._tools[i], text, logprobs, fin))
            elif chat:
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

    def _tool_events(
        self, i: int, stream: ChoiceToolStream, text: str, logprobs: bytes | None, fin: str | None
    ) -> list[bytes]:
        """A choice whose output may be tool calls: content and tool-call deltas."""
        bodies = stream.feed(text) if text else []
        if fin is not None:
            bodies += stream.finish()
        out = [
            self._event(i, b'"delta":' + encode(body), logprobs if k == 0 else None, None)
            for k, body in enumerate(bodies)
        ]
        if logprobs is not None and not bodies:
            out.append(self._event(i, b'"delta":{}', logprobs, None))
        if fin is not None:
            out.append(self._event(i, b'"delta":{}', None, tool_finish_reason(stream.spec, stream.called, fin)))
        return out

    def usage_event(self) -> bytes:
        return self._pre + b'[],"usage":' + encode(self.counts.usage()) + b"}\n\n"
