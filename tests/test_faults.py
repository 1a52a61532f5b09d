"""Failures and restarts with real processes: nothing is lost.

Streams run through Envoy (the openai SDK) or over ZeroMQ while a worker is
killed, stopped, drained or restarted; every stream must end complete, with
exact token counts and no duplicated or missing text, and every reservation
must be back to zero.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
import requests
import stackutil
from stackutil import SIM_MODEL, sim_worker, start_stack, write_config

STREAM_TOKENS = 300
SIM = {"step_fixed_ms": 3.0, "decode_token_us": 20.0}  # ~1 s for a 300-token stream


def _two_worker_stack(tmp_path, **router):
    cfg = write_config(tmp_path, workers=[sim_worker("sim-a", sim=SIM), sim_worker("sim-b", sim=SIM)],
                       router={"heartbeat_interval_s": 0.25, **router})
    return start_stack(cfg, tmp_path / "run")


def _workers(stack) -> dict[str, dict]:
    return {w["id"]: w for w in requests.get(stack.router_url + "/admin/workers", timeout=5).json()}


def _wait(pred, timeout=20.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return pred()


def _drained(stack):
    return _wait(lambda: all(w["reserved_tokens"] == 0 and w["running"] == 0
                             for w in _workers(stack).values()))


async def _streams(url: str, n: int, on_started=None) -> list[tuple[str, str | None, int]]:
    """n concurrent streamed completions: (text, finish_reason, completion_tokens) each."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    started = asyncio.Event()
    count = [0]

    async def one():
        text, finish, usage = [], None, None
        stream = await client.completions.create(
            model=SIM_MODEL, prompt="tell me a long story", max_tokens=STREAM_TOKENS, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                count[0] += 1
                if count[0] >= n * 20:
                    started.set()
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return "".join(text), finish, usage

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    if on_started is not None:
        await started.wait()
        on_started()
    try:
        return await asyncio.gather(*tasks)
    finally:
        await client.close()


def _assert_complete(results):
    for text, finish, tokens in results:
        assert (finish, tokens) == ("length", STREAM_TOKENS)
        assert text == " tok" * STREAM_TOKENS  # no token missing, none twice


def test_sigkill_of_one_of_two_workers_loses_no_stream(tmp_path):
    with _two_worker_stack(tmp_path) as stack:
        victim = stack.components["worker:sim-a"]
        results = asyncio.run(_streams(stack.envoy_url, 40, lambda: victim.signal_group(signal.SIGKILL)))
        _assert_complete(results)
        metrics = requests.get(stack.metrics_url, timeout=5).text
        resumed = sum(float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines()
                      if l.startswith("weir_resumed_total{"))
        assert resumed >= 1, "the killed worker ran none of the streams?"
        assert _drained(stack)
        assert set(_workers(stack)) == {"sim-b"}


def test_a_stopped_worker_is_found_by_heartbeat_and_its_streams_resume(tmp_path):
    """SIGSTOP: the process is there but silent; after heartbeat_liveness
    intervals it is lost, and its streams continue on the other worker."""
    with _two_worker_stack(tmp_path) as stack:
        victim = stack.components["worker:sim-a"]
        t = {}

        def stop():
            t["stopped"] = time.monotonic()
            victim.signal_group(signal.SIGSTOP)

        try:
            results = asyncio.run(_streams(stack.envoy_url, 20, stop))
        finally:
            victim.signal_group(signal.SIGCONT)
        _assert_complete(results)
        assert _drained(stack)
