"""Tenancy and security on real processes: budgets and x-ratelimit-* headers
through Envoy, hashed keys and reload, two routers sharing one real Redis,
Redis unreachable (fail open / closed), CURVE on both ZeroMQ planes, TLS at
Envoy with the openai SDK -- and no key text in any log of the run."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import requests
import tomli_w
from stackutil import REPO, SIM_MODEL, free_port, sim_worker, start_stack, write_config

from shared import curve
from shared.client import Client, WeirError
from shared.config import load
from shared.keys import digest

KEY_Q = "sk-test-quota-7d1f0c2b9e"  # budgets: 3,000 tokens/min, 100 requests/min
KEY_R = "sk-test-roomy-55aa31c0de"  # no budget
KEY_NEW = "sk-test-added-later-0b6e"
BIG_PROMPT = "abcd" * 1000  # the sim model counts 4 bytes a token: 1,000 tokens


def _keys(extra=()):
    return [
        {"key_sha256": digest(KEY_Q), "tenant": "q", "tokens_per_minute": 3000, "requests_per_minute": 100},
        {"key_sha256": digest(KEY_R), "tenant": "r"},
        *extra,
    ]


def _metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _rewrite(cfg_path: Path, **changes) -> None:
    import tomllib

    raw = tomllib.loads(cfg_path.read_text())
    raw.pop("base_dir", None)
    raw.update(changes)
    cfg_path.write_text(tomli_w.dumps(raw))
    load(cfg_path)


def _no_key_text(run_dir: Path, secrets: list[str]) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            for s in secrets:
                assert s not in text, f"secret text found in {path}"


def _complete(
    base: str,
    key: str | None,
    prompt: str = "hi",
    max_tokens: int = 1,
    stream: bool = False,
    headers: dict | None = None,
) -> requests.Response:
    h = dict(headers or {})
    if key is not None:
        h["x-api-key"] = key
    return requests.post(
        base + "/v1/completions",
        headers=h,
        timeout=30,
        stream=stream,
        json={"model": SIM_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream},
    )


# ------------------------------------------------------------------ budgets, in-process store


def test_budgets_headers_retry_after_reload_and_no_key_in_logs(tmp_path):
    cfg_path = write_config(tmp_path, workers=[sim_worker("sim-0")], api_keys=_keys())
    with start_stack(cfg_path, tmp_path / "run") as stack:
        base = stack.envoy_url
        r1 = _complete(base, KEY_Q, BIG_PROMPT)
        r2 = _complete(base, KEY_Q, BIG_PROMPT)
        assert r1.status_code == r2.status_code == 200, r1.text
        for r in (r1, r2):
            assert r.headers["x-ratelimit-limit-tokens"] == "3000"
            assert r.headers["x-ratelimit-limit-requests"] == "100"
            assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
        # decreasing: each request took 1 request and (1,000 + 1) tokens at admission
        assert int(r1.headers["x-ratelimit-remaining-requests"]) == 99
        assert int(r2.headers["x-ratelimit-remaining-requests"]) == 98
        assert 1990 <= int(r1.headers["x-ratelimit-remaining-tokens"]) <= 2000
        assert int(r2.headers["x-ratelimit-remaining-tokens"]) < int(r1.headers["x-ratelimit-remaining-tokens"])
        # the third does not fit: 429, OpenAI's body, which budget, a computed Retry-After.
        # It asks for 1,090 tokens against ~998 left: the budget refills 50 tokens/s,
        # so it stays short for ~1.8 s (a 1,001-token one fitted after ~60 ms: a slow
        # machine's three requests took longer than that).
        r3 = _complete(base, KEY_Q, BIG_PROMPT, max_tokens=90)
        assert r3.status_code == 429, r3.text
        err = r3.json()["error"]
        assert (err["code"], err["type"]) == ("rate_limit_exceeded", "tokens")
        assert "tokens per minute" in err["message"]
        assert (
            r3.headers["x-ratelimit-remaining-tokens"] == r2.headers["x-ratelimit-remaining-tokens"]
            or int(r3.headers["x-ratelimit-remaining-tokens"]) < 1090
        )
        wait = int(r3.headers["retry-after"])
        assert 1 <= wait <= 2
        time.sleep(wait)  # a client that waits that long is served
        assert _complete(base, KEY_Q, BIG_PROMPT).status_code == 200
        # a stream carries them too
        s = _complete(base, KEY_Q, stream=True)
        assert s.status_code == 200 and "x-ratelimit-remaining-tokens" in s.headers
        s.close()
        # max_tokens alone over the budget: 400 at once, no Retry-After
        big = _complete(base, KEY_Q, max_tokens=3000)
        assert big.status_code == 400 and big.json()["error"]["code"] == "request_exceeds_budget"
        assert "retry-after" not in big.headers
        # a key without budget: no such headers; malformed or unknown keys: 401, never 500
        free = _complete(base, KEY_R)
        assert free.status_code == 200 and "x-ratelimit-limit-tokens" not in free.headers
        for h in (
            {"authorization": "Bearer"},
            {"authorization": "Basic Zm9vOmJhcg=="},
            {"authorization": f"Bearer {KEY_Q} extra"},
            {"x-api-key": "a b"},
            {"authorization": "bearer x\ty"},
            {"x-api-key": KEY_Q[:-1]},
            {},
        ):
            bad = _complete(base, None, headers=h)
            assert bad.status_code == 401, (h, bad.status_code, bad.text)
        raw = socket.create_connection(("127.0.0.1", int(stack.router_url.rsplit(":", 1)[1])), timeout=5)
        body = b'{"model": "sim-tiny", "prompt": "x", "max_tokens": 1}'
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-api-key: \xff\xfe\x80\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
        )
        assert raw.recv(65536).startswith(b"HTTP/1.1 401")
        raw.close()
        # ZeroMQ clients get the same figures
        with Client(stack.zmq_frontend, api_key=KEY_Q, timeout_s=10) as c:
            got = c.complete(SIM_MODEL, prompt="hi", max_tokens=2)
            assert got.ratelimit.limit_tokens == 3000 and got.ratelimit.limit_requests == 100
            with pytest.raises(WeirError) as e:
                c.complete(SIM_MODEL, prompt="hi", max_tokens=4000)
            assert e.value.status == 400
        # admin view and metrics: per-tenant usage, refusals; key ids, never keys
        view = requests.get(stack.router_url + "/admin/tenants", timeout=5).json()
        q = view["tenants"]["q"]
        assert q["usage"]["requests"] >= 4 and q["usage"]["prompt_tokens"] >= 3000
        assert q["refusals"]["tokens"] == 1 and q["refusals"]["too_large"] == 2
        assert _metric(stack.router_url, "weir_tenant_tokens_total", tenant="q", kind="prompt") >= 3000
        assert _metric(stack.router_url, "weir_quota_refusals_total", tenant="q", budget="tokens") == 1
        # reload without a restart: SIGHUP to the router, then the admin call
        assert _complete(stack.router_url, KEY_NEW).status_code == 401
        _rewrite(cfg_path, api_keys=_keys([{"key_sha256": digest(KEY_NEW), "tenant": "n", "requests_per_minute": 1}]))
        os.kill(stack.components["router"].pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while _complete(stack.router_url, KEY_NEW).status_code == 401 and time.monotonic() < deadline:
            time.sleep(0.1)
        second = _complete(stack.router_url, KEY_NEW)
        assert second.status_code == 429 and second.json()["error"]["type"] == "requests"
        _rewrite(cfg_path, api_keys=_keys())
        assert requests.post(stack.router_url + "/admin/reload", timeout=5).json()["ok"] is True
        assert _complete(stack.router_url, KEY_NEW).status_code == 401
        secrets = [KEY_Q, KEY_R, KEY_NEW]
        assert not any(s in requests.get(stack.router_url + "/metrics", timeout=5).text for s in secrets)
        assert not any(s in str(view) for s in secrets)
    _no_key_text(tmp_path / "run", secrets)


# ------------------------------------------------------------------ Redis


def test_redis_credits_apply_once_and_undo_only_a_reserve_that_took(redis_url):
    """The scripts on a real Redis: a credit sent twice (a timeout after it
    ran) returns its tokens once; undoing a reserve that timed out returns
    what it took if it ran, and nothing if it never took."""
    import asyncio

    from router.tenancy.buckets import Bucket
    from router.tenancy.store_redis import RedisBudgetStore

    tpm = Bucket("k:exact:tpm", 1000, 60.0, True, "tokens_per_minute")

    async def scenario():
        store = RedisBudgetStore(redis_url, f"weir-exact-{os.getpid()}:", 2.0)

        def call(op, amount, hold_id):
            fut = asyncio.get_running_loop().create_future()
            store.submit(op, (tpm,), [amount], hold_id, fut.set_result)
            return fut

        def level(res):  # the level a refused 1,001-token reserve reports (it takes nothing; +17 a second of refill)
            return res[2][0]

        got = await call("reserve", 400, "h1")
        assert got[0] and got[2][0] == pytest.approx(600, abs=5)
        await call("credit", 300, "h1")
        await call("credit", 300, "h1")  # sent again: applied once
        assert level(await call("reserve", 1001, "probe")) == pytest.approx(900, abs=5)
        await call("credit", 500, "never-reserved")  # an undo of a reserve that never took: nothing
        assert level(await call("reserve", 1001, "probe")) == pytest.approx(900, abs=5)
        refused = await call("reserve", 5000, "h2")
        assert not refused[0]
        await call("credit", 5000, "h2")  # an undo of a refused reserve: nothing
        assert level(await call("reserve", 1001, "probe")) == pytest.approx(900, abs=5)
        await store.close()

    asyncio.run(scenario())


def test_two_routers_share_one_budget_in_redis(tmp_path, redis_url):
    keys = [{"key_sha256": digest(KEY_Q), "tenant": "q", "requests_per_minute": 4}]
    quota = {"store": "redis", "redis_url": redis_url, "redis_prefix": f"weir-test-{os.getpid()}:"}
    a = write_config(tmp_path / "a", workers=[sim_worker("sim-a")], api_keys=keys, quota=quota)
    b = write_config(tmp_path / "b", workers=[sim_worker("sim-b")], api_keys=keys, quota=quota)
    with start_stack(a, tmp_path / "run-a") as sa, start_stack(b, tmp_path / "run-b") as sb:
        got = [_complete(s.router_url, KEY_Q) for s in (sa, sb, sa, sb)]
        assert [r.status_code for r in got] == [200] * 4, [r.text for r in got]
        assert [r.headers["x-ratelimit-remaining-requests"] for r in got] == ["3", "2", "1", "0"]
        for s in (sa, sb):  # the one budget is spent, whichever router is asked
            r = _complete(s.router_url, KEY_Q)
            assert r.status_code == 429 and r.json()["error"]["type"] == "requests"
            assert 1 <= int(r.headers["retry-after"]) <= 16
        view = requests.get(sa.router_url + "/admin/tenants", timeout=5).json()
        assert view["store"] == "redis" and view["outstanding"] == 0 and not view["store_errors"]
    _no_key_text(tmp_path / "run-a", [KEY_Q])


def test_a_fan_out_is_charged_whole_or_refused_whole_in_redis_through_envoy(tmp_path, redis_url):
    """requests_per_minute = 10 in a real Redis, through Envoy: 20 embeddings
    inputs can never fit (400 at once, the bucket untouched); 4 prompts take 4
    units at once; 6 more are a 429 that takes none; a batch line of 20 inputs
    is failed once (an error entry), not retried while its batch waits."""
    from bench.localconfig import SIM_EMBED_MODEL, sim_embed_model

    keys = [{"key_sha256": digest(KEY_Q), "tenant": "q", "requests_per_minute": 10}]
    quota = {"store": "redis", "redis_url": redis_url, "redis_prefix": f"weir-fan-{os.getpid()}:"}
    cfg = write_config(
        tmp_path,
        models=[{"name": SIM_MODEL, "engine": "sim", "max_model_len": 4096}, sim_embed_model()],
        workers=[sim_worker("sim-0"), sim_worker("sim-e", model=SIM_EMBED_MODEL)],
        api_keys=keys,
        quota=quota,
        batch={"directory": str(tmp_path / "batches"), "scan_interval_s": 0.2},
    )
    with start_stack(cfg, tmp_path / "run") as s:
        h = {"authorization": f"Bearer {KEY_Q}"}

        def post(path, body):
            return requests.post(s.envoy_url + path, json=body, headers=h, timeout=30)

        def remaining(r):
            return int(r.headers["x-ratelimit-remaining-requests"])

        r = post("/v1/embeddings", {"model": SIM_EMBED_MODEL, "input": ["some text"] * 20})
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_exceeds_budget", r.text
        assert "retry-after" not in r.headers
        r = _complete(s.envoy_url, KEY_Q)
        assert r.status_code == 200 and remaining(r) == 9  # untouched by the 20
        r = post("/v1/completions", {"model": SIM_MODEL, "prompt": ["a", "b", "c", "d"], "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
        assert remaining(r) in (5, 6)  # 4 at once (and a unit may have refilled meanwhile)
        r = post("/v1/completions", {"model": SIM_MODEL, "prompt": ["e"] * 7, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "requests", r.text
        assert "needs 7 requests" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
        r = _complete(s.envoy_url, KEY_Q)
        assert r.status_code == 200 and remaining(r) in (4, 5)  # the 429 took nothing

        client = openai.OpenAI(base_url=s.envoy_url + "/v1", api_key=KEY_Q, max_retries=3, timeout=30)
        rows = [
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": SIM_EMBED_MODEL, "input": ["x"] * n},
            }
            for cid, n in (("twenty", 20), ("two", 2))
        ]
        f = client.files.create(
            file=("emb.jsonl", b"".join(msgspec.json.encode(r) + b"\n" for r in rows)), purpose="batch"
        )
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 60
        while (b := client.batches.retrieve(b.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, b.request_counts
            time.sleep(0.2)
        assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 1)
        (entry,) = [msgspec.json.decode(x) for x in client.files.content(b.error_file_id).content.splitlines()]
        assert entry["custom_id"] == "twenty" and entry["response"]["status_code"] == 400
        assert entry["response"]["body"]["error"]["code"] == "request_exceeds_budget"


def test_redis_unreachable_fails_open_then_closed(tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    keys = [{"key_sha256": digest(KEY_Q), "tenant": "q", "requests_per_minute": 100}]
    cfg_path = write_config(
        tmp_path,
        workers=[sim_worker("sim-0")],
        api_keys=keys,
        quota={"store": "redis", "redis_url": dead, "on_store_error": "open"},
    )
    with start_stack(cfg_path, tmp_path / "run") as stack:
        r = _complete(stack.router_url, KEY_Q)
        assert r.status_code == 200, r.text  # admitted, unmetered
        assert _metric(stack.router_url, "weir_quota_store_errors_total", op="reserve") >= 1
        _rewrite(cfg_path, quota={"store": "redis", "redis_url": dead, "on_store_error": "closed"})
        os.kill(stack.components["router"].pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while (r := _complete(stack.router_url, KEY_Q)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["error"]["code"] == "quota_unavailable"
        assert r.headers["retry-after"] == "1"
        # and the service itself is fine meanwhile
        assert requests.get(stack.router_url + "/health", timeout=5).status_code == 200
    log = (tmp_path / "run" / "router.log").read_text()
    assert "failing open" in log and "failing closed" in log


# ------------------------------------------------------------------ CURVE


def _wait(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_curve_lets_in_known_workers_and_clients_only(tmp_path):
    keys = tmp_path / "curve"
    curve.generate(keys, workers=["sim-0"], clients=["app"])
    curve.generate(tmp_path / "intruder", workers=["sim-x"], clients=["mallory"])  # not in keys/
    cfg_path = write_config(
        tmp_path,
        security={"curve": True, "curve_dir": str(keys)},
        workers=[
            sim_worker("sim-0"),
            sim_worker("sim-x", curve_secret_key=str(tmp_path / "intruder" / "workers" / "sim-x.key_secret")),
        ],
    )
    with start_stack(cfg_path, tmp_path / "run", workers=["sim-0"]) as stack:  # sim-0 registered: it got in
        ok = (str(keys / "clients" / "app.key_secret"), str(keys / "router.key"))
        with Client(stack.zmq_frontend, timeout_s=10, curve=ok) as c:
            assert c.complete(SIM_MODEL, prompt="hello", max_tokens=3).completion_tokens == 3
        bad = (str(tmp_path / "intruder" / "clients" / "mallory.key_secret"), str(keys / "router.key"))
        with Client(stack.zmq_frontend, timeout_s=1.5, curve=bad) as c:
            with pytest.raises(TimeoutError):
                c.complete(SIM_MODEL, prompt="hello", max_tokens=3)
        with Client(stack.zmq_frontend, timeout_s=1.0) as c:  # no CURVE at all
            with pytest.raises(TimeoutError):
                c.complete(SIM_MODEL, prompt="hello", max_tokens=3)
        assert _wait(lambda: _metric(stack.router_url, "weir_zmq_auth_denied_total", domain="clients") >= 1, 5)
        # a worker with a key the router does not know never registers
        intruder = subprocess.Popen(
            [sys.executable, "-m", "engine_worker", "--config", str(cfg_path), "--worker-id", "sim-x"],
            cwd=str(REPO),
            process_group=0,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert _wait(lambda: _metric(stack.router_url, "weir_zmq_auth_denied_total", domain="workers") >= 1, 15)
            ids = [w["id"] for w in requests.get(stack.router_url + "/admin/workers", timeout=5).json()]
            assert ids == ["sim-0"]
        finally:
            os.killpg(intruder.pid, signal.SIGTERM)
            intruder.wait(10)
    log = (tmp_path / "run" / "router.log").read_text()
    assert "CURVE: refused a clients key" in log and "CURVE: refused a workers key" in log
    secret_z85 = [
        line.split('"')[1]
        for f in keys.rglob("*.key_secret")
        for line in f.read_text().splitlines()
        if "secret-key" in line
    ]
    assert secret_z85
    _no_key_text(tmp_path / "run", secret_z85)


# ------------------------------------------------------------------ TLS


def _self_signed(d: Path) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("weir test CA"))
        .issuer_name(name("weir test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = d / "ca.pem", d / "cert.pem", d / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    os.chmod(paths[2], 0o600)
    return paths


def test_tls_at_envoy_with_the_openai_sdk(tmp_path):
    ca, cert, key = _self_signed(tmp_path)
    cfg_path = write_config(
        tmp_path,
        workers=[sim_worker("sim-0")],
        api_keys=_keys(),
        envoy={"tls_cert_file": str(cert), "tls_key_file": str(key)},
    )
    with start_stack(cfg_path, tmp_path / "run") as stack:
        assert stack.envoy_url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(ca))) as http:
            client = openai.OpenAI(base_url=stack.envoy_url + "/v1", api_key=KEY_Q, http_client=http, max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model=SIM_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            out = raw.parse()
            assert out.usage.completion_tokens == 4
            assert raw.headers["x-ratelimit-limit-tokens"] == "3000"
            streamed = client.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=3, stream=True)
            assert sum(1 for _ in streamed) >= 3
        with pytest.raises(requests.exceptions.SSLError):  # the CA is needed: nothing else is trusted
            requests.get(stack.envoy_url + "/health", timeout=5)
        with pytest.raises(requests.exceptions.ConnectionError):  # and no plain HTTP on that port
            requests.get(stack.envoy_url.replace("https://", "http://") + "/health", timeout=5)
