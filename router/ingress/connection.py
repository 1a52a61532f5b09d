"""What a handler on the HTTP ingress sees: its request, its connection, and
through the connection the server and the router behind it.

Declared here, apart from the server (router.ingress.http_server, which
implements them), so that the handlers -- the generation exchange, embeddings,
tokenize, /v1/responses, the route table -- never import the server, and the
server imports them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from router import api
from router.api.agent_headers import AgentHeaders
from router.lifecycle.models import ServedModel
from router.lifecycle.ports import RequestSink
from router.observe.metrics import RouterMetrics
from router.tenancy.buckets import BudgetAnswer
from router.tenancy.budgets import BudgetLedger, Group
from router.tenancy.identity import Identity
from shared.protocol import ErrorInfo, Submit


class Request(Protocol):
    """What a handler reads of a request (the server's parsed request): a
    handler lets ``body`` go once parsed, and sets ``rid`` when the client sent none."""

    body: bytes
    rid: str | None  # the x-request-id logged and echoed

    @property
    def method(self) -> bytes: ...

    @property
    def path(self) -> bytes: ...

    @property
    def query(self) -> bytes: ...  # after the "?"

    @property
    def keep_alive(self) -> bool: ...

    @property
    def http11(self) -> bool: ...

    @property
    def t0(self) -> float: ...  # perf_counter at arrival (the latency metric)

    @property
    def headers(self) -> Mapping[bytes, bytes]: ...  # every header, its name lower-case (agents' routing headers)

    def header(self, name: bytes) -> str | None: ...


class Generation(Protocol):
    """What generation requests need of the router (router.lifecycle.core.RouterCore)."""

    def submit(self, sub: Submit, sink: RequestSink, *, group: Group | None = None) -> int | ErrorInfo: ...

    def cancel(self, handle: int) -> None: ...

    def token_text(self, model: str) -> Any: ...
    def tool_parser(self, model: str) -> tuple[str | None, bool]: ...

    def served_model(self, model: str, key: str = "") -> ServedModel | None: ...  # key: an alias's draw

    def identify(self, api_key: str | None) -> Identity | ErrorInfo: ...

    def charge_call(self, who: Identity, on_answer: Callable[[BudgetAnswer], None]) -> BudgetAnswer | None: ...

    @property
    def quota(self) -> BudgetLedger: ...

    def off_loop(
        self, tenant: str, fn: Callable[..., Any], *args: Any, alive: Callable[[], bool] | None = None
    ) -> asyncio.Future[Any] | None: ...


class InFlight(Protocol):
    """A response in progress on its connection (router.ingress.exchange.Exchange,
    router.ingress.embeddings.EmbeddingsExchange): what the connection reads of it
    when it is abandoned."""

    done: bool  # the core is done with it (or was told to be)

    @property
    def label(self) -> str: ...

    @property
    def req(self) -> Request: ...

    @property
    def renderer(self) -> api.StreamRenderer | None: ...  # None: a whole response

    @property
    def queued(self) -> bool: ...  # a stream's output waits for the end of the loop turn

    def cancel_jobs(self) -> None: ...


class Flushable(Protocol):
    """A stream whose output waits for the end of the loop turn (router.ingress.exchange.Exchange)."""

    def flush(self) -> None: ...


class Server(Protocol):
    """What a handler reads of the server its connection belongs to."""

    @property
    def core(self) -> Generation: ...

    @property
    def metrics(self) -> RouterMetrics: ...

    @property
    def max_buffered_bytes(self) -> int: ...  # a stream's unsent output beyond this, client not reading: dropped

    @property
    def agent(self) -> AgentHeaders: ...  # the agent and gateway headers it reads

    def flush_later(self, stream: Flushable) -> None: ...


class Connection(Protocol):
    """What a handler asks of its client connection (router.ingress.http_server.HttpConnection)."""

    busy: bool  # a response is in progress: pipelined requests wait
    current: InFlight | None  # the response in progress, told when the client goes

    @property
    def closed(self) -> bool: ...  # closing or closed: write nothing more

    @property
    def write_paused(self) -> bool: ...

    @property
    def transport(self) -> asyncio.Transport: ...

    @property
    def ingress(self) -> Server: ...

    def respond(
        self, req: Request, status: int, content_type: bytes, body: bytes, label: str, extra: bytes = b""
    ) -> None: ...

    def respond_error(self, req: Request, info: ErrorInfo, label: str, extra: bytes = b"") -> None: ...

    def refuse(self, req: Request, info: ErrorInfo, label: str) -> None: ...

    def response_complete(self, req: Request, status: int, label: str, keep_alive: bool) -> None: ...

    def abort(self, ex: InFlight, status: int) -> None: ...
