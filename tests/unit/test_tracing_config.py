"""[tracing]: off by default everywhere; when on, one section renders Envoy's
OpenTelemetry tracer (accepted by the real Envoy) and is refused when malformed."""

from __future__ import annotations

import pytest
import yaml

from deploy.envoy_config import render, validate
from deploy.envoy_tracing import COLLECTOR_CLUSTER
from shared.config import DEFAULT_CONFIG, ConfigError, load, loads


def _hcm(d: dict) -> dict:
    return d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_off_by_default_nothing_rendered():
    cfg = load(DEFAULT_CONFIG)
    assert not cfg.tracing.enabled
    d = yaml.safe_load(render(cfg))
    assert "tracing" not in _hcm(d)
    assert [c["name"] for c in d["static_resources"]["clusters"]] == ["router"]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_on_renders_envoys_tracer_and_envoy_accepts_it(protocol):
    cfg = loads(
        f'[tracing]\nendpoint = "127.0.0.1:4317"\nprotocol = "{protocol}"\nsampling_ratio = 0.25\n'
        'envoy_service = "edge"\n'
    )
    text = render(cfg)
    validate(text)
    d = yaml.safe_load(text)
    tr = _hcm(d)["tracing"]
    assert tr["random_sampling"] == {"value": 25.0}
    provider = tr["provider"]["typed_config"]
    assert provider["service_name"] == "edge"
    clusters = {c["name"]: c for c in d["static_resources"]["clusters"]}
    collector = clusters[COLLECTOR_CLUSTER]
    addr = collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr == {"address": "127.0.0.1", "port_value": 4317}
    if protocol == "grpc":
        assert provider["grpc_service"]["envoy_grpc"]["cluster_name"] == COLLECTOR_CLUSTER
        assert "http2_protocol_options" in str(collector)
    else:
        assert provider["http_service"]["http_uri"]["uri"] == "http://127.0.0.1:4317/v1/traces"


@pytest.mark.parametrize(
    "body",
    [
        'endpoint = "127.0.0.1:4317"\nsampling_ratio = 1.5',
        'endpoint = "no-port"',
        'endpoint = "h:0"',
        'endpoint = "h:4317"\nmax_queued_spans = 0',
        'protocol = "thrift"',
    ],
)
def test_malformed_sections_are_refused(body):
    with pytest.raises(ConfigError):
        loads("[tracing]\n" + body + "\n")
