"""The worker process over its real ZeroMQ link.

Starts ``python -m engine_worker`` (simulated engine) and stands in for the
router's end of the link with a real ROUTER socket bound by the test.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from shared.protocol import (
    Abort,
    Delta,
    Dispatch,
    Drain,
    GenerateRequest,
    Goodbye,
    Heartbeat,
    Outputs,
    Pool,
    Register,
    SamplingParams,
    encoder,
    worker_decoder,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER_ID = "sim-link-0"
HB_S = 0.2


class RouterEnd:
    """The router's side of the link, synchronous: enough to drive one worker."""

    def __init__(self, answer_heartbeats: bool = True):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Like the real router: a reconnecting worker's new connection takes over its identity.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.answer_heartbeats = answer_heartbeats
        self.identity: bytes | None = None
        self.last_stats = None

    def recv(self, timeout: float = 5.0):
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("nothing from the worker")
        ident, payload = self.sock.recv_multipart()
        self.identity = ident
        msg = worker_decoder.decode(payload)
        if isinstance(msg, Heartbeat):
            self.last_stats = msg.stats
            if self.answer_heartbeats:
                self.send(Heartbeat())
        return msg

    def recv_type(self, typ, timeout: float = 5.0):
        """Next message of ``typ``, skipping heartbeats (still answered)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(msg, typ):
                return msg
            assert isinstance(msg, Heartbeat), f"unexpected {msg!r}"

    def send(self, msg) -> None:
        self.send_raw([encoder.encode(msg)])

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([self.identity or WORKER_ID.encode(), *frames])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def write_config(tmp_path: Path, port: int) -> Path:
    cfg = tmp_path / "weir.toml"
    cfg.write_text(f"""
[router]
backend = "tcp://127.0.0.1:{port}"
heartbeat_interval_s = {HB_S}
heartbeat_liveness = 3
log_level = "info"

[[models]]
name = "sim-link"
engine = "sim"
max_model_len = 1024

[[workers]]
id = "{WORKER_ID}"
model = "sim-link"
pool = "short"
max_num_seqs = 8
[workers.sim]
kv_capacity_tokens = 8192
block_size = 16
step_fixed_ms = 2.0
decode_token_us = 50.0
""")
    return cfg


@pytest.fixture
def link(tmp_path):
    router = RouterEnd()
    cfg = write_config(tmp_path, router.port)
    log = open(tmp_path / "worker.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_worker", "--config", str(cfg), "--worker-id", WORKER_ID],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    proc.log_path = tmp_path / "worker.log"
    try:
        yield router, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        router.close()


def req(rid: str, max_tokens: int = 6, prompt_tokens: int = 5, **kw) -> GenerateRequest:
    """A request as the router sends a simulated engine: its prompt's length, no ids."""
    return GenerateRequest(rid, [], prompt_tokens, SamplingParams(max_tokens=max_tokens), **kw)


def collect(router: RouterEnd, ids: set[str], timeout: float = 10.0):
    """Outputs until every id in ``ids`` has its final Delta: (messages, deltas by id)."""
    by_id: dict[str, list[Delta]] = {i: [] for i in ids}
    messages = 0
    deadline = time.monotonic() + timeout
    open_ids = set(ids)
    while open_ids:
        out = router.recv_type(Outputs, max(0.01, deadline - time.monotonic()))
        messages += 1
        for d in out.deltas:
            assert d.request_id in open_ids, f"delta after final or unknown: {d!r}"
            by_id[d.request_id].append(d)
            if d.finish_reason or d.error:
                open_ids.discard(d.request_id)
    return messages, by_id


def test_register_then_heartbeats_with_stats(link):
    router, proc = link
    reg = router.recv_type(Register, timeout=20)
    assert router.identity == WORKER_ID.encode()
    assert (reg.worker_id, reg.model, reg.pool, reg.engine) == (WORKER_ID, "sim-link", Pool.SHORT, "sim")
    assert (reg.max_model_len, reg.kv_capacity_tokens, reg.block_size, reg.max_num_seqs) == (1024, 8192, 16, 8)
    assert reg.gpu.present is False
    t0 = time.monotonic()
    hb = router.recv(timeout=2)
    assert isinstance(hb, Heartbeat) and hb.stats is not None
    assert hb.stats.running == 0 and hb.stats.kv_usage == 0.0
    assert time.monotonic() - t0 < 1.0 + HB_S  # at the interval (with room for a loaded machine)
    assert proc.poll() is None


def test_dispatch_streams_batched_outputs(link):
    router, _ = link
    router.recv_type(Register, timeout=20)
    n, max_tokens = 8, 6
    ids = {f"r{i}" for i in range(n)}
    router.send(Dispatch([req(i, max_tokens, prompt_tokens=3 + len(i)) for i in sorted(ids)]))
    messages, by_id = collect(router, ids)
    deltas = sum(len(v) for v in by_id.values())
    assert deltas == n * max_tokens
    assert messages < deltas / 4, f"{messages} messages for {deltas} deltas: not batched per step"
    for rid, ds in by_id.items():
        assert [d.completion_tokens for d in ds] == list(range(1, max_tokens + 1))
        assert all(d.num_tokens == 1 and d.text for d in ds)
        assert ds[0].prompt_tokens == 3 + len(rid) == ds[-1].prompt_tokens  # the router's count, kept
        assert [len(d.token_ids) for d in ds] == [1] * max_tokens
        assert [d.finish_reason for d in ds] == [None] * (max_tokens - 1) + ["length"]
    # stats catch up on the next heartbeat
    deadline = time.monotonic() + 2
    while not (router.last_stats and router.last_stats.finished_total == n):
        router.recv(max(0.01, deadline - time.monotonic()))
    assert router.last_stats.running == 0


def test_abort_and_bad_request(link):
    router, proc = link
    router.recv_type(Register, timeout=20)
    router.send(Dispatch([req("long", max_tokens=1000), req("huge", prompt_tokens=2000)]))
    first: dict[str, Delta] = {}
    while len(first) < 2:
        for d in router.recv_type(Outputs).deltas:
            first.setdefault(d.request_id, d)
    err = first["huge"].error
    assert err is not None and err.status == 400 and "maximum context length" in err.message
    assert first["long"].error is None and first["long"].finish_reason is None
    router.send(Abort(["long", "never-dispatched"]))
    _, by_id = collect(router, {"long"})
    last = by_id["long"][-1]
    assert last.finish_reason == "abort" and last.completion_tokens < 1000
    deadline = time.monotonic() + 2
    while not (router.last_stats and router.last_stats.aborts_total == 1):
        router.recv(max(0.01, deadline - time.monotonic()))
    assert router.last_stats.running == 0 and router.last_stats.waiting == 0
    assert proc.poll() is None


def test_garbage_frames_are_dropped(link):
    router, proc = link
    router.recv_type(Register, timeout=20)
    router.send_raw([b"\xc1 not msgpack"])
    router.send_raw([b"two", b"frames"])
    router.send_raw([encoder.encode({"t": 99})])  # unknown tag
    router.send_raw([encoder.encode(Outputs([]))])  # valid msgpack, wrong direction
    router.send(Dispatch([req("after-garbage", max_tokens=2)]))
    _, by_id = collect(router, {"after-garbage"})
    assert by_id["after-garbage"][-1].finish_reason == "length"
    assert proc.poll() is None
    assert "malformed" in proc.log_path.read_text()


def test_sigterm_drains_then_says_goodbye_and_exits_zero(link):
    """SIGTERM: Drain first; the request in flight runs to its end; then Goodbye, exit 0."""
    router, proc = link
    router.recv_type(Register, timeout=20)
    router.send(Dispatch([req("inflight", max_tokens=300)]))
    router.recv_type(Outputs)
    proc.send_signal(signal.SIGTERM)
    seen, last = [], None
    deadline = time.monotonic() + 10
    while not seen or not isinstance(seen[-1], Goodbye):
        msg = router.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, Outputs):
            last = msg.deltas[-1]
        elif not isinstance(msg, Heartbeat):
            seen.append(msg)
    assert isinstance(seen[0], Drain) and seen[0].reason == "SIGTERM"
    assert last.finish_reason == "length" and last.completion_tokens == 300  # finished, not cut off
    assert seen[-1].reason == "drained" and proc.wait(10) == 0


def test_a_router_that_learns_of_a_draining_worker_again_is_told_it_drains(link):
    """Goodbye (a router restarted) during a drain: the worker registers there
    again and says at once that it is draining -- to that router."""
    router, proc = link
    router.recv_type(Register, timeout=20)
    router.send(Dispatch([req("inflight", max_tokens=2000)]))
    router.recv_type(Outputs)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not isinstance(router.recv(max(0.01, deadline - time.monotonic())), Drain):
        pass  # (its outputs and heartbeats meanwhile)
    router.send(Goodbye("router restarted"))
    seen = []
    deadline = time.monotonic() + 5
    while len(seen) < 2:
        msg = router.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, (Register, Drain)):
            seen.append(msg)
    assert isinstance(seen[0], Register) and isinstance(seen[1], Drain)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0


def test_sigint_says_goodbye_at_once_and_exits_zero(link):
    router, proc = link
    router.recv_type(Register, timeout=20)
    router.send(Dispatch([req("inflight", max_tokens=1000)]))
    router.recv_type(Outputs)
    proc.send_signal(signal.SIGINT)
    bye = None
    deadline = time.monotonic() + 5
    while bye is None:
        msg = router.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, Goodbye):
            bye = msg
    assert proc.wait(10) == 0
    assert bye.reason == "SIGINT"


def test_silent_router_triggers_reconnect_and_reregister(link):
    router, proc = link
    router.answer_heartbeats = False
    router.recv_type(Register, timeout=20)
    router.send(Dispatch([req("doomed", max_tokens=100_000 // 100)]))
    router.recv_type(Outputs)
    # the dispatch counted as "heard"; then silence: after 3 intervals + back-off, a new Register
    t0 = time.monotonic()
    while True:
        msg = router.recv(timeout=5)
        if isinstance(msg, Register):
            break
    assert time.monotonic() - t0 < 3
    # the in-flight request was aborted and its output dropped: nothing more for it
    router.answer_heartbeats = True
    router.send(Heartbeat())
    end = time.monotonic() + 4 * HB_S
    while time.monotonic() < end:
        try:
            msg = router.recv(timeout=max(0.01, end - time.monotonic()))
        except TimeoutError:
            break
        assert not isinstance(msg, Outputs), f"output after reconnect: {msg!r}"
    end = time.monotonic() + 3.0  # the stats of a heartbeat sent after the abort
    while (router.last_stats is None or router.last_stats.aborts_total != 1) and time.monotonic() < end:
        try:
            assert not isinstance(router.recv(timeout=max(0.01, end - time.monotonic())), Outputs)
        except TimeoutError:
            break
    assert router.last_stats is not None and router.last_stats.running == 0
    assert router.last_stats.aborts_total == 1
    assert proc.poll() is None


def test_goodbye_from_router_makes_worker_register_again(link):
    router, proc = link
    router.recv_type(Register, timeout=20)
    router.send(Dispatch([req("forgotten", max_tokens=1000)]))
    router.recv_type(Outputs)
    router.send(Goodbye("router restarted"))
    # Outputs of the forgotten request may still be on the wire; then a fresh Register.
    while not isinstance(msg := router.recv(timeout=2), Register):
        assert isinstance(msg, (Heartbeat, Outputs))
    router.send(Dispatch([req("fresh", max_tokens=3)]))
    _, by_id = collect(router, {"fresh"})  # fails on any further Delta for "forgotten"
    assert by_id["fresh"][-1].finish_reason == "length"
    assert proc.poll() is None
