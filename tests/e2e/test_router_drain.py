"""Router drain with real processes: a SIGTERM to a router loses no stream.

Envoy, routers and sim workers on loopback, supervised as ``weir up`` runs
them.  Each stream is read as raw SSE and classified: complete (every token,
then ``[DONE]``), ended with an error event (then ``[DONE]``), refused (a
status with Retry-After before anything was sent), or cut (the body ended
any other way) -- which must never happen.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import requests
from stackutil import SIM_MODEL, sim_worker, write_config

from bench.localconfig import routers
from deploy.stack import Stack
from shared.config import load

STREAM_TOKENS = 300
SIM = {"step_fixed_ms": 5.0, "decode_token_us": 20.0}  # ~1.6 s a 300-token stream


def _stack(cfg, tmp_path, said: list[str]) -> Stack:
    def progress(msg: str) -> None:
        said.append(msg)
        print(f"[stack] {msg}", file=sys.stderr)

    return Stack(cfg, tmp_path / "run", progress=progress, supervise=True)


async def _stream(client: httpx.AsyncClient, url: str, tokens: int, started: list[int]) -> tuple[str, int]:
    """One streamed completion: (outcome, tokens seen); outcome is complete,
    error (an error event then [DONE]), refused (a status before any output) or cut."""
    body = {"model": SIM_MODEL, "prompt": "tell me a long story", "max_tokens": tokens, "stream": True}
    n, error, done = 0, False, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                ok = r.status_code == 503 and "retry-after" in r.headers
                return ("refused" if ok else f"status {r.status_code}"), 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]["code"] == "router_draining"
                elif event["choices"]:
                    # (an event may carry several tokens: a worker batches steps when it is behind)
                    n += event["choices"][0]["text"].count(" tok")
                    started[0] += 1
    except httpx.HTTPError:
        return "cut", n
    if not done:
        return "cut", n
    if error:
        return "error", n
    return ("complete" if n == tokens else f"short {n}"), n


async def _streams(url: str, n: int, tokens: int, on_started) -> list[str]:
    started = [0]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n + 4)) as client:
        tasks = [asyncio.ensure_future(_stream(client, url, tokens, started)) for _ in range(n)]
        # every stream going (5 tokens in, on average), or all already over
        while started[0] < n * 5 and not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.01)
        on_started()
        return [outcome for outcome, _ in await asyncio.gather(*tasks)]


def _exit_status(said: list[str], name: str, timeout: float = 40.0) -> str | None:
    """The supervisor's word on how ``name`` exited (it restarts it after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for msg in said:
            if msg.startswith(f"{name} exited with status"):
                return msg.rsplit(" ", 1)[1]
        time.sleep(0.02)
    return None


def _wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


class _Trickle:
    """New non-streamed requests every ``every_s`` on a thread: their statuses."""

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        self.url, self.every_s = url, every_s
        self.statuses: list[tuple[int, bool]] = []  # (status, had Retry-After)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        s = requests.Session()
        body = {"model": SIM_MODEL, "prompt": "hi", "max_tokens": 4}
        while not self._stop.is_set():
            try:
                r = s.post(self.url + "/v1/completions", json=body, timeout=30)
                self.statuses.append((r.status_code, "retry-after" in r.headers))
            except requests.RequestException:
                self.statuses.append((0, False))
            time.sleep(self.every_s)

    def __enter__(self) -> _Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_sigterm_to_the_only_router_lets_every_stream_finish(tmp_path):
    cfg = write_config(tmp_path, workers=[sim_worker("sim-a", sim=SIM)], router={"heartbeat_interval_s": 0.25})
    said: list[str] = []
    with _stack(cfg, tmp_path, said) as stack:
        router = stack.components["router"]
        old = router.pid
        with _Trickle(stack.envoy_url, every_s=0.1) as trickle:
            outcomes = asyncio.run(
                _streams(stack.envoy_url, 10, STREAM_TOKENS, lambda: router.signal_group(signal.SIGTERM))
            )
            assert _exit_status(said, "router") == "0"
            assert _wait(lambda: router.pid != old and "sim-a" in stack.registered_at(stack.router_url))
            assert _wait(lambda: requests.get(stack.envoy_url + "/health", timeout=5).status_code == 200)
            time.sleep(0.3)
        assert outcomes == ["complete"] * 10, outcomes
        # During the gap: served (late) or refused with Retry-After; never a bare failure.
        assert all(status == 200 or (status == 503 and ra) for status, ra in trickle.statuses), trickle.statuses
        print(f"\n1 router SIGTERM: {outcomes.count('complete')}/10 complete; gap requests {trickle.statuses}")


def test_sigterm_to_one_of_two_routers_under_load_loses_nothing(tmp_path):
    workers = [sim_worker("sim-a", sim=SIM), sim_worker("sim-b", sim=SIM)]
    cfg = write_config(tmp_path, routers=routers(2), workers=workers, router={"heartbeat_interval_s": 0.25})
    said: list[str] = []
    with _stack(cfg, tmp_path, said) as stack:
        victim = stack.components["router:1"]
        host = stack.router_urls[1].removeprefix("http://")
        t: dict[str, float] = {}

        def sigterm() -> None:
            t["sigterm"] = time.monotonic()
            victim.signal_group(signal.SIGTERM)

            def watch() -> None:  # when Envoy's health check takes it out
                while "out" not in t and time.monotonic() - t["sigterm"] < 10:
                    body = requests.get(stack.admin_url + "/clusters", timeout=5).text
                    if f"::{host}::health_flags::/failed_active_hc" in body:
                        t["out"] = time.monotonic()
                    time.sleep(0.01)

            threading.Thread(target=watch, daemon=True).start()

        from shared.client import Client

        # A direct ZeroMQ client that knows both routers, the victim first: it moves on.
        zmq_done: list[str] = []
        zmq_stop = threading.Event()

        def zmq_client() -> None:
            with Client(stack.zmq_frontends[::-1], timeout_s=30) as c:
                while not zmq_stop.is_set():
                    zmq_done.append(c.complete(SIM_MODEL, prompt="hi", max_tokens=4).finish_reason or "")
                    time.sleep(0.05)
                zmq_done.append(c.address)

        zt = threading.Thread(target=zmq_client)
        zt.start()
        with _Trickle(stack.envoy_url) as trickle:
            outcomes = asyncio.run(_streams(stack.envoy_url, 20, STREAM_TOKENS, sigterm))
            assert _exit_status(said, "router:1") == "0"
        zmq_stop.set()
        zt.join(timeout=30)
        assert outcomes == ["complete"] * 20, outcomes
        assert trickle.statuses and all(s == 200 for s, _ in trickle.statuses), trickle.statuses
        assert zmq_done[-1] == stack.zmq_frontends[0] and set(zmq_done[:-1]) == {"length"}, zmq_done
        out = t.get("out", float("nan")) - t["sigterm"]
        print(
            f"\n2 routers, SIGTERM 1: 20/20 complete, {len(trickle.statuses)} new requests all 200; "
            f"Envoy took the router out {out * 1000:.0f} ms after SIGTERM"
        )


def test_a_drain_timeout_shorter_than_the_streams_ends_them_with_an_error_event(tmp_path):
    cfg = write_config(
        tmp_path, workers=[sim_worker("sim-a", sim=SIM)], router={"heartbeat_interval_s": 0.25, "drain_timeout_s": 0.5}
    )
    said: list[str] = []
    with _stack(cfg, tmp_path, said) as stack:
        from shared.client import Client, WeirError

        zmq_outcome: list[str] = []

        def zmq_stream() -> None:
            with Client(stack.zmq_frontend) as c:
                try:
                    for _ in c.stream(SIM_MODEL, prompt="a long one", max_tokens=3000):
                        pass
                    zmq_outcome.append("complete")
                except WeirError as e:
                    zmq_outcome.append(e.error.code or "")

        zt = threading.Thread(target=zmq_stream)
        zt.start()

        def drain() -> None:  # the operator's way (SIGTERM's: the tests above)
            r = requests.post(stack.router_url + "/admin/drain", timeout=5)
            assert r.status_code == 200 and r.json()["draining"], r.text

        outcomes = asyncio.run(_streams(stack.envoy_url, 6, 3000, drain))
        zt.join(timeout=30)
        assert _exit_status(said, "router") == "0"
        assert outcomes == ["error"] * 6, outcomes  # an error event and [DONE]: none cut
        assert zmq_outcome == ["router_draining"]
        print(f"\ndrain timeout 0.5 s: {outcomes.count('error')}/6 streams ended with an error event, 0 cut")


async def _steady_load(url: str, rps: float, stop: threading.Event) -> list[tuple[float, str, float]]:
    """A streamed request every 1/rps s until ``stop``: (start, outcome, ttft) each."""
    out: list[tuple[float, str, float]] = []

    async def one(client: httpx.AsyncClient) -> None:
        t0 = time.monotonic()
        body = {"model": SIM_MODEL, "prompt": "hello there", "max_tokens": 20, "stream": True}
        ttft, text, done = float("nan"), [], False
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    out.append((t0, f"status {r.status_code}", ttft))
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if event.get("choices"):
                            if not text:
                                ttft = time.monotonic() - t0
                            text.append(event["choices"][0]["text"])
        except httpx.HTTPError as e:
            out.append((t0, f"{type(e).__name__}", ttft))
            return
        # (an event may carry several tokens: a worker batches steps when it is behind)
        got = "".join(text)
        out.append((t0, "complete" if done and got == " tok" * 20 else f"cut: {done=} {got!r}", ttft))

    async with httpx.AsyncClient(timeout=60) as client:
        tasks = []
        while not stop.is_set():
            tasks.append(asyncio.ensure_future(one(client)))
            await asyncio.sleep(1 / rps)
        await asyncio.gather(*tasks)
    return out


def _p99(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def test_weir_restart_all_under_steady_load_fails_no_request(tmp_path):
    workers = [sim_worker("sim-a", sim=SIM), sim_worker("sim-b", sim=SIM)]
    cfg_path = write_config(tmp_path, routers=routers(2), workers=workers, router={"heartbeat_interval_s": 0.25})
    weir = Path(sys.executable).parent / "weir"
    up = subprocess.Popen(
        [str(weir), "up", "--config", str(cfg_path), "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert _wait_line(up, "Ctrl-C (or SIGTERM) stops everything.", 60)
        envoy_url = "http://" + load(cfg_path).envoy.listen
        stop = threading.Event()
        marks: dict[str, float] = {}

        def restart_all() -> None:
            time.sleep(3.0)  # a baseline first
            marks["start"] = time.monotonic()
            done = subprocess.run(
                [str(weir), "restart", "all", "--config", str(cfg_path), "--timeout", "120"],
                capture_output=True,
                text=True,
            )
            marks["end"] = time.monotonic()
            marks["rc"] = done.returncode
            print(done.stdout, done.stderr, file=sys.stderr)
            time.sleep(1.0)
            stop.set()

        t = threading.Thread(target=restart_all)
        t.start()
        results = asyncio.run(_steady_load(envoy_url, 20, stop))
        t.join()
        assert marks["rc"] == 0
        failed = [r for r in results if r[1] != "complete"]
        assert not failed, failed
        before = [ttft for t0, _, ttft in results if t0 < marks["start"]]
        during = [ttft for t0, _, ttft in results if marks["start"] <= t0 < marks["end"]]
        print(
            f"\nweir restart all at 20 req/s: {len(results)} requests, {len(failed)} failed; restart took "
            f"{marks['end'] - marks['start']:.1f} s; p99 TTFT before {_p99(before) * 1000:.0f} ms, "
            f"during {_p99(during) * 1000:.0f} ms"
        )
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def _wait_line(proc: subprocess.Popen, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return False
        if text in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep it drained
            return True
    return False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
