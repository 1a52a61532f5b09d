"""Envoy's part of ``[tracing]`` (deploy/envoy_config.py renders it in): its
OpenTelemetry tracer on the listener, and the collector as a cluster.

Envoy starts a server span for each request -- a child of the client's
``traceparent`` when there is one, else a new trace sampled at
``tracing.sampling_ratio`` -- and passes its own context on to the router
in ``traceparent`` / ``tracestate``, so the router's spans are its children.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from shared.config import Config, split_hostport

COLLECTOR_CLUSTER = "otel_collector"
_TYPES = "type.googleapis.com/envoy"


def is_ip(host: str) -> bool:
    """An IP literal: Envoy binds only to those, and a collector named by one is a STATIC cluster."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def hcm_tracing(cfg: Config) -> dict[str, Any]:
    """The HttpConnectionManager's ``tracing`` block."""
    t = cfg.tracing
    timeout = f"{round(t.export_timeout_s, 3):g}s"
    provider: dict[str, Any] = {
        "@type": f"{_TYPES}.config.trace.v3.OpenTelemetryConfig",
        "service_name": t.envoy_service,
    }
    if t.protocol == "grpc":
        provider["grpc_service"] = {"envoy_grpc": {"cluster_name": COLLECTOR_CLUSTER}, "timeout": timeout}
    else:
        provider["http_service"] = {
            "http_uri": {"uri": f"http://{t.endpoint}/v1/traces", "cluster": COLLECTOR_CLUSTER, "timeout": timeout}
        }
    return {
        # A request with no sampled parent is traced this often (Envoy's percent).
        "random_sampling": {"value": round(t.sampling_ratio * 100.0, 6)},
        "provider": {"name": "envoy.tracers.opentelemetry", "typed_config": provider},
    }


def collector_cluster(cfg: Config) -> dict[str, Any]:
    """Where Envoy exports its spans (HTTP/2 for OTLP/gRPC)."""
    t = cfg.tracing
    host, port = split_hostport(t.endpoint)
    cluster: dict[str, Any] = {
        "name": COLLECTOR_CLUSTER,
        "type": "STATIC" if is_ip(host) else "STRICT_DNS",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": COLLECTOR_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}
            ],
        },
    }
    if t.protocol == "grpc":
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPES}.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster
