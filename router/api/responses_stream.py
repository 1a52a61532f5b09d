"""``/v1/responses`` output: the whole response object (``ResponsesAccumulator``)
and OpenAI's streamed events (``ResponsesStream``), from a turn's Deltas.

Streamed, a text answer is the event sequence OpenAI sends::

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per batch),
    response.output_text.done, response.content_part.done,
    response.output_item.done, response.completed

each as ``event: <type>`` + ``data: <json>`` with a ``sequence_number``
counting from 0 (no ``[DONE]``: OpenAI sends none for Responses).  With
tools, the turn is read as it is generated (router.api.tools.ChoiceToolStream)
and each function call is its own item as it forms::

    response.output_item.added (the call: id, call_id, name, arguments ""),
    response.function_call_arguments.delta (one per batch),
    response.function_call_arguments.done, response.output_item.done

after any text's message item.  A failure after the head is an ``error``
event then ``response.failed``.

The last event is held back (``final``) until the response is stored, so a
client that continues the moment it reads ``response.completed`` finds it.
"""

from __future__ import annotations

from typing import Any

from router.api.context import ResponseContext
from router.api.encoding import encode
from router.api.render import Accumulator
from router.api.responses import (
    Turn,
    message_item,
    response_object,
    status_of,
    usage_object,
)
from router.api.streaming import StreamRenderer
from router.api.tools import ChoiceToolStream, ToolCall, ToolPiece, extract_calls
from shared.protocol import Delta, ErrorInfo


def output_items(ctx: ResponseContext, turn: Turn, text: str) -> list[dict[str, Any]]:
    """A finished turn's output items: its text as one assistant message or,
    with tools, the calls the model's parser finds (router.api.tools,
    as chat reads them) as ``function_call`` items after any content."""
    spec = ctx.tools
    if spec is None or not spec.parses:
        return [message_item(turn, text, "completed")]
    content, calls = extract_calls(spec, text)
    items = [message_item(turn, content, "completed")] if content else []
    return items + [call_item(call, "completed") for call in calls]


def call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": "fc_" + call.id.rpartition("-")[2],
        "type": "function_call",
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments if status != "in_progress" else "",
        "status": status,
    }


def _error_object(err: ErrorInfo) -> dict[str, Any]:
    return {"code": err.code or err.type, "message": err.message}


class ResponsesAccumulator(Accumulator):
    """A whole (non-streamed) response object."""

    __slots__ = ("turn", "output", "finish", "error")

    def __init__(self, ctx: ResponseContext, turn: Turn) -> None:
        super().__init__(ctx)
        self.turn = turn
        self.output: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.error: ErrorInfo | None = None

    def response(self) -> dict[str, Any]:
        c = self.choices[0]
        self.output = output_items(self.ctx, self.turn, "".join(c.texts))
        status, incomplete = status_of(c.finish)
        return response_object(self.turn, status, self.output, usage_object(self.counts), incomplete)

    def render(self) -> bytes:
        return encode(self.response())


class ResponsesStream(StreamRenderer):
    """A turn's Delta batches as Responses events (``render`` per batch)."""

    __slots__ = ("turn", "seq", "texts", "reader", "items", "message_text", "final", "response", "output")

    def __init__(self, ctx: ResponseContext, turn: Turn) -> None:
        super().__init__(ctx)
        self.turn = turn
        self.seq = 0
        self.texts: list[str] = []
        spec = ctx.tools
        self.reader = ChoiceToolStream(spec) if spec is not None and spec.parses else None
        self.items: list[dict[str, Any]] = []  # with tools: the items opened so far, the last one open
        self.message_text = ""  # with tools: the message item's text so far
        self.final: bytes | None = None  # the last event, until stored (see the module's note)
        self.response: dict[str, Any] | None = None  # the finished object
        self.output: list[dict[str, Any]] = []

    def event(self, kind: str, body: dict[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(body) + b"\n\n"

    def _head(self) -> list[bytes]:
        started = response_object(self.turn, "in_progress", [], None)
        out = [self.event("response.created", {"response": started})]
        out.append(self.event("response.in_progress", {"response": started}))
        if self.reader is None:
            out += self._open_message()
        return out

    def _open_message(self, index: int = 0) -> list[bytes]:
        item = message_item(self.turn, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        ids = {"item_id": self.turn.message_id, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_item.added", {"output_index": index, "item": item}),
            self.event("response.content_part.added", {**ids, "part": part}),
        ]

    def _delta(self, text: str, index: int = 0) -> bytes:
        ids = {"item_id": self.turn.message_id, "output_index": index, "content_index": 0}
        return self.event("response.output_text.delta", {**ids, "delta": text, "logprobs": []})

    def _close(self, finish: str | None) -> list[bytes]:
        text = "".join(self.texts)
        if self.reader is not None:
            out = self._pieces(self.reader.finish())
            out += self._close_item()
            self.output = self.items
        else:
            self.output = output_items(self.ctx, self.turn, text)
            out = self._close_message(text)
        status, incomplete = status_of(finish)
        self.response = response_object(self.turn, status, self.output, usage_object(self.counts), incomplete)
        # response.completed whatever the status (incomplete included), as vLLM
        # sends it: the openai SDK's stream helper waits for that event alone
        self.final = self.event("response.completed", {"response": self.response})
        return out

    def _close_message(self, text: str, index: int = 0) -> list[bytes]:
        ids = {"item_id": self.turn.message_id, "output_index": index, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = message_item(self.turn, text, "completed")
        if self.reader is None:
            item = self.output[0]
        else:
            self.items[index] = item
        return [
            self.event("response.output_text.done", {**ids, "text": text, "logprobs": []}),
            self.event("response.content_part.done", {**ids, "part": part}),
            self.event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    # ------------------------------------------------- with tools: items as they form

    def _pieces(self, pieces: list[ToolPiece]) -> list[bytes]:
        """Content and calls read from the turn so far, as item events (events
        are encoded when made, so an item dict may grow after its event)."""
        out: list[bytes] = []
        for p in pieces:
            if p.index < 0:  # content: it comes before any call, so in the first item
                if not self.items:
                    self.items.append(message_item(self.turn, "", "in_progress"))
                    out += self._open_message()
                self.message_text += p.text
                out.append(self._delta(p.text))
                continue
            if p.head is not None:
                out += self._close_item()
                self.items.append(call_item(p.head, "in_progress"))
                index = len(self.items) - 1
                out.append(self.event("response.output_item.added", {"output_index": index, "item": self.items[index]}))
            if p.text:
                item = self.items[-1]
                item["arguments"] += p.text
                ids = {"item_id": item["id"], "output_index": len(self.items) - 1}
                out.append(self.event("response.function_call_arguments.delta", {**ids, "delta": p.text}))
        return out

    def _close_item(self) -> list[bytes]:
        """The open item's closing events (none open: nothing)."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        index = len(self.items) - 1
        item = self.items[index]
        if item["type"] == "message":
            return self._close_message(self.message_text, index)
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": index}
        done = {**ids, "arguments": item["arguments"], "name": item["name"]}
        return [
            self.event("response.function_call_arguments.done", done),
            self.event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _fail(self, err: ErrorInfo) -> list[bytes]:
        out = [self.event("error", {"code": err.code or err.type, "message": err.message, "param": err.param})]
        failed = response_object(self.turn, "failed", [], usage_object(self.counts), None, _error_object(err))
        out.append(self.event("response.failed", {"response": failed}))
        return out

    def render(self, deltas: list[Delta]) -> bytes:
        out = [] if self._started else self._head()
        self._started = True
        batch = []
        for d in deltas:
            self.counts.add(d)
            if d.text:
                batch.append(d.text)
        text = "".join(batch)
        if text:
            self.texts.append(text)
            if self.reader is None:
                out.append(self._delta(text))
            else:
                out += self._pieces(self.reader.feed(text))
        last = deltas[-1]
        if last.error is not None:
            out += self._fail(last.error)
            self.finished = True
        elif last.finish_reason is not None:
            out += self._close(last.finish_reason)
        return b"".join(out)

    def release_final(self) -> bytes:
        """The held-back last event (the response is stored, or not to be)."""
        final, self.final = self.final or b"", None
        self.finished = True
        return final
