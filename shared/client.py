"""Direct ZeroMQ client for weir's router frontend: the lowest-latency path.

Same semantics and errors as the HTTP API: a refused request raises
``WeirError`` whose ``error`` carries the HTTP status it maps to (and
``retry_after`` on 429/503).  Leaving a stream early cancels the request on
the worker.

    with Client("tcp://127.0.0.1:5555") as c:
        print(c.complete("tiny-llama", prompt="Hello", max_tokens=8).text)

    async with AsyncClient("tcp://127.0.0.1:5555") as c:
        async for delta in c.stream("tiny-llama", prompt="Hello", max_tokens=8):
            print(delta.text, end="")

Every sampling field of the HTTP API works here too, under vLLM's names:
``n``, ``logprobs`` (k), ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``logit_bias`` ({token id: bias}),
``structured`` (a ``StructuredOutput`` or a dict of vLLM's
``structured_outputs`` fields; ``json`` may be a schema dict), ``user``;
``complete(..., echo=True)`` prepends the prompt as the HTTP API's echo does.
Deltas carry their choice's ``index``; ``token_logprobs(delta, k)`` unpacks
a Delta's logprobs into (token id, logprob, [(top id, logprob)...]).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from shared import protocol as p
from shared.errors import Code
from shared.otlp import parse_traceparent
from shared.transport import SocketPump

# A Cancel queued just before close() must still reach the router, even if
# this process is descheduled for a while. close() returns at once; only a
# context shutdown with the router unreachable waits up to this long.
CLOSE_LINGER_MS = 2000


class WeirError(Exception):
    def __init__(self, error: p.ErrorInfo) -> None:
        super().__init__(f"{error.status} {error.type}: {error.message}")
        self.error = error
        self.status = error.status


TokenLogprob = tuple[int, float, list[tuple[int, float]]]  # id, logprob, top k (id, logprob)
Messages = Sequence[p.ChatMessage | dict[str, str]]  # dicts as OpenAI spells them: {"role", "content"}
TaskTypeArg = str | p.TaskType | None  # a name ("chat", ...) or the enum


@dataclass
class Completion:
    text: str  # choice 0's
    finish_reason: str | None  # the request's (its last choice's)
    prompt_tokens: int
    completion_tokens: int  # all choices together
    texts: list[str] = field(default_factory=list)  # every choice's, by index
    finish_reasons: list[str | None] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # by index, when asked for
    model: str = ""  # the fallback model that answered (asked with fallback=True); "": the one asked for
    ratelimit: p.RateLimit | None = None  # the key's budgets, where it has any (the x-ratelimit-* figures)
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache


def token_logprobs(d: p.Delta, k: int) -> list[TokenLogprob]:
    """A Delta's logprobs (requested with ``logprobs=k``), one entry per token."""
    if not d.logprobs:
        return []
    vals = p.unpack_logprobs(d.logprobs)
    row = k + 1
    return [
        (tid, vals[t * row], [(d.top_ids[t * k + j], vals[t * row + 1 + j]) for j in range(k)])
        for t, tid in enumerate(d.token_ids)
    ]


def _params(params: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-style spellings a caller may use -> the wire's types."""
    lb = params.get("logit_bias")
    if lb:
        params["logit_bias"] = {int(k): float(v) for k, v in lb.items()}
    so = params.get("structured")
    if isinstance(so, dict):
        so = dict(so)
        if isinstance(so.get("json"), (dict, bool)):
            so["json"] = json.dumps(so["json"])
        params["structured"] = p.StructuredOutput(**so)
    return params


def _submit(
    request_id: str,
    model: str,
    prompt: str | None,
    messages: Messages | None,
    max_tokens: int | None,
    priority: str | None,
    task_type: TaskTypeArg,
    api_key: str | None,
    user: str | None = None,
    fallback: bool = False,
    trace_id: str | None = None,
    routing: p.Routing | None = None,  # sessions, gateway priorities, latency targets (docs/api.md)
    traceparent: str | None = None,
    tracestate: str | None = None,
    **params: Any,
) -> p.Submit:
    chat = messages is not None
    return p.Submit(
        request_id=request_id,
        model=model,
        kind=p.RequestKind.CHAT if chat else p.RequestKind.COMPLETION,
        prompt=prompt or "",
        messages=[m if isinstance(m, p.ChatMessage) else p.ChatMessage(m["role"], m["content"]) for m in messages]
        if messages is not None
        else [],
        params=p.SamplingParams(**_params(params)) if params else None,
        max_tokens=max_tokens,
        priority=priority,
        task_type=p.TaskType[task_type.upper()] if isinstance(task_type, str) else (task_type or p.TaskType.AUTO),
        api_key=api_key,
        user=user,
        allow_fallback=bool(fallback),
        trace_id=trace_id,  # the request id of the router's and worker's log lines
        routing=routing,
        # W3C trace context: the router's spans of this request join the caller's trace
        trace_context=parse_traceparent(traceparent.encode(), tracestate.encode() if tracestate else None)
        if traceparent
        else None,
    )


def _is_final(d: p.Delta) -> bool:
    return d.finish_reason is not None or d.error is not None


def _collect(deltas: Iterable[p.Delta], n: int = 1, k: int | None = None, echo: str = "") -> Completion:
    texts: list[list[str]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)] if k is not None else []
    last: p.Delta | None = None
    model = ""
    rl: p.RateLimit | None = None
    for d in deltas:
        model = model or d.model
        rl = rl or d.ratelimit
        texts[d.index].append(d.text)
        if d.choice_finish is not None:
            finish[d.index] = d.choice_finish
        if k is not None:
            lps[d.index].extend(token_logprobs(d, k))
        last = d
    assert last is not None, "a stream ends with its final Delta or raises"
    for i in range(n):
        if finish[i] is None:
            finish[i] = last.finish_reason
    out = [echo + "".join(t) for t in texts]
    return Completion(
        out[0],
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
        out,
        finish,
        lps,
        model,
        rl,
        last.cached_tokens,
    )


def _moves(err: p.ErrorInfo, produced: bool) -> bool:
    """A refusal this client answers by sending the request to its next router: a router
    shutting down refused it before starting anything, so another may take it."""
    return err.code == Code.ROUTER_DRAINING.wire and not produced


class _Base:
    def __init__(self, address: str | Sequence[str], api_key: str | None, curve: tuple[str, str] | None = None) -> None:
        # Several routers: requests go to one until it drains (its refusal
        # router_draining, before any output), then to the next.
        self.addresses = [address] if isinstance(address, str) else list(address)
        if not self.addresses:
            raise ValueError("no router address")
        self.address, self.api_key = self.addresses[0], api_key
        self._current = 0  # index of the router new requests go to
        # CURVE (shared.curve): (this client's .key_secret file, the router's public .key file)
        self.curve = curve

    def _next_router(self) -> None:
        self._current = (self._current + 1) % len(self.addresses)
        self.address = self.addresses[self._current]

    def _secure(self, sock: zmq.Socket[bytes]) -> None:
        if self.curve is not None:
            from shared.curve import client_socket

            client_socket(sock, *self.curve)
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"


class _Stream:
    """One request's undelivered Deltas and the future its reader sleeps on:
    lighter than an ``asyncio.Queue`` (no getter/putter bookkeeping), which
    shows at tens of thousands of requests per second."""

    __slots__ = ("deltas", "waiter")

    def __init__(self) -> None:
        self.deltas: collections.deque[p.Delta] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None


class AsyncClient(_Base):
    """Many concurrent requests over one DEALER socket, driven by a SocketPump."""

    def __init__(
        self,
        address: str | Sequence[str] = "tcp://127.0.0.1:5555",
        api_key: str | None = None,
        curve: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(address, api_key, curve)
        self._streams: dict[str, _Stream] = {}
        self._socks: list[zmq.Socket[bytes]] = []  # one per router address
        self._sock: zmq.Socket[bytes] | None = None  # the current router's
        self._pump: SocketPump | None = None

    async def __aenter__(self) -> AsyncClient:
        self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pump = SocketPump(asyncio.get_running_loop())
        for address in self.addresses:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            self._secure(sock)
            sock.connect(address)
            self._pump.add(sock, self._on_message)
            self._socks.append(sock)
        self._sock = self._socks[self._current]

    def close(self) -> None:
        if self._sock is not None:
            if self._pump is not None:
                if self._streams:  # (each router ignores the ids it does not have)
                    for sock in self._socks:
                        self._send(p.Cancel(request_ids=list(self._streams)), sock)
                for sock in self._socks:
                    self._pump.remove(sock)
            for sock in self._socks:
                sock.close(linger=CLOSE_LINGER_MS)
            self._socks = []
            self._sock = None

    def _send(self, msg: p.Submit | p.Cancel, sock: zmq.Socket[bytes] | None = None) -> None:
        sock = sock or self._sock
        if sock is None or self._pump is None:
            raise RuntimeError("AsyncClient: not connected (use `async with` or connect())")
        self._pump.send(sock, [p.encoder.encode(msg)])

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = p.to_client_decoder.decode(frames[-1])
        except msgspec.DecodeError:
            return
        streams = self._streams
        for d in msg.deltas:
            s = streams.get(d.request_id)
            if s is not None:
                s.deltas.append(d)
                w = s.waiter
                if w is not None:
                    s.waiter = None
                    if not w.done():
                        w.set_result(None)

    async def stream(
        self,
        model: str,
        prompt: str | None = None,
        messages: Messages | None = None,
        max_tokens: int | None = None,
        priority: str | None = None,
        task_type: TaskTypeArg = None,
        **params: Any,
    ) -> AsyncIterator[p.Delta]:
        """Yield Deltas until the final one; raises WeirError on an error."""
        if self._pump is None:
            raise RuntimeError("AsyncClient: not connected (use `async with` or connect())")
        rid = self._new_id()
        s = self._streams[rid] = _Stream()
        deltas = s.deltas
        loop = self._pump.loop
        done = produced = False
        sock = self._sock
        tries = len(self.addresses)
        try:
            self._send(_submit(rid, model, prompt, messages, max_tokens, priority, task_type, self.api_key, **params))
            while True:
                if not deltas:
                    s.waiter = waiter = loop.create_future()
                    await waiter
                d = deltas.popleft()
                if d.error is not None:
                    tries -= 1
                    if tries > 0 and _moves(d.error, produced):
                        self._move(sock)
                        sock = self._sock
                        sub = _submit(
                            rid, model, prompt, messages, max_tokens, priority, task_type, self.api_key, **params
                        )
                        self._send(sub)
                        continue
                    done = True
                    raise WeirError(d.error)
                produced = True
                done = _is_final(d)
                yield d
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            if not done and sock is not None and self._socks:
                self._send(p.Cancel(request_ids=[rid]), sock)

    def _move(self, draining: zmq.Socket[bytes] | None) -> None:
        """The router behind ``draining`` drains: new requests to the next one
        (unless an earlier request moved on already)."""
        if draining is self._sock:
            self._next_router()
            self._sock = self._socks[self._current]

    async def complete(
        self, model: str, prompt: str | None = None, messages: Messages | None = None, echo: bool = False, **kw: Any
    ) -> Completion:
        return _collect(
            [d async for d in self.stream(model, prompt, messages, **kw)],
            kw.get("n", 1),
            kw.get("logprobs"),
            (prompt or "") if echo else "",
        )


class Client(_Base):
    """Blocking client, one request at a time (for scripts and tests)."""

    def __init__(
        self,
        address: str | Sequence[str] = "tcp://127.0.0.1:5555",
        api_key: str | None = None,
        timeout_s: float = 300.0,
        curve: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(address, api_key, curve)
        self.timeout_ms = int(timeout_s * 1000)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: list[zmq.Socket[bytes]] = []
        for addr in self.addresses:  # one per router; requests go to the current one's
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            self._secure(sock)
            sock.connect(addr)
            self._socks.append(sock)
        self._sock = self._socks[0]

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=CLOSE_LINGER_MS)

    def _send_within_timeout(self, payload: bytes) -> None:
        """A DEALER with no live connection (router down, or CURVE refused us)
        blocks on send -- even after a poll said writable, when the pipe went
        with a failed handshake in between (a test hung there): never block."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0 or not self._sock.poll(left, zmq.POLLOUT):
                raise TimeoutError(f"could not send to {self.address} in {self.timeout_ms} ms")
            try:
                self._sock.send(payload, zmq.NOBLOCK)
                return
            except zmq.Again:
                continue

    def stream(
        self,
        model: str,
        prompt: str | None = None,
        messages: Messages | None = None,
        max_tokens: int | None = None,
        priority: str | None = None,
        task_type: TaskTypeArg = None,
        **params: Any,
    ) -> Iterator[p.Delta]:
        rid = self._new_id()
        submit = p.encoder.encode(
            _submit(rid, model, prompt, messages, max_tokens, priority, task_type, self.api_key, **params)
        )
        self._send_within_timeout(submit)
        done = produced = False
        tries = len(self.addresses)
        try:
            while not done:
                if not self._sock.poll(self.timeout_ms):
                    raise TimeoutError(f"no reply from {self.address} in {self.timeout_ms} ms")
                try:
                    msg = p.to_client_decoder.decode(self._sock.recv())
                except msgspec.DecodeError:
                    continue
                for d in msg.deltas:
                    if d.request_id != rid:
                        continue  # late news of an earlier, abandoned request
                    if d.error is not None:
                        tries -= 1
                        if tries > 0 and _moves(d.error, produced):  # that router drains: the next one
                            self._next_router()
                            self._sock = self._socks[self._current]
                            self._send_within_timeout(submit)
                            break
                        done = True
                        raise WeirError(d.error)
                    produced = True
                    done = _is_final(d)
                    yield d
        finally:
            if not done:
                try:
                    self._sock.send(p.encoder.encode(p.Cancel(request_ids=[rid])), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no connection to carry it: the router probes its waiting clients anyway

    def complete(
        self, model: str, prompt: str | None = None, messages: Messages | None = None, echo: bool = False, **kw: Any
    ) -> Completion:
        return _collect(
            self.stream(model, prompt, messages, **kw),
            kw.get("n", 1),
            kw.get("logprobs"),
            (prompt or "") if echo else "",
        )
