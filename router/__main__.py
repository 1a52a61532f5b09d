"""``python -m router --config weir.toml``: the router process (uvloop).

SIGTERM (or ``POST /admin/drain``) drains it -- no new requests, the
admitted ones finish up to ``router.drain_timeout_s`` (router/lifecycle/drain.py) --
then it says Goodbye to its workers and exits 0; a second SIGTERM, or a
SIGINT, ends what is left at once, each request with an error event.

Wires the socket-free lifecycle (router.lifecycle.core) to its adapters: the worker
link (backend socket), the direct-client frontend (frontend socket) and the
HTTP ingress, all on one event loop and one SocketPump.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

import uvloop

from router.fleet.worker_link import WorkerEvents, WorkerLink
from router.ingress.http_server import HttpConnection, start_http_server, written_out
from router.ingress.responses import ResponsesApi
from router.ingress.routes import Routes
from router.ingress.zmq_clients import ClientFrontend, client_message_bytes
from router.lifecycle.core import RouterCore
from router.lifecycle.drain import RouterDrain
from router.lifecycle.ports import WorkerPort
from router.lifecycle.reads import RouterCoreReads
from router.observe.metrics import RouterMetrics
from router.observe.operator_actions import RouterOperator
from router.observe.views import RouterViews
from router.services.batch.service import BatchService
from router.services.response_store import StoreCollector, make_store, tenant_bounds
from shared.config import DEFAULT_CONFIG, Config, ConfigError, load, split_hostport
from shared.gc_tuning import freeze_startup_heap
from shared.keys import admin_token, secret_warnings
from shared.logs import use_json
from shared.transport import SocketPump

log = logging.getLogger("weir.router")

FLUSH_S = 2.0  # after a drain, how long the last responses get to be written before the process exits

if TYPE_CHECKING:  # the link's two ports, checked where they are wired (the fleet knows no lifecycle)
    _port: type[WorkerPort] = WorkerLink  # what the lifecycle sends through
    _events: type[WorkerEvents] = RouterCore  # what the link tells the lifecycle


async def serve(config_path: str | None, index: int = 0) -> None:
    cfg = load(config_path).for_router(index)  # router `index` of [[routers]]: its own three addresses
    logging.getLogger().setLevel(cfg.router.log_level.upper())
    if cfg.logging.format == "json":
        use_json("router")
    loop = asyncio.get_running_loop()
    metrics = RouterMetrics()
    pump = SocketPump(loop)
    link = WorkerLink(cfg.router, loop, pump, metrics, security=cfg.security, base_dir=cfg.base_dir)
    core = RouterCore(cfg, loop, link, metrics=metrics)
    frontend = ClientFrontend(
        cfg.router,
        loop,
        pump,
        metrics,
        security=cfg.security,
        base_dir=cfg.base_dir,
        max_message_bytes=client_message_bytes(cfg),
    )
    cfg_file = config_path or os.environ.get("WEIR_CONFIG") or str(DEFAULT_CONFIG)
    for warning in secret_warnings(cfg, cfg_file):
        log.warning(warning)

    def reload() -> dict[str, Any]:
        """SIGHUP or POST /admin/reload: API keys and budgets from the config file again."""
        try:
            new = load(config_path)
        except (ConfigError, OSError) as e:
            log.error("reload failed, keeping the keys and budgets in use: %s", e)
            return {"ok": False, "error": str(e)}
        core.reload_keys(new)
        for warning in secret_warnings(new, cfg_file):
            log.warning(warning)
        log.info("reloaded %d api keys and %d tenant budgets", len(new.api_keys), len(new.tenants))
        return {"ok": True, "api_keys": len(new.api_keys), "tenants": len(new.tenants)}

    drain = RouterDrain(core, loop, cfg.router.drain_timeout_s, loop.time)

    def drain_router() -> dict[str, Any]:
        """POST /admin/drain: as SIGTERM."""
        drain.start("POST /admin/drain")
        left = None if drain.deadline is None else max(0.0, drain.deadline - loop.time())
        return {"ok": True, "draining": True, "jobs": core.live_jobs(), "drain_left_s": left}

    terms = [0]

    def on_signal(sig: signal.Signals) -> None:
        """SIGTERM: drain (also after POST /admin/drain, as a preStop hook may
        send it: Kubernetes' SIGTERM follows); a second SIGTERM, or SIGINT:
        end now, each request with an error event."""
        if sig == signal.SIGTERM:
            terms[0] += 1
        if sig == signal.SIGTERM and terms[0] == 1:
            drain.start("SIGTERM")
        else:
            drain.finish_now(sig.name)

    views = RouterViews(RouterCoreReads(core), link, metrics)
    operator = RouterOperator(core, link, reload, drain_router)
    link.serve(core)
    frontend.serve(core)
    response_store = make_store(cfg, lambda tenant: tenant_bounds(core.cfg, tenant))  # (reloaded tenants')
    metrics.registry.register(StoreCollector(response_store))
    host, port = split_hostport(cfg.router.http)
    connections: set[HttpConnection] = set()
    batches, batch_routes = _batch_tier(core, cfg)
    http_options: dict[str, Any] = {
        "operator": operator,
        "max_body_bytes": cfg.envoy.max_request_bytes,
        "connections": connections,
        "max_prompts": cfg.router.max_prompts_per_request,
        "extra_routes": batch_routes,
        "max_upload_bytes": cfg.batch.max_file_bytes if batches is not None else 0,
        "responses": ResponsesApi(core, response_store, lambda: core.keys.by_key),
        "admin_token": admin_token(cfg),
        "session_headers": cfg.scheduler.session_headers,
    }
    servers = [await start_http_server(core, views, metrics, host, port, **http_options)]
    if cfg.router.admin_http:  # /admin/*, /metrics and /health on a port of their own (NetworkPolicies)
        admin_host, admin_port = split_hostport(cfg.router.admin_http)
        servers.append(
            await start_http_server(core, views, metrics, admin_host, admin_port, admin_plane=True, **http_options)
        )
    freeze_startup_heap()  # tokenizers and templates are loaded: what start-up built lives on
    log.info(
        "router ready: http=%s frontend=%s backend=%s policy=%s",
        cfg.router.http,
        cfg.router.frontend,
        cfg.router.backend,
        cfg.scheduler.policy,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, reload)
    await drain.done.wait()
    for server in servers:
        server.close()  # (no new connection; the open ones get their last bytes out first)
    if not await written_out(connections, FLUSH_S):
        log.warning("some responses were still being written after %.1f s", FLUSH_S)
    frontend.outbox.flush()  # direct clients' last deltas (the socket lingers to send them)
    log.info("router shutting down: goodbye to its workers")
    drain.close()
    frontend.close()
    link.close()
    if batches is not None:
        await batches.close()
    core.close()
    await core.quota.close()
    await response_store.close()
    if cfg.security.curve:
        from shared.curve import stop_authenticators

        stop_authenticators()


def _batch_tier(core: RouterCore, cfg: Config) -> tuple[BatchService | None, Routes | None]:
    """The Batch API and the service that runs its batches ([batch]; router/services/batch/), unless disabled."""
    if not cfg.batch.enabled:
        return None, None
    from router.ingress.files_batches import batch_routes, owner_of_key

    svc = BatchService(core, cfg)
    svc.start()
    return svc, batch_routes(svc, owner_of_key(core), cfg.batch.max_file_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m router")
    ap.add_argument("--config", default=None, help="weir TOML config (default: deploy/weir.toml)")
    ap.add_argument("--index", type=int, default=0, help="which of the config's [[routers]] this is (default 0)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        load(args.config).router_endpoints()[args.index]
    except IndexError:
        ap.error(f"--index {args.index}: the config has no such router")
    uvloop.run(serve(args.config, args.index))


if __name__ == "__main__":
    main()
