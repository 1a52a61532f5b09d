"""Envoy's edge policy on the running stack: per-key rate limits, body size
limit, and what it does not expose -- each refusal an OpenAI-style JSON error."""

from __future__ import annotations

import http.client
import re
import time
import urllib.parse

import requests
from stackutil import KEY_ALPHA, KEY_BETA, KEY_LIMITED, LIMITED_BURST, LIMITED_RPS, SIM_MODEL, STACK_MAX_REQUEST_BYTES

STAT = "weir_api.http_local_rate_limit.rate_limited"


def _assert_openai_error(resp: requests.Response, status: int, type_: str, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"}
    assert err["request_id"] and err["request_id"] == resp.headers["x-request-id"]
    assert (err["type"], err["code"], err["param"]) == (type_, code, None)
    assert err["message"]
    return err


def _rate_limited_count(stack) -> int:
    text = requests.get(stack.admin_url + "/stats", params={"filter": re.escape(STAT)}, timeout=5).text
    return int(re.search(rf"^{re.escape(STAT)}: (\d+)$", text, re.M).group(1))


def _burst(stack, headers: dict | list[dict], n: int) -> list[requests.Response]:
    cycle = headers if isinstance(headers, list) else [headers]
    with requests.Session() as s:  # one keep-alive connection: quick, in order
        return [s.get(stack.envoy_url + "/v1/models", headers=cycle[i % len(cycle)], timeout=10) for i in range(n)]


def _check_burst(stack, headers: dict | list[dict]) -> None:
    before = _rate_limited_count(stack)
    responses = _burst(stack, headers, LIMITED_BURST + 10)
    codes = [r.status_code for r in responses]
    # The first LIMITED_BURST pass (the bucket starts full; refill is 1/s);
    # once the bucket is empty, the rest are refused.
    assert codes[:LIMITED_BURST] == [200] * LIMITED_BURST, codes
    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) >= 8, codes
    assert codes[-1] == 429
    for r in refused:
        _assert_openai_error(r, 429, "rate_limit_error", "rate_limit_exceeded")
        assert r.headers["retry-after"] == "1"  # Envoy's own: 1 token/s refills one request in 1 s
        assert r.headers["x-ratelimit-limit"] == str(LIMITED_BURST)
        assert r.headers["x-ratelimit-remaining"] == "0"
        assert "x-ratelimit-reset" in r.headers
    # Envoy counts exactly the refusals we saw (the tests run one at a time).
    assert _rate_limited_count(stack) - before == len(refused)


def test_per_key_rate_limit_x_api_key(stack):
    _check_burst(stack, {"x-api-key": KEY_LIMITED})
    # Other keys have their own buckets: still served right away.
    assert requests.get(stack.envoy_url + "/v1/models", headers={"x-api-key": KEY_ALPHA}, timeout=10).ok
    prom = requests.get(stack.admin_url + "/stats/prometheus", timeout=5).text
    assert re.search(
        r'^envoy_http_local_rate_limit_rate_limited\{envoy_local_http_ratelimit_prefix="weir_api"\} [1-9]',
        prom,
        re.M,
    )


def test_per_key_rate_limit_bearer_shares_the_keys_bucket(stack):
    # Same key as a Bearer token (what the OpenAI SDK sends): metered by the
    # same bucket as x-api-key, so switching headers does not double the rate.
    time.sleep(LIMITED_BURST / LIMITED_RPS + 0.5)  # the bucket refills (after the x-api-key test)
    _check_burst(stack, [{"authorization": f"Bearer {KEY_LIMITED}"}, {"x-api-key": KEY_LIMITED}])
    ok = requests.get(stack.envoy_url + "/v1/models", headers={"authorization": f"Bearer {KEY_BETA}"}, timeout=10)
    assert ok.status_code == 200


def test_success_carries_rate_limit_headers(stack):
    r = requests.get(stack.envoy_url + "/v1/models", headers={"x-api-key": KEY_BETA}, timeout=10)
    assert r.status_code == 200
    assert int(r.headers["x-ratelimit-limit"]) > 0
    assert int(r.headers["x-ratelimit-remaining"]) >= 0


def test_oversize_body_gets_413_json_then_requests_still_work(stack):
    url = stack.envoy_url + "/v1/completions"
    headers = {"x-api-key": KEY_BETA, "content-type": "application/json"}
    body = b'{"model": "%s", "prompt": "%s", "max_tokens": 1}' % (
        SIM_MODEL.encode(),
        b"a" * (STACK_MAX_REQUEST_BYTES + 1024),
    )
    r = requests.post(url, data=body, headers=headers, timeout=10)
    err = _assert_openai_error(r, 413, "invalid_request_error", "request_too_large")
    assert str(STACK_MAX_REQUEST_BYTES) in err["message"]
    ok = requests.post(url, json={"model": SIM_MODEL, "prompt": "hello", "max_tokens": 2}, headers=headers, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


def _raw_get(base_url: str, path: str) -> tuple[int, bytes]:
    """GET ``path`` exactly as written (requests/curl would resolve ``..``)."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        conn.putheader("x-api-key", KEY_BETA)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_router_admin_and_metrics_are_not_exposed(stack):
    # They exist on the router itself...
    assert requests.get(stack.router_url + "/admin/workers", timeout=5).status_code == 200
    # ...but Envoy routes only /v1/ and /health.
    for path in ["/admin/workers", "/metrics", "/admin/queues", "/", "/v1"]:
        r = requests.get(stack.envoy_url + path, headers={"x-api-key": KEY_BETA}, timeout=5)
        err = _assert_openai_error(r, 404, "invalid_request_error", "not_found")
        assert path in err["message"]
    for path in ["/v1/../admin/workers", "/v1/%2e%2e/admin/workers", "//admin/workers", "/v1/..%2Fadmin/workers"]:
        status, body = _raw_get(stack.envoy_url, path)
        assert status in (400, 404), (path, status, body)
        assert b'"error"' in body
    assert requests.get(stack.envoy_url + "/health", timeout=5).status_code == 200


def _raw_get_with_headers(base_url: str, path: str, headers: list[tuple[str, bytes]]) -> requests.Response:
    """GET with header values sent byte for byte (requests would re-encode them)."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders()
        raw = conn.getresponse()
        resp = requests.Response()
        resp.status_code, resp._content = raw.status, raw.read()
        resp.headers = requests.structures.CaseInsensitiveDict(raw.getheaders())
        return resp
    finally:
        conn.close()


def test_key_spellings_with_non_ascii_blanks_are_refused_before_the_bucket(stack):
    """KEY + U+00A0 x k was a fresh Envoy bucket for each k and the same key to the
    router: 60 of 60 served where the key's bucket allows ~7.  Each spelling
    outside the one key rule (shared.keys) is a 401 at Envoy, and none of them
    touches the key's bucket, which still holds its burst afterwards."""
    time.sleep(LIMITED_BURST / LIMITED_RPS + 0.5)  # the bucket refills (after the tests above)
    before = _rate_limited_count(stack)
    variants = (
        [[("x-api-key", KEY_LIMITED.encode() + b"\xa0" * k)] for k in range(1, 31)]
        + [[("authorization", b"Bearer " + KEY_LIMITED.encode() + b"\xc2\xa0" * k)] for k in range(1, 16)]
        + [[("x-api-key", KEY_LIMITED.encode()), ("x-api-key", KEY_LIMITED.encode() + b"x" * k)] for k in range(1, 16)]
    )
    served = 0
    for headers in variants:
        r = _raw_get_with_headers(stack.envoy_url, "/v1/models", headers)
        served += r.status_code == 200
        err = _assert_openai_error(r, 401, "authentication_error", "invalid_api_key")
        assert "Malformed API key" in err["message"]
    assert served == 0
    assert _rate_limited_count(stack) == before  # nothing was metered, let alone refused
    # The key's own bucket is untouched: its whole burst is still there, then it refuses.
    _check_burst(stack, {"x-api-key": KEY_LIMITED})
    # Spaces and tabs around the key are the same key: its bucket, now empty.
    r = _raw_get_with_headers(stack.envoy_url, "/v1/models", [("x-api-key", b"\t" + KEY_LIMITED.encode() + b" ")])
    _assert_openai_error(r, 429, "rate_limit_error", "rate_limit_exceeded")


def test_router_direct_refuses_a_malformed_key(stack):
    """The same rule at the router itself (router-direct HTTP; direct ZeroMQ
    clients meet it at admission: tests/unit/test_key_rule.py)."""
    key = KEY_BETA.encode()
    for headers in (
        [("x-api-key", key + b"\xa0")],
        [("authorization", b"Bearer " + key + b"\xa0")],
        [("x-api-key", key), ("x-api-key", key)],
    ):
        u = urllib.parse.urlsplit(stack.router_url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            body = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % SIM_MODEL.encode()
            conn.putrequest("POST", "/v1/completions", skip_accept_encoding=True)
            for name, value in [*headers, ("content-type", b"application/json"), ("content-length", b"%d" % len(body))]:
                conn.putheader(name, value)
            conn.endheaders(body)
            raw = conn.getresponse()
            status, payload = raw.status, raw.read()
        finally:
            conn.close()
        assert status == 401, payload
        assert b"Malformed API key" in payload and b'"invalid_api_key"' in payload
