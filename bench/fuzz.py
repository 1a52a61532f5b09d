"""Hostile input for a running stack: generators and the checks every case must pass.

Shared by the suite (tests/e2e/test_fuzz.py, a few hundred cases per target in
seconds) and the long run (``python -m bench.scenarios.fuzz``, 10,000+ per
target).  Targets:

  * ``http``: OpenAI request bodies -- right and wrong JSON types, huge and
    deep values, unknown fields, bad headers -- to ``/v1/completions`` and
    ``/v1/chat/completions``, through Envoy or straight at the router;
  * ``raw_http``: malformed HTTP/1.1 on a raw socket -- bad methods, header
    garbage, lying Content-Length, pipelining, requests cut off mid-way
    (slowloris-style partial sends);
  * ``frontend`` / ``backend``: random and mutated msgpack frames at the
    router's two ZeroMQ sockets, from identities that never registered, and
    valid-looking messages with wrong ids.

Every case must end in a typed answer (an HTTP status with an OpenAI JSON
error body, or a ZeroMQ error Delta) or a dropped frame/closed connection:
never a 500 from the router, a crash, a stuck job or a reservation left.
"""

from __future__ import annotations

import json
import random
import socket
from typing import Any

import msgspec

from shared import protocol as p

ALLOWED_STATUS = {200, 400, 401, 404, 405, 413, 429, 503}
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "response_format",
    "logit_bias",
    "min_tokens",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "priority",
    "task_type",
    "user",
    "tools",
    "structured_outputs",
]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 7, 16, 2**31, 2**63, -(2**63), 10**30])
    if kind == 3:
        return rng.choice([0.0, -0.5, 0.5, 1.0, 2.5, 1e308, -1e308, float("nan")])
    if kind == 4:
        return rng.choice(
            [
                "",
                "hi",
                "sim-tiny",
                "tiny-llama",
                "x" * rng.randrange(1, 5000),
                "\u0000\ud7ff\u00e9",
                "<|assistant|>",
                "low",
                "short",
            ]
        )
    if kind == 5:
        return "é" * rng.randrange(1, 300)
    if kind == 6:
        return rng.randrange(-10, 5000)
    if kind in (7, 8):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if kind == 9:
        return {
            rng.choice(FIELDS + ["role", "content", "type", "text"]): _value(rng, depth + 1)
            for _ in range(rng.randrange(0, 4))
        }
    if kind == 10:
        return [
            {"role": rng.choice(["user", "system", "assistant", "tool", "nobody"]), "content": _value(rng, depth + 1)}
            for _ in range(rng.randrange(0, 3))
        ]
    return {
        "type": rng.choice(["text", "json_object", "json_schema", "image_url"]),
        "json_schema": _value(rng, depth + 1),
    }


def http_body(rng: random.Random, model: str) -> bytes:
    """A mostly-plausible request body with a few fields gone wrong."""
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randrange(1, 8)}
    if rng.random() < 0.5:
        body["prompt"] = "fuzz " * rng.randrange(1, 20)
    else:
        body["messages"] = [{"role": "user", "content": "fuzz"}]
    for _ in range(rng.randrange(0, 6)):
        body[rng.choice(FIELDS)] = _value(rng)
    r = rng.random()
    if r < 0.05:
        return b"[" * rng.randrange(100, 5000)  # deep nesting
    if r < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))  # not JSON
    if r < 0.13:
        return json.dumps(_value(rng)).encode()  # JSON, but not an object
    try:
        return json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return b"{}"


def check_http(status: int, headers: dict[str, str], body: bytes) -> str | None:
    """What is wrong with this answer, or None."""
    if status not in ALLOWED_STATUS:
        return f"status {status}: {body[:200]!r}"
    if status >= 400:
        try:
            err = json.loads(body)["error"]
            assert isinstance(err["message"], str) and "type" in err and "code" in err
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"status {status} without an OpenAI error body: {body[:200]!r}"
        if status in (429, 503) and "retry-after" not in headers:
            return f"status {status} without Retry-After"
    return None


def raw_http(rng: random.Random, path: str) -> bytes:
    """Malformed or unusual HTTP/1.1 bytes."""
    body = b'{"model": "sim-tiny", "prompt": "hi", "max_tokens": 2}'
    method = rng.choice([b"POST", b"GET", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"P\x00ST", b"BREW", b"HEAD"])
    lines = [
        method
        + b" "
        + rng.choice([path.encode(), b"/v1/../admin/workers", b"*", b"/%zz", b"/" + b"a" * 9000])
        + b" "
        + rng.choice([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b""])
    ]
    headers = [b"host: localhost", b"content-type: application/json"]
    length = rng.choice([len(body), len(body) + 10, 0, -1, 10**12])
    headers.append(b"content-length: %d" % length if length >= 0 else b"content-length: nope")
    for _ in range(rng.randrange(0, 4)):
        headers.append(
            rng.choice(
                [
                    b"x-api-key: \xff\xfe",
                    b"authorization: Bearer",
                    b"authorization: " + b"b" * 5000,
                    b"transfer-encoding: chunked",
                    b"expect: 100-continue",
                    b": empty",
                    b"x-weir-priority: \x01",
                    b"connection: close",
                    b"upgrade: h2c",
                ]
            )
        )
    req = b"\r\n".join(lines + headers) + b"\r\n\r\n" + body
    r = rng.random()
    if r < 0.2:
        req = req[: rng.randrange(1, len(req))]  # cut off: the server must not wait forever
    elif r < 0.35:
        req = req * rng.randrange(2, 5)  # pipelined
    return req


def send_raw(host: str, port: int, data: bytes, timeout: float = 3.0, half_close: bool = True) -> bytes:
    """Send ``data`` and read until the peer closes or goes quiet.  ``half_close``:
    end our side at once (the router answers what it has); Envoy closes on a
    client's FIN, so for it the request asks ``connection: close`` instead."""
    if not half_close and b"\r\n\r\n" in data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        data = head + b"\r\nconnection: close" + sep + rest
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out.append(chunk)
                s.settimeout(0.05)  # answered: the rest comes at once or not at all
        except OSError:
            pass
        return b"".join(out)


def check_raw(answer: bytes) -> str | None:
    """Each response in a raw answer is well-formed and none is a 500 from the router."""
    if not answer:
        return None  # closed without an answer: allowed for garbage
    if not answer.startswith(b"HTTP/1."):
        return f"not an HTTP response: {answer[:80]!r}"
    for part in answer.split(b"HTTP/1.")[1:]:
        status = part[2:5]
        if status.isdigit() and int(status) == 500:
            return f"500: {part[:300]!r}"
    return None


def _msgpack(obj: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except OverflowError:  # an int msgpack cannot carry: the largest it can
        return msgspec.msgpack.encode(json.loads(json.dumps(obj).replace(str(10**30), str(2**64 - 1))))


def zmq_frame(rng: random.Random, side: str) -> bytes:
    """A random, mutated or valid-looking-but-wrong message for one ZeroMQ side."""
    r = rng.random()
    if r < 0.2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if side == "frontend":
        if r < 0.6:
            sub = [
                1,
                f"fz-{rng.randrange(10**6)}",
                rng.choice(["sim-tiny", "nope", ""]),
                rng.choice([0, 1, 7, "x"]),
                _value(rng),
                _value(rng),
                _value(rng),
                _value(rng),
                _value(rng),
                _value(rng),
                _value(rng),
            ]
            return _msgpack(sub[: rng.randrange(1, len(sub) + 1)])
        if r < 0.8:
            return _msgpack([2, [f"fz-{rng.randrange(100)}" for _ in range(rng.randrange(0, 4))]])
        return _msgpack([rng.choice([3, 10, 11, 12, 13, 14, 15, 99]), _value(rng)])
    if r < 0.5:  # backend: outputs for jobs that do not exist / are not its
        deltas = [
            [format(rng.randrange(1, 5000), "x"), "x", 1, rng.choice([None, "stop", "length"]), 1, 1]
            for _ in range(rng.randrange(1, 4))
        ]
        return _msgpack([3, deltas])
    if r < 0.7:
        return _msgpack(
            [
                10,
                f"ghost-{rng.randrange(10)}",
                "sim-tiny",
                rng.choice([0, 1, 2, 9]),
                _value(rng),
                _value(rng),
                _value(rng),
                _value(rng),
                "sim",
            ]
        )
    return _msgpack([rng.choice([11, 12, 15, 13, 14, 1, 99]), _value(rng)])


def decode_outputs(payload: bytes) -> str | None:
    """A frontend reply must decode as Outputs."""
    try:
        p.to_client_decoder.decode(payload)
    except msgspec.DecodeError as e:
        return f"undecodable reply: {e}"
    return None
