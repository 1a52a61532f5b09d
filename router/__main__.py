"""``python -m router --config weir.toml``: the router process (uvloop).

Wires the socket-free lifecycle (router.core) to its adapters: the worker
link (backend socket), the direct-client frontend (frontend socket) and the
HTTP ingress, all on one event loop and one SocketPump.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

import uvloop

from router.client_frontend import ClientFrontend
from router.core import RouterCore
from router.http_server import start_http_server
from router.metrics import RouterMetrics
from router.operator_actions import RouterOperator
from router.response_store import StoreCollector, make_store
from router.responses_http import ResponsesService
from router.views import RouterViews
from router.worker_link import WorkerLink
from shared.config import DEFAULT_CONFIG, ConfigError, load, split_hostport
from shared.keys import secret_warnings
from shared.logs import use_json
from shared.transport import SocketPump

log = logging.getLogger("weir.router")


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
    frontend = ClientFrontend(cfg.router, loop, pump, metrics, security=cfg.security, base_dir=cfg.base_dir)
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

    views = RouterViews(core, link, metrics)
    operator = RouterOperator(core, link, reload)
    link.serve(core)
    frontend.serve(core)
    response_store = make_store(cfg)
    metrics.registry.register(StoreCollector(response_store))
    host, port = split_hostport(cfg.router.http)
    server = await start_http_server(
        core,
        views,
        metrics,
        host,
        port,
        operator=operator,
        max_body_bytes=cfg.envoy.max_request_bytes,
        responses=ResponsesService(core, response_store),
    )
    log.info(
        "router ready: http=%s frontend=%s backend=%s policy=%s",
        cfg.router.http,
        cfg.router.frontend,
        cfg.router.backend,
        cfg.scheduler.policy,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload)
    await stop.wait()
    log.info("router shutting down")
    server.close()
    frontend.close()
    link.close()
    core.close()
    await core.quota.close()
    await response_store.close()
    if cfg.security.curve:
        from shared.curve import stop_authenticators

        stop_authenticators()


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
