"""Hostile input at every entrance of a running stack (bench/fuzz.py has the
generators and checks; ``python -m bench.scenarios.fuzz`` runs 10,000+ cases
per target).  Here a few hundred per target, seeded, in seconds: every
answer typed, nothing crashes, nothing stays reserved."""

from __future__ import annotations

import random
import time

import requests
import zmq
from stackutil import SIM_MODEL

from bench import fuzz
from shared.client import Client


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _still_serving(stack) -> None:
    assert requests.get(stack.router_url + "/health", timeout=5).status_code == 200
    with Client(stack.zmq_frontend) as c:
        assert c.complete(SIM_MODEL, prompt="still there?", max_tokens=3).completion_tokens == 3
    deadline = time.monotonic() + 10
    while True:
        workers = requests.get(stack.router_url + "/admin/workers", timeout=5).json()
        if all(w["reserved_tokens"] == 0 and w["running"] == 0 for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(w["reserved_tokens"] == 0 and w["running"] == 0 for w in workers), workers
    assert not any(q["queued"] for q in requests.get(stack.router_url + "/admin/queues", timeout=5).json())


def test_fuzzed_openai_bodies_get_typed_answers(sim_stack):
    rng = random.Random(1)
    problems = []
    with requests.Session() as s:
        for i in range(400):
            base = sim_stack.envoy_url if i % 4 == 0 else sim_stack.router_url  # a quarter through Envoy
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            body = fuzz.http_body(rng, rng.choice([SIM_MODEL, SIM_MODEL, "nope"]))
            r = s.post(base + path, data=body, headers={"content-type": "application/json"}, timeout=30)
            bad = fuzz.check_http(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)
            if bad:
                problems.append((body[:200], bad))
    assert not problems, problems[:5]
    _still_serving(sim_stack)


def test_malformed_http_never_gets_a_500(sim_stack):
    rng = random.Random(2)
    problems = []
    for i in range(150):
        via_envoy = i % 3 == 0
        host, port = _host_port(sim_stack.envoy_url if via_envoy else sim_stack.router_url)
        data = fuzz.raw_http(rng, rng.choice(["/v1/completions", "/v1/chat/completions", "/health"]))
        bad = fuzz.check_raw(fuzz.send_raw(host, port, data, timeout=1.0, half_close=not via_envoy))
        if bad:
            problems.append((data[:200], bad))
    assert not problems, problems[:5]
    _still_serving(sim_stack)


def test_random_frames_at_both_zeromq_sockets_are_dropped_or_answered(sim_stack):
    rng = random.Random(3)
    ctx = zmq.Context.instance()
    front = ctx.socket(zmq.DEALER)
    front.setsockopt(zmq.LINGER, 0)
    front.connect(sim_stack.zmq_frontend)
    backs = []
    for i in range(5):  # identities that never registered (one impersonates the real worker's)
        b = ctx.socket(zmq.DEALER)
        b.setsockopt(zmq.LINGER, 0)
        b.setsockopt(zmq.IDENTITY, f"ghost-{i}".encode())
        b.connect(sim_stack.cfg.router.backend)
        backs.append(b)
    try:
        for i in range(400):
            front.send(fuzz.zmq_frame(rng, "frontend"))
            backs[i % len(backs)].send(fuzz.zmq_frame(rng, "backend"))
        problems = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if front.poll(100):
                bad = fuzz.decode_outputs(front.recv())
                if bad:
                    problems.append(bad)
        assert not problems, problems[:5]
    finally:
        front.close()
        for b in backs:
            b.close()
    workers = requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()
    assert {w["id"] for w in workers} == {"sim-0"}  # no ghost registered
    _still_serving(sim_stack)
