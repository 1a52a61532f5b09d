"""Envoy's YAML is rendered from the TOML config, accepted by the real Envoy,
and checked in only as an exact rendering of deploy/weir.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from stackutil import API_KEYS, REPO, write_config

from deploy import envoy_config
from deploy.envoy_config import EnvoyValidationError, render, render_dict, validate
from shared.config import DEFAULT_CONFIG, ConfigError, load, loads

CHECKED_IN = REPO / "envoy" / "envoy.yaml"


def _hcm(d: dict) -> dict:
    return d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _vhost(d: dict) -> dict:
    return _hcm(d)["route_config"]["virtual_hosts"][0]


def test_default_config_renders_and_envoy_accepts_it():
    validate(render(load(DEFAULT_CONFIG)))


def test_checked_in_envoy_yaml_is_the_rendering_of_the_default_config():
    fresh = render(load(DEFAULT_CONFIG))
    assert CHECKED_IN.read_text() == fresh, "envoy/envoy.yaml is stale: run `weir render-envoy -o envoy/envoy.yaml`"


def test_test_config_with_keys_and_options_is_accepted(tmp_path):
    path = write_config(
        tmp_path,
        envoy={"access_log": True, "stream_idle_timeout_s": 0.25, "max_request_bytes": 4096},
        router={"http": "localhost:6299"},  # a name, not an IP: resolved by DNS
        api_keys=API_KEYS,
    )
    cfg = load(path)
    text = render(cfg)
    validate(text)
    d = yaml.safe_load(text)
    assert d["static_resources"]["clusters"][0]["type"] == "STRICT_DNS"
    assert _hcm(d)["stream_idle_timeout"] == "0.25s"
    assert _hcm(d)["access_log"][0]["name"] == "envoy.access_loggers.stdout"


@pytest.mark.parametrize(("miss", "want"), [(0.25, ("0.25s", "1s")), (2.5, ("2.5s", "2.5s"))])
def test_thread_watchdogs_follow_the_config_and_envoy_accepts_them(tmp_path, miss, want):
    """Envoy checks every thread each miss timeout (its 200 ms default: five wake-ups a
    second per thread); the megamiss stays Envoy's 1 s unless the miss is longer."""
    text = render(load(write_config(tmp_path, envoy={"watchdog_miss_s": miss})))
    validate(text)
    dogs = yaml.safe_load(text)["watchdogs"]
    for thread in ("main_thread_watchdog", "worker_watchdog"):
        assert (dogs[thread]["miss_timeout"], dogs[thread]["megamiss_timeout"]) == want
        assert "kill_timeout" not in dogs[thread]  # a stall is counted, never fatal


def test_rendered_routes_limits_and_health_check(tmp_path):
    cfg = load(write_config(tmp_path, api_keys=API_KEYS, rate_limit={"max_keys": 77}))
    d = render_dict(cfg)
    hcm, vhost = _hcm(d), _vhost(d)
    # Only /v1/, /health and the tokenizer endpoints are routed; /admin and /metrics fall through to 404.
    # /v1/files first: batch uploads may be up to batch.max_file_bytes.
    assert [r["match"] for r in vhost["routes"]] == [
        {"prefix": "/v1/files"},
        {"prefix": "/v1/"},
        {"path": "/health"},
        {"path": "/tokenize"},
        {"path": "/detokenize"},
    ]
    # Uploads stream through to the router (which writes them as they arrive and gives the 413): never buffered whole.
    upload = vhost["routes"][0]["typed_per_filter_config"]["envoy.filters.http.buffer"]
    assert upload["disabled"] is True and "buffer" not in upload
    for r in vhost["routes"]:
        assert r["route"]["timeout"] == "0s"  # SSE streams are never cut by a route timeout
        assert r["route"]["cluster"] == "router"
    assert hcm["normalize_path"] and hcm["merge_slashes"]
    rl = vhost["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]
    assert rl["token_bucket"]["max_tokens"] == cfg.rate_limit.route_burst
    assert rl["always_consume_default_token_bucket"] is True
    assert rl["max_dynamic_descriptors"] == 77
    assert rl["enable_x_ratelimit_headers"] == "DRAFT_VERSION_03"
    assert rl["enable_retry_after_header"] is True  # Envoy computes Retry-After from the bucket
    headers = [a["actions"][0]["request_headers"]["header_name"] for a in rl["rate_limits"]]
    assert headers == ["x-weir-rate-limit-key"]  # one bucket per key, whichever header carried it
    assert hcm["http_filters"][0]["name"] == "envoy.filters.http.lua"
    by_entry = {(e["entries"][0]["key"], e["entries"][0]["value"]): e["token_bucket"] for e in rl["descriptors"]}
    limited = next(k for k in cfg.api_keys if k.rate_limit_burst)
    assert by_entry[("api_key", limited.key)]["max_tokens"] == limited.rate_limit_burst
    assert by_entry[("api_key", limited.key)]["tokens_per_fill"] == limited.rate_limit_rps
    assert by_entry[("api_key", "")]["max_tokens"] == cfg.rate_limit.per_key_burst  # one dynamic bucket per key
    assert len(by_entry) == 2  # keys without overrides share the wildcard descriptor
    buffer = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.buffer")
    assert buffer["typed_config"]["max_request_bytes"] == cfg.envoy.max_request_bytes
    hc = d["static_resources"]["clusters"][0]["health_checks"][0]
    assert hc["http_health_check"]["path"] == "/health/ready"  # readiness, not liveness
    assert hc["interval"] == hc["no_traffic_interval"] == "0.5s"
    statuses = [
        m["filter"]["status_code_filter"]["comparison"]["value"]["default_value"]
        for m in hcm["local_reply_config"]["mappers"]
    ]
    assert statuses[:5] == [429, 413, 401, 404, 503]  # 401: the Lua filter's malformed key


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[envoy]\nlisten = "localhost:8080"', "needs an IP address"),
        ('[envoy]\nlisten = "127.0.0.1"', "expected HOST:PORT"),
        ('[envoy]\nadmin = "127.0.0.1:70000"', "port in 1..65535"),
        ('[envoy]\nlisten = "127.0.0.1:9901"', "both"),
        ("[envoy]\nmax_request_bytes = 0", "max_request_bytes = 0: must be > 0"),
        ("[envoy]\nstream_idle_timeout_s = -1", "stream_idle_timeout_s"),
        ("[envoy]\nhealth_check_interval_s = 0", "health_check_interval_s"),
        ("[envoy]\nwatchdog_miss_s = 0", "watchdog_miss_s"),
        ("[rate_limit]\nper_key_rps = 0", "rate_limit.per_key_rps = 0"),
        ("[rate_limit]\nmax_keys = -5", "rate_limit.max_keys"),
        ('[router]\nhttp = "127.0.0.1:notaport"', "router.http"),
        ('[[api_keys]]\nkey = "k1"\ntenant = "a"\n[[api_keys]]\nkey = "k1"\ntenant = "b"', "duplicate key"),
        ('[[api_keys]]\nkey = "bad\\nkey"\ntenant = "a"', "printable"),
        ('[[api_keys]]\nkey = "k1"\ntenant = "a"\nrate_limit_burst = 0', "rate_limit_burst"),
    ],
)
def test_bad_values_give_a_clear_config_error(toml, message):
    with pytest.raises(ConfigError, match=message):  # at load (a malformed plain key) or at rendering
        render(loads(toml))


def test_validate_reports_envoys_own_message():
    broken = render(load(DEFAULT_CONFIG)).replace("connect_timeout: 1s", "connect_timeout: 1s\n    bogus_field: 1")
    with pytest.raises(EnvoyValidationError, match="bogus_field"):
        validate(broken)


def test_weir_render_envoy_cli(tmp_path):
    path = write_config(tmp_path, api_keys=API_KEYS)
    weir = Path(sys.executable).parent / "weir"
    out = subprocess.run(
        [str(weir), "render-envoy", "--validate", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == render(load(path))
    bad = tmp_path / "bad.toml"
    bad.write_text('[envoy]\nlisten = "localhost:1"\n')
    out = subprocess.run([str(weir), "render-envoy", "--config", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and "needs an IP address" in out.stderr


def test_envoy_binary_is_the_real_one():
    assert Path(envoy_config.envoy_binary()).name == "envoy"
    assert subprocess.run([envoy_config.envoy_binary(), "--version"], capture_output=True).returncode == 0
