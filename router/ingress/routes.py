"""The HTTP routes besides generation: models, health, metrics and admin.

Each route is an entry of a table -- a path (or a path pattern) to the
method it takes and a handler -- and each handler a plain function from the
request to its answer (``Reply`` or ``ErrorReply``); router.ingress.http_server looks
the path up and writes the answer.  What the routes show comes from
``Views`` (router.observe.views.RouterViews: read-only); what they change goes
through ``Operator`` (router.observe.operator_actions.RouterOperator); both are
Protocols declared here by their consumer.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from router import api
from router.ingress.connection import Request
from router.observe.views import ModelRow  # one model of /v1/models
from shared.errors import Code, error
from shared.keys import key_from_headers
from shared.protocol import ErrorInfo

JSON = b"application/json"


class Views(Protocol):
    """What the read-only routes show (router.observe.views.RouterViews)."""

    def models(self) -> list[ModelRow]: ...

    def adapters(self) -> list[tuple[str, str, int, int, str]]: ...

    def adapters_for(self, api_key: str | None) -> list[tuple[str, str, int, int, str]] | ErrorInfo: ...

    def adapter_paths(self) -> dict[str, str]: ...

    def admin_models(self) -> list[dict[str, Any]]: ...

    def health(self) -> dict[str, Any]: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...

    def admin_workers(self) -> list[dict[str, Any]]: ...

    def admin_worker(self, worker_id: str) -> dict[str, Any] | None: ...

    def admin_queues(self) -> list[dict[str, Any]]: ...

    def admin_tenants(self) -> dict[str, Any]: ...

    def metrics_payload(self) -> Awaitable[tuple[bytes, str]]: ...


class Operator(Protocol):
    """What the admin routes change (router.observe.operator_actions.RouterOperator)."""

    def add_model(self, body: bytes) -> tuple[int, dict[str, Any]]: ...

    def remove_model(self, name: str) -> tuple[int, dict[str, Any]]: ...

    def add_adapter(self, body: bytes) -> tuple[int, dict[str, Any]]: ...

    def remove_adapter(self, name: str) -> tuple[int, dict[str, Any]]: ...

    def load_lora_adapter(self, body: bytes) -> str | ErrorInfo: ...

    def unload_lora_adapter(self, body: bytes) -> str | ErrorInfo: ...

    def drain(self, worker_id: str, on: bool) -> bool: ...

    def reload(self) -> dict[str, Any]: ...

    def drain_router(self) -> dict[str, Any]: ...


class Reply(NamedTuple):
    status: int
    body: bytes
    content_type: bytes = JSON
    extra: bytes = b""  # more header lines, each ending in \r\n


class ErrorReply(NamedTuple):
    """An OpenAI-style error body with the status of ``info`` (an ErrorInfo:
    a policy's ``shared.errors.Refusal`` is rendered into one first)."""

    info: ErrorInfo
    extra: bytes = b""


class Stream(NamedTuple):
    """A body of ``length`` bytes sent chunk by chunk as ``chunks`` yields them
    (a file download: never whole in memory; the writer waits for the socket)."""

    status: int
    length: int
    chunks: AsyncGenerator[bytes, None]
    content_type: bytes = JSON
    extra: bytes = b""


Answer = Reply | ErrorReply | Stream
Handler = Callable[[Request], Answer | Awaitable[Answer]]  # awaitable: answered when it completes


class BodySink(Protocol):
    """Where a streamed request body goes as it arrives (an upload), instead of
    being gathered in memory: ``feed`` each chunk; False asks the server to stop
    reading until the sink calls ``resume`` (set by the server); ``finish`` once
    the body is complete (the answer); ``abort`` if it never will be."""

    resume: Callable[[], None] | None

    def feed(self, chunk: bytes) -> bool: ...

    def finish(self) -> Awaitable[Answer]: ...

    def abort(self) -> None: ...


# A streamed-body route: called once the request's head is read (its body is
# b""), returns the sink for the body or a refusal (answered once the body,
# discarded, has been read).
BodyRoute = Callable[[Request], "BodySink | ErrorReply"]


class Route(NamedTuple):
    method: bytes  # the one it takes; b"*": any (the handler answers 405 itself)
    handler: Handler


class PatternRoute(NamedTuple):
    """A path with a name in it: ``prefix`` + name [+ one of ``suffixes``]."""

    prefix: bytes
    suffixes: tuple[bytes, ...]  # (): any ending
    method: bytes  # as Route.method
    label: str  # the metrics label (the path with its name as a placeholder)
    handler: Handler

    def matches(self, path: bytes, method: bytes) -> bool:
        return (
            path.startswith(self.prefix)
            and (not self.suffixes or path.endswith(self.suffixes))
            and (self.method == b"*" or method == self.method)
        )


ADMIN_PREFIX = b"/admin"


def admin_allowed(token: str | None, authorization: str | None, loopback: bool) -> bool:
    """May this request use /admin/*?  With ``Authorization: Bearer`` the
    admin token (router.admin_token_file); with no credentials at all, only
    from loopback (`weir up` and the CLI on the router's host).  A wrong
    token is refused from loopback too."""
    if authorization is None or not authorization.strip(" \t"):
        return loopback
    scheme, _, given = authorization.strip(" \t").partition(" ")
    if token is None or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip(" \t").encode("latin-1"), token.encode("ascii"))


def admin_refusal() -> ErrorReply:
    return ErrorReply(
        error(
            Code.INVALID_ADMIN_TOKEN,
            "The router's /admin/* needs the admin token (Authorization: Bearer TOKEN, the file "
            "router.admin_token_file names); without one it answers loopback only.",
        )
    )


def _json(status: int, obj: object) -> Reply:
    return Reply(status, api.encode(obj))


def _not_allowed(use: str, allow: bytes) -> ErrorReply:
    return ErrorReply(error(Code.METHOD_NOT_ALLOWED, "use " + use), b"allow: " + allow + b"\r\n")


def _no_worker(worker_id: str) -> ErrorReply:
    return ErrorReply(error(Code.NOT_FOUND, f"No worker {worker_id!r} is registered"))


def model_object(row: ModelRow, created: int, parent: str | None = None) -> dict[str, Any]:
    """One model as OpenAI shows it, with vLLM's ``root`` (here the served
    name: no server path is shown) and ``parent`` (a LoRA adapter's base
    model, null for a model); weir adds its context, its workers ready now
    and its state (loading / ready / unloading: models at run time)."""
    name, max_len, ready, state = row
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "weir",
        "root": name,
        "parent": parent,
        "max_model_len": max_len,
        "ready_workers": ready,
        "state": state,
    }


def _name(req: Request, prefix: bytes, suffix: bytes = b"") -> str:
    return req.path[len(prefix) : len(req.path) - len(suffix)].decode("utf-8", "replace")


class Routes(NamedTuple):
    exact: dict[bytes, Route]
    patterns: list[PatternRoute]  # tried in order when no exact path matches
    bodies: Mapping[bytes, BodyRoute] = MappingProxyType({})  # POST paths whose body streams to a sink (uploads)


def routes(views: Views, operator: Operator | None, created: int) -> Routes:
    """The table; without ``operator`` the routes that change state are absent (404)."""

    def listed(req: Request) -> list[dict[str, Any]] | ErrorReply:
        """The models, then the LoRA adapters the caller may use (with their base
        model as ``parent``); with API keys configured, only to a valid key: a
        missing, wrong or malformed one is refused as a generation's is."""
        key = key_from_headers(req.header(b"x-api-key"), req.header(b"authorization"))
        adapters = views.adapters_for(key)
        if isinstance(adapters, ErrorInfo):
            return ErrorReply(adapters)
        out = [model_object(r, created) for r in views.models()]
        out += [model_object((a[0], *a[2:]), created, a[1]) for a in adapters]
        return out

    def models(req: Request) -> Answer:
        out = listed(req)
        return out if isinstance(out, ErrorReply) else _json(200, {"object": "list", "data": out})

    def model(req: Request) -> Answer:
        name = _name(req, b"/v1/models/")
        out = listed(req)
        if isinstance(out, ErrorReply):
            return out
        for obj in out:
            if obj["id"] == name:
                return _json(200, obj)
        return ErrorReply(error(Code.MODEL_NOT_FOUND, f"The model {name!r} does not exist", param="model"))

    def ready(req: Request) -> Answer:
        ok, body = views.readiness()
        return Reply(200 if ok else 503, api.encode(body), extra=b"" if ok else b"retry-after: 1\r\n")

    async def metrics(req: Request) -> Answer:
        body, content_type = await views.metrics_payload()  # over several loop turns at a large fleet
        return Reply(200, body, content_type.encode())

    def admin_worker(req: Request) -> Answer:
        """GET /admin/workers/{id}: one worker, for its pod's probes (deploy/k8s_probe.py)."""
        wid = _name(req, b"/admin/workers/")
        w = views.admin_worker(wid)
        return _no_worker(wid) if w is None else _json(200, w)

    def health(req: Request) -> Answer:
        return _json(200, views.health())

    exact = {
        b"/v1/models": Route(b"GET", models),
        b"/health": Route(b"GET", health),
        b"/health/live": Route(b"GET", health),
        b"/health/ready": Route(b"GET", ready),
        b"/metrics": Route(b"GET", metrics),
        b"/admin/workers": Route(b"GET", lambda req: _json(200, views.admin_workers())),
        b"/admin/queues": Route(b"GET", lambda req: _json(200, views.admin_queues())),
        b"/admin/tenants": Route(b"GET", lambda req: _json(200, views.admin_tenants())),
        b"/admin/models": Route(b"GET", lambda req: _json(200, views.admin_models())),
        b"/admin/adapters": Route(b"GET", lambda req: _admin_adapters(views)),
    }
    patterns = [PatternRoute(b"/v1/models/", (), b"GET", "/v1/models/{model}", model)]
    if operator is not None:
        exact.update(_operator_routes(views, operator))
        patterns.append(_drain_route(operator))
    patterns.append(PatternRoute(b"/admin/workers/", (), b"GET", "/admin/workers/{id}", admin_worker))
    if operator is not None:
        patterns.append(_remove_model_route(operator))
        exact.update(_adapter_routes(views, operator))
        patterns.append(_remove_adapter_route(operator))
    return Routes(exact, patterns)


# vLLM's run-time LoRA routes: admin actions (router.ingress.http_server asks the admin token for them).
LORA_ADMIN_PATHS = (b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter")


def _admin_adapters(views: Views) -> Answer:
    """GET /admin/adapters: every LoRA adapter served, its base, its directory, its base's state and ready workers."""
    rows, paths = views.adapters(), views.adapter_paths()
    return _json(
        200, [{"name": a, "base": b, "path": paths.get(a), "state": s, "ready_workers": r} for a, b, _, r, s in rows]
    )


def _adapter_routes(views: Views, operator: Operator) -> dict[bytes, Route]:
    def admin_adapters(req: Request) -> Answer:
        """GET: every adapter served and its base; POST: add one."""
        if req.method == b"GET":
            return _admin_adapters(views)
        if req.method != b"POST":
            return _not_allowed("GET or POST", b"GET, POST")
        return _json(*operator.add_adapter(req.body))

    def vllm_answer(result: str | ErrorInfo) -> Answer:
        if isinstance(result, str):  # vLLM answers a success in plain text
            return Reply(200, result.encode(), b"text/plain; charset=utf-8")
        return ErrorReply(result)

    return {
        b"/admin/adapters": Route(b"*", admin_adapters),
        LORA_ADMIN_PATHS[0]: Route(b"POST", lambda req: vllm_answer(operator.load_lora_adapter(req.body))),
        LORA_ADMIN_PATHS[1]: Route(b"POST", lambda req: vllm_answer(operator.unload_lora_adapter(req.body))),
    }


def _remove_adapter_route(operator: Operator) -> PatternRoute:
    def remove(req: Request) -> Answer:
        """POST /admin/adapters/{name}/remove."""
        if req.method != b"POST":
            return _not_allowed("POST", b"POST")
        return _json(*operator.remove_adapter(_name(req, b"/admin/adapters/", b"/remove")))

    return PatternRoute(b"/admin/adapters/", (b"/remove",), b"*", "/admin/adapters/{name}/remove", remove)


def _operator_routes(views: Views, operator: Operator) -> dict[bytes, Route]:
    def admin_models(req: Request) -> Answer:
        """GET: every model and its state; POST: add one."""
        if req.method == b"GET":
            return _json(200, views.admin_models())
        if req.method != b"POST":
            return _not_allowed("GET or POST", b"GET, POST")
        return _json(*operator.add_model(req.body))

    def reload(req: Request) -> Answer:
        result = operator.reload()
        return _json(200 if result.get("ok") else 400, result)

    def drain_router(req: Request) -> Answer:
        """POST /admin/drain: this router drains and exits, as on SIGTERM (router/lifecycle/drain.py)."""
        result = operator.drain_router()
        return _json(200 if result.get("ok") else 409, result)

    return {
        b"/admin/models": Route(b"*", admin_models),
        b"/admin/reload": Route(b"POST", reload),
        b"/admin/drain": Route(b"POST", drain_router),
    }


def _drain_route(operator: Operator) -> PatternRoute:
    def drain(req: Request) -> Answer:
        """POST /admin/workers/{id}/drain (or /undrain)."""
        if req.method != b"POST":
            return _not_allowed("POST", b"POST")
        worker_id, _, action = req.path[len(b"/admin/workers/") :].rpartition(b"/")
        wid = worker_id.decode("utf-8", "replace")
        if not operator.drain(wid, action == b"drain"):
            return _no_worker(wid)
        return _json(200, {"worker": wid, "draining": action == b"drain"})

    return PatternRoute(b"/admin/workers/", (b"/drain", b"/undrain"), b"*", "/admin/workers/{id}/drain", drain)


def _remove_model_route(operator: Operator) -> PatternRoute:
    def remove(req: Request) -> Answer:
        """POST /admin/models/{name}/remove: unloading; its workers drain."""
        if req.method != b"POST":
            return _not_allowed("POST", b"POST")
        return _json(*operator.remove_model(_name(req, b"/admin/models/", b"/remove")))

    return PatternRoute(b"/admin/models/", (b"/remove",), b"*", "/admin/models/{name}/remove", remove)
