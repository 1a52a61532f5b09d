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

from router.api.context import ResponseContext
from router.api.encoding import encode
from router.api.errors import error_body
from router.api.logprobs import ChoiceState, add_logprobs, add_prompt_logprobs, chat_logprobs, completion_logprobs
from router.api.tools import ChoiceToolStream, chat_deltas, tool_finish_reason
from router.api.usage import TokenCounts
from shared.protocol import Delta, ErrorInfo, RequestKind

SSE_DONE = b"data: [DONE]\n\n"
_STOP_NULL = b',"stop_reason":null'


class StreamRenderer:
    """Turns one request's Delta batches into SSE bytes (no HTTP framing).

    One ``render`` call per ``on_deltas`` batch: the batch's text becomes one
    chunk event (fewer events, same text), so the server writes it at once.
    """

    __slots__ = ("ctx", "counts", "_pre", "_usage_null", "_started", "finished", "_choices", "_tools", "_prompt_ids")

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
        self._prompt_ids: list[int] = []  # return_token_ids: from the first Delta

    def _choice_event(self, body: bytes, finish_reason: str | None, stop: bytes = b"") -> bytes:
        fr = b"null" if finish_reason is None else encode(finish_reason)
        return (
            self._pre
            + b'[{"index":0,'
            + body
            + b',"logprobs":null,"finish_reason":'
            + fr
            + stop
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
        # vLLM's stop_reason: on every completions chunk, on chat's finishing one
        reason = last.stop_reason if finish and error is None else None
        stop = _STOP_NULL if reason is None else b',"stop_reason":' + encode(reason)
        if self.ctx.kind == RequestKind.COMPLETION:
            if text or tokens or (finish and error is None):
                out.append(self._choice_event(b'"text":' + encode(text), None if error else finish, stop))
        else:
            if not self._started:
                out.append(self._choice_event(b'"delta":{"role":"assistant","content":""}', None))
            if text or tokens:
                out.append(self._choice_event(b'"delta":{"content":' + encode(text) + b"}", None))
            if finish and error is None:
                out.append(self._choice_event(b'"delta":{}', finish, stop))
        self._started = True
        self._end(out, error, finish)
        return b"".join(out)

    def _end(self, out: list[bytes], error: ErrorInfo | None, finish: str | None) -> None:
        """The stream's last events: an error event, or (usage and) ``[DONE]``."""
        if error is not None:
            out.append(b"data: " + error_body(error, self.ctx.request_id) + b"\n\n")
            out.append(SSE_DONE)
            self.finished = True
        elif finish:
            if self.ctx.include_usage:
                out.append(self.usage_event())
            out.append(SSE_DONE)
            self.finished = True

    def _event(
        self,
        index: int,
        body: bytes,
        logprobs: bytes | None,
        finish_reason: str | None,
        extra: bytes = b"",
        top: bytes = b"",
    ) -> bytes:
        """One choice's chunk; ``extra``: more of the choice's fields (",..."),
        ``top``: more of the chunk's."""
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
            + extra
            + b"}]"
            + self._usage_null
            + top
            + b"}\n\n"
        )

    def _render_rich(self, deltas: list[Delta], choices: list[ChoiceState]) -> bytes:
        """The general path: events per choice (index), logprobs, echo."""
        ctx = self.ctx
        counts = self.counts
        lp = ctx.logprobs is not None
        want_ids = ctx.return_token_ids
        # index -> [texts, tokens, first new logprob row, finish, first new id]
        news: dict[int, list[Any]] = {}
        for d in deltas:
            counts.add(d)
            if want_ids and d.prompt_token_ids:
                self._prompt_ids = d.prompt_token_ids
            i = d.index
            if i >= len(choices):
                continue
            c = choices[i]
            item = news.get(i)
            if item is None:
                item = news[i] = [[], 0, len(c.tokens), None, len(c.ids)]
            if d.text:
                item[0].append(d.text)
            item[1] += d.num_tokens
            if lp:
                add_logprobs(c, d)
                add_prompt_logprobs(ctx, choices, d)
            if want_ids and d.token_ids:
                c.ids.extend(d.token_ids)
            if d.choice_finish is not None:
                item[3] = c.finish = d.choice_finish
                c.stop_reason = d.stop_reason
        last = deltas[-1]
        error = last.error
        finish = last.finish_reason
        if finish is not None and error is None:
            if last.index < len(choices) and choices[last.index].finish is None:
                choices[last.index].stop_reason = last.stop_reason
            for i, c in enumerate(choices):
                if c.finish is None:
                    c.finish = finish
                    item = news.get(i)
                    if item is None:
                        item = news[i] = [[], 0, len(c.tokens), None, len(c.ids)]
                    item[3] = finish
        out = []
        chat = ctx.kind == RequestKind.CHAT
        if chat and not self._started:
            # (vLLM: the prompt's ids ride on the role chunks)
            top = b',"prompt_token_ids":' + encode(self._prompt_ids) if want_ids else b""
            for i in range(len(choices)):
                out.append(self._event(i, b'"delta":{"role":"assistant","content":""}', None, None, top=top))
        for i in sorted(news):
            texts, tokens, start, fin, first_id = news[i]
            c = choices[i]
            text = "".join(texts)
            logprobs = None
            echo_lp = not chat and not c.started and c.prompt is not None  # (echo: the prompt's logprobs first)
            if lp and (len(c.tokens) > start or echo_lp):
                logprobs = encode(chat_logprobs(ctx, c, start) if chat else completion_logprobs(ctx, c, start, echo_lp))
            ids = b',"token_ids":' + encode(c.ids[first_id:]) if want_ids else b""
            stop = b',"stop_reason":' + encode(c.stop_reason)
            if chat and self._tools is not None:
                out.extend(self._tool_events(i, self._tools[i], text, logprobs, fin, ids, stop))
            elif chat:
                if text or tokens:
                    out.append(self._event(i, b'"delta":{"content":' + encode(text) + b"}", logprobs, None, ids))
                if fin is not None:
                    out.append(self._event(i, b'"delta":{}', None, fin, stop + (b',"token_ids":[]' if ids else b"")))
            else:
                if ctx.echo and not c.started:
                    text = ctx.echo + text
                if want_ids and not c.started:  # (vLLM: the prompt's ids on each choice's first chunk)
                    ids = b',"prompt_token_ids":' + encode(self._prompt_ids) + ids
                c.started = True
                if text or tokens or fin is not None:
                    out.append(self._event(i, b'"text":' + encode(text), logprobs, fin, stop + ids))
        self._started = True
        self._end(out, error, finish)
        return b"".join(out)

    def _tool_events(
        self,
        i: int,
        stream: ChoiceToolStream,
        text: str,
        logprobs: bytes | None,
        fin: str | None,
        ids: bytes = b"",
        stop: bytes = b"",
    ) -> list[bytes]:
        """A choice whose output may be tool calls: content and tool-call deltas
        (the batch's logprobs and token ids on the first)."""
        pieces = stream.feed(text) if text else []
        if fin is not None:
            pieces += stream.finish()
        bodies = chat_deltas(pieces)
        out = [
            self._event(i, b'"delta":' + encode(body), logprobs if k == 0 else None, None, ids if k == 0 else b"")
            for k, body in enumerate(bodies)
        ]
        if (logprobs is not None or ids) and not bodies:
            out.append(self._event(i, b'"delta":{}', logprobs, None, ids))
        if fin is not None:
            finish = tool_finish_reason(stream.spec, stream.called, fin)
            out.append(self._event(i, b'"delta":{}', None, finish, stop + (b',"token_ids":[]' if ids else b"")))
        return out

    def usage_event(self) -> bytes:
        return self._pre + b'[],"usage":' + encode(self.counts.usage()) + b"}\n\n"
