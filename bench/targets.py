"""Where requests go: weir over HTTP (via Envoy or straight to the router),
weir over ZeroMQ (``shared.client``), or any OpenAI-compatible server.

A target turns a planned request into a wire request once, before the clock
starts (``prepare``), then ``send`` fills a ``Record`` as the answer arrives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

from .httpclient import HttpError, Pool
from .metrics import OK, TRANSPORT_ERROR, Record
from .spec import RequestClass

_clock = time.perf_counter

KINDS = ("envoy", "router", "zmq", "openai")


@dataclass(slots=True)
class Planned:
    """One request of the run, fixed before it starts."""

    index: int
    cls: RequestClass
    prompt: str
    max_tokens: int
    model: str
    api_key: str | None = None  # the class's, or one of its tenants'
    wire: object = None  # the target's prepared form


# -------------------------------------------------------------- OpenAI SSE


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Delta(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    message: _Delta | None = None
    finish_reason: str | None = None


class _Err(msgspec.Struct):
    message: str = ""
    code: object | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Err | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def _carries_output(ch: _Choice) -> bool:
    """Does this choice chunk stand for generated output?  As in ``vllm
    bench serve``, every completion chunk does -- even one with empty text:
    a byte-level BPE token may not decode to text yet, and vLLM sends one
    chunk per token.  A chat chunk does when it has content, except the
    role-only opener (``{"role": "assistant", "content": ""}``); a closing
    ``delta: {}`` that only carries the finish reason does not."""
    if ch.text is not None:
        return True
    d = ch.delta if ch.delta is not None else ch.message
    if d is None or d.content is None:
        return False
    return not (d.role and not d.content)


class HttpTarget:
    """OpenAI-compatible HTTP: POST /v1/completions or /v1/chat/completions.

    ``url`` is a base URL: ``http://host:port`` (``/v1`` is added) or an
    OpenAI-style ``http://host:port/v1``."""

    def __init__(self, kind: str, url: str, api_key: str | None = None, max_connections: int = 4096):
        self.kind = kind
        self.url = url
        u = urlsplit(url)
        base = u.path.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.paths = {False: base + "/completions", True: base + "/chat/completions"}
        self.default_key = api_key
        self.pool = Pool(url, limit=max_connections)

    def describe(self) -> str:
        return f"{self.kind} {self.url}"

    async def start(self, connections: int) -> None:
        await self.pool.warm(connections)

    async def close(self) -> None:
        await self.pool.close()

    def prepare(self, p: Planned) -> None:
        c = p.cls
        body: dict = {"model": p.model, "max_tokens": p.max_tokens, "temperature": c.temperature}
        if c.chat:
            body["messages"] = [{"role": "user", "content": p.prompt}]
        else:
            body["prompt"] = p.prompt
        if c.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if c.ignore_eos:
            body["ignore_eos"] = True
        if c.priority is not None:
            body["priority"] = c.priority
        if c.task_type is not None:
            body["task_type"] = c.task_type
        key = p.api_key or self.default_key
        headers = b""
        if key:
            headers = b"Authorization: Bearer %s\r\nx-api-key: %s\r\n" % (key.encode(), key.encode())
        p.wire = (self.paths[c.chat], msgspec.json.encode(body), headers)

    async def send(self, p: Planned, rec: Record) -> None:
        path, body, headers = p.wire

        def on_event(data: bytes, t: float) -> None:
            if data == b"[DONE]":
                return
            try:
                ch = _chunk_decoder.decode(data)
            except msgspec.DecodeError:
                rec.error = f"undecodable SSE event: {data[:200]!r}"
                return
            if ch.error is not None:
                rec.error = f"error event: {ch.error.message}"
                return
            if ch.usage is not None:
                rec.prompt_tokens = ch.usage.prompt_tokens
                rec.output_tokens = ch.usage.completion_tokens
            for c in ch.choices:
                if c.finish_reason:
                    rec.finish_reason = c.finish_reason
                if _carries_output(c):
                    rec.output_event(t)

        rec.start = _clock()
        try:
            resp = await self.pool.post(path, body, headers, on_event)
        except HttpError as e:
            rec.end = _clock()
            rec.status = TRANSPORT_ERROR
            rec.error = str(e)
            return
        rec.end = _clock()
        rec.status = resp.status
        ra = resp.headers.get(b"retry-after")
        if ra:
            try:
                rec.retry_after = float(ra)
            except ValueError:
                pass
        if resp.status != OK:
            rec.error = f"HTTP {resp.status}: {bytes(resp.body[:300]).decode(errors='replace')}"
            return
        if resp.sse:
            if rec.error is not None:
                rec.status = TRANSPORT_ERROR  # the stream carried an error
            elif not rec.output_tokens:
                rec.output_tokens = rec.events  # no usage chunk: count events
            return
        try:
            ch = _chunk_decoder.decode(resp.body)
        except msgspec.DecodeError:
            rec.status = TRANSPORT_ERROR
            rec.error = f"undecodable body: {bytes(resp.body[:200])!r}"
            return
        if ch.usage is not None:
            rec.prompt_tokens = ch.usage.prompt_tokens
            rec.output_tokens = ch.usage.completion_tokens
        if ch.choices:
            rec.finish_reason = ch.choices[0].finish_reason
        # Not streamed: when the first token was made is not observable
        # (TTFT and TPOT stay unset; an SLO on TTFT is judged by E2E).


# -------------------------------------------------------------- ZeroMQ


class ZmqTarget:
    """weir's direct ZeroMQ client: one DEALER socket per API key."""

    def __init__(self, address: str, api_key: str | None = None, curve: tuple[str, str] | None = None):
        self.kind = "zmq"
        self.address = address
        self.curve = curve  # (client .key_secret, router .key): shared.curve
        self.default_key = api_key
        self._clients: dict[str | None, object] = {}

    def describe(self) -> str:
        return f"zmq {self.address}"

    async def _client(self, key: str | None):
        c = self._clients.get(key)
        if c is None:
            from shared.client import AsyncClient

            c = AsyncClient(self.address, api_key=key, curve=self.curve)
            await c.__aenter__()
            self._clients[key] = c
        return c

    async def start(self, connections: int) -> None:
        await self._client(self.default_key)

    async def close(self) -> None:
        for c in self._clients.values():
            await c.__aexit__(None, None, None)
        self._clients.clear()

    def prepare(self, p: Planned) -> None:
        c = p.cls
        kw = dict(max_tokens=p.max_tokens, temperature=c.temperature, ignore_eos=c.ignore_eos)
        if c.chat:
            kw["messages"] = [{"role": "user", "content": p.prompt}]
        else:
            kw["prompt"] = p.prompt
        if c.priority is not None:
            kw["priority"] = c.priority
        if c.task_type is not None:
            kw["task_type"] = c.task_type
        p.wire = (p.api_key or self.default_key, kw)

    async def send(self, p: Planned, rec: Record) -> None:
        from shared.client import WeirError

        key, kw = p.wire
        client = await self._client(key)
        rec.start = _clock()
        try:
            async for d in client.stream(p.model, **kw):
                t = _clock()
                if d.num_tokens or d.text:
                    rec.output_event(t)
                if d.prompt_tokens:
                    rec.prompt_tokens = d.prompt_tokens
                if d.completion_tokens:
                    rec.output_tokens = d.completion_tokens
                if d.finish_reason:
                    rec.finish_reason = d.finish_reason
        except WeirError as e:
            rec.end = _clock()
            rec.status = e.error.status
            rec.retry_after = e.error.retry_after
            rec.error = f"{e.error.status} {e.error.type}: {e.error.message}"
            return
        except (OSError, RuntimeError) as e:
            rec.end = _clock()
            rec.status = TRANSPORT_ERROR
            rec.error = repr(e)
            return
        rec.end = _clock()
        rec.status = OK


def make_target(
    kind: str,
    url: str | None = None,
    api_key: str | None = None,
    max_connections: int = 4096,
    curve: tuple[str, str] | None = None,
):
    if kind not in KINDS:
        raise ValueError(f"unknown target {kind!r}; one of {', '.join(KINDS)}")
    if not url:
        raise ValueError(f"target {kind!r} needs --url/--address")
    if kind == "zmq":
        return ZmqTarget(url, api_key, curve)
    return HttpTarget(kind, url, api_key, max_connections)
