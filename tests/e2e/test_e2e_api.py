"""End to end through real processes: Envoy -> router -> vLLM worker (tiny model), and direct ZeroMQ.

Uses the session ``stack`` fixture (tests/e2e/conftest.py): one real vLLM worker on
``tiny-llama`` plus a sim worker, API keys configured.
"""

from __future__ import annotations

import json
import re
import socket
import time

import openai
import pytest
import requests
import zmq
from stackutil import KEY_ALPHA, KEY_BETA, LONG_STREAM_TOKENS, SIM_MODEL, TINY_MODEL_DIR, TOO_LONG_PROMPT, VLLM_MODEL
from tokenizers import Tokenizer

from shared import protocol as p
from shared.client import AsyncClient, Client, WeirError

PROMPT = "The quick brown fox jumps over the lazy dog."


def sdk(stack, key=KEY_ALPHA) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.envoy_url + "/v1", api_key=key, max_retries=0, timeout=60)


def worker_row(stack, worker_id: str) -> dict:
    rows = requests.get(stack.router_url + "/admin/workers", timeout=5).json()
    return next(r for r in rows if r["id"] == worker_id)


def metric(stack, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    text = requests.get(stack.router_url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? ([0-9.eE+-]+|NaN)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(4))
    return total


def wait_until(pred, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def test_models_lists_configured_models(stack):
    ids = {m.id for m in sdk(stack).models.list()}
    assert {VLLM_MODEL, SIM_MODEL} <= ids


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-bad key"}],
    ids=["no-key", "wrong-key", "malformed-key"],
)
def test_models_need_a_valid_key_as_a_completion_does(stack, headers):
    """The served models and aliases are shown to a valid key only: without
    one, /v1/models and /v1/models/{id} answer what a completion answers
    (through Envoy and at the router itself)."""
    for base in (stack.envoy_url, stack.router_url):
        completion = requests.post(
            base + "/v1/completions", json={"model": VLLM_MODEL, "prompt": "hi"}, headers=headers, timeout=30
        )
        assert completion.status_code == 401, completion.text
        expected = completion.json()["error"]
        expected.pop("request_id")  # each request's own
        for path in ("/v1/models", f"/v1/models/{VLLM_MODEL}"):
            r = requests.get(base + path, headers=headers, timeout=10)
            assert r.status_code == 401, (base, path, r.text)
            err = r.json()["error"]
            err.pop("request_id", None)
            assert err == expected and err["code"] == "invalid_api_key", (base, path)
            assert VLLM_MODEL not in r.text and SIM_MODEL not in r.text
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, key="sk-wrong").models.retrieve(VLLM_MODEL)
    assert sdk(stack, key=KEY_BETA).models.retrieve(SIM_MODEL).id == SIM_MODEL


def test_frequency_penalty_reaches_vllm(stack):
    # Greedy decoding of the random tiny model repeats one token; a strong
    # frequency penalty (applied by vLLM, not the router) must break that up.
    c = sdk(stack)
    texts = [
        c.completions.create(model=VLLM_MODEL, prompt=PROMPT, max_tokens=48, temperature=0, frequency_penalty=fp)
        .choices[0]
        .text
        for fp in (0.0, 2.0)
    ]
    assert len(set(texts[1])) > len(set(texts[0])), texts


def test_openai_sdk_completion_and_streamed_chat_on_vllm(stack):
    client = sdk(stack)
    tok = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))

    done = client.completions.create(model=VLLM_MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = done.choices[0]
    assert done.object == "text_completion" and done.model == VLLM_MODEL
    assert choice.finish_reason in ("stop", "length")
    # The engine counted the prompt with the model's own tokenizer.
    assert done.usage.prompt_tokens == len(tok.encode(PROMPT).ids)
    assert 1 <= done.usage.completion_tokens <= 12
    if choice.finish_reason == "length":
        assert done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

    # Greedy decoding: the streamed chat must deliver exactly what the non-streamed one returns.
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    whole = client.chat.completions.create(model=VLLM_MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=VLLM_MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finishes == [whole.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > len(tok.encode(messages[0]["content"]).ids)
    if finishes == ["length"]:
        assert usage.completion_tokens == 16


def test_direct_zeromq_client_streams_from_vllm(stack):
    with Client(stack.zmq_frontend, api_key=KEY_BETA) as c:
        deltas = list(c.stream(VLLM_MODEL, prompt=PROMPT, max_tokens=10, temperature=0))
        whole = c.complete(VLLM_MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert deltas[-1].finish_reason in ("stop", "length")
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert sum(d.num_tokens for d in deltas) == deltas[-1].completion_tokens == whole.completion_tokens
    assert "".join(d.text for d in deltas) == whole.text
    # Same engine, same answer over HTTP.
    http = sdk(stack).completions.create(model=VLLM_MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert http.choices[0].text == whole.text


def test_async_zeromq_client_runs_concurrent_requests(stack):
    import asyncio

    async def run():
        async with AsyncClient(stack.zmq_frontend, api_key=KEY_BETA) as c:
            return await asyncio.gather(
                *[c.complete(VLLM_MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, ignore_eos=True) for i in range(12)]
            )

    results = asyncio.run(run())
    assert [r.finish_reason for r in results] == ["length"] * 12
    assert all(r.completion_tokens == 8 for r in results)


BAD_INPUTS = [
    # (body or raw bytes, headers, status, param or None)
    (b"{not json", {}, 400, None),
    ({"prompt": "hi"}, {}, 400, "model"),
    ({"model": VLLM_MODEL, "prompt": 42}, {}, 400, "prompt"),
    ({"model": VLLM_MODEL, "prompt": "hi", "temperature": 7}, {}, 400, "temperature"),
    ({"model": VLLM_MODEL, "prompt": "hi", "max_tokens": 0}, {}, 400, "max_tokens"),
    ({"model": VLLM_MODEL, "prompt": "hi", "n": 3, "temperature": 0}, {}, 400, "n"),
    ({"model": "no-such-model", "prompt": "hi"}, {}, 404, "model"),
    ({"model": VLLM_MODEL, "prompt": "hi", "max_tokens": 100000}, {}, 400, "max_tokens"),
    ({"model": VLLM_MODEL, "prompt": TOO_LONG_PROMPT, "max_tokens": 4}, {}, 400, None),
    ({"model": VLLM_MODEL, "prompt": "hi", "priority": "ultra"}, {}, 400, "priority"),
    # beyond 64 bits: once it was accepted, then could not be encoded for the worker (found by fuzzing)
    ({"model": VLLM_MODEL, "prompt": "hi", "seed": 10**30}, {}, 400, "seed"),
    ({"model": VLLM_MODEL, "prompt": "hi"}, {"Authorization": "Bearer sk-wrong"}, 401, None),
]


@pytest.mark.parametrize("body,headers,status,param", BAD_INPUTS)
def test_bad_input_gets_openai_error_then_service_continues(stack, body, headers, status, param):
    hdrs = {"Authorization": f"Bearer {KEY_BETA}", "content-type": "application/json", **headers}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(stack.envoy_url + "/v1/completions", data=data, headers=hdrs, timeout=30)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    ok = requests.post(
        stack.envoy_url + "/v1/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {KEY_BETA}"},
        json={"model": VLLM_MODEL, "prompt": "hi", "max_tokens": 2},
    )
    assert ok.status_code == 200, ok.text


def test_same_errors_reach_zeromq_clients(stack):
    with Client(stack.zmq_frontend, api_key=KEY_BETA) as c:
        with pytest.raises(WeirError) as e:
            c.complete("no-such-model", prompt="hi")
        assert e.value.status == 404 and e.value.error.param == "model"
        with pytest.raises(WeirError) as e:
            c.complete(VLLM_MODEL, prompt=TOO_LONG_PROMPT, max_tokens=4)
        assert e.value.status == 400 and "maximum context length" in e.value.error.message
        assert c.complete(VLLM_MODEL, prompt="hi", max_tokens=2).completion_tokens >= 1
    with Client(stack.zmq_frontend, api_key="sk-wrong") as c:
        with pytest.raises(WeirError) as e:
            c.complete(VLLM_MODEL, prompt="hi")
        assert e.value.status == 401


def test_an_invalid_zeromq_submit_gets_a_400_naming_the_field(stack):
    """Ranges are the wire types' own: decoding refuses temperature 3, and a
    Submit that still names its request id is answered, not dropped."""
    with Client(stack.zmq_frontend, api_key=KEY_BETA) as c:
        with pytest.raises(WeirError) as e:
            c.complete(SIM_MODEL, prompt="hi", max_tokens=2, temperature=3.0)
        assert e.value.status == 400 and e.value.error.param == "params.temperature"
        with pytest.raises(WeirError) as e:
            c.complete(SIM_MODEL, prompt="hi", max_tokens=0)
        assert e.value.status == 400 and e.value.error.param == "max_tokens"
        assert c.complete(SIM_MODEL, prompt="hi", max_tokens=2).completion_tokens == 2


def test_malformed_frames_are_dropped_and_router_survives(stack):
    ctx = zmq.Context.instance()
    before = metric(stack, "weir_malformed_frames_total")
    for addr in (stack.zmq_frontend, stack.cfg.router.backend):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 500)
        s.connect(addr)
        s.send(b"\xc1garbage")  # 0xc1 is never valid msgpack
        s.send_multipart([b"two", b"frames"])
        s.send(p.encoder.encode(p.Heartbeat()))  # valid msgpack, wrong direction for the frontend
        time.sleep(0.2)
        s.close()
    assert wait_until(lambda: metric(stack, "weir_malformed_frames_total") >= before + 4)
    with Client(stack.zmq_frontend, api_key=KEY_BETA) as c:
        assert c.complete(SIM_MODEL, prompt="still alive?", max_tokens=3).completion_tokens == 3
    assert requests.get(stack.router_url + "/health", timeout=5).status_code == 200


def test_client_disconnect_mid_stream_aborts_on_worker(stack):
    before = worker_row(stack, "vllm-0")["aborts"]
    body = json.dumps(
        {"model": VLLM_MODEL, "prompt": PROMPT, "max_tokens": LONG_STREAM_TOKENS, "ignore_eos": True, "stream": True}
    ).encode()
    host, port = stack.envoy_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + KEY_BETA.encode() + b"\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )
        got = b""
        while got.count(b"data: ") < 3:  # the stream is flowing
            got += s.recv(65536)
    # Envoy closes its upstream connection; the router cancels; the worker aborts in vLLM.
    assert wait_until(lambda: worker_row(stack, "vllm-0")["aborts"] > before, timeout=15)
    assert wait_until(lambda: worker_row(stack, "vllm-0")["reserved_tokens"] == 0, timeout=15)
    assert metric(stack, "weir_requests_total", model=VLLM_MODEL, outcome="cancelled") >= 1


def test_zeromq_client_leaving_a_stream_cancels_it(stack):
    before = worker_row(stack, "vllm-0")["aborts"]
    with Client(stack.zmq_frontend, api_key=KEY_BETA) as c:
        it = c.stream(VLLM_MODEL, prompt=PROMPT, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True)
        next(it), next(it)
        it.close()  # sends Cancel
    assert wait_until(lambda: worker_row(stack, "vllm-0")["aborts"] > before, timeout=15)
    assert wait_until(lambda: worker_row(stack, "vllm-0")["reserved_tokens"] == 0, timeout=15)


def test_metrics_move_when_requests_are_served(stack):
    labels = {"model": SIM_MODEL}
    done_before = metric(stack, "weir_requests_total", outcome="length", **labels)
    ttft_before = metric(stack, "weir_time_to_first_token_seconds_count", **labels)
    tokens_before = metric(stack, "weir_output_tokens_total", **labels)
    http_before = metric(stack, "weir_http_requests_total", path="/v1/completions", status="200")
    for _ in range(3):
        r = requests.post(
            stack.envoy_url + "/v1/completions",
            timeout=30,
            headers={"x-api-key": KEY_BETA},
            json={"model": SIM_MODEL, "prompt": "count me", "max_tokens": 5},
        )
        assert r.status_code == 200
    assert metric(stack, "weir_requests_total", outcome="length", **labels) == done_before + 3
    assert metric(stack, "weir_time_to_first_token_seconds_count", **labels) == ttft_before + 3
    assert metric(stack, "weir_output_tokens_total", **labels) == tokens_before + 15
    assert metric(stack, "weir_http_requests_total", path="/v1/completions", status="200") == http_before + 3
    assert metric(stack, "weir_request_duration_seconds_bucket", le="+Inf", **labels) >= 3
    assert metric(stack, "weir_worker_capacity_tokens", worker="vllm-0") > 0
