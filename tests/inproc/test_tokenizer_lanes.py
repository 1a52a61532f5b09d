"""The tokenizer threads' lanes with real threads: a short prompt is tokenized
and dispatched while long prompts hold every heavy thread and more wait, the
heavy threads yield the CPU (nice) and the short prompts' does not, and the
pool's size follows ``[router] tokenize_threads``."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
from fakes import FakeSink, FakeWorkers, LoopThread, registration

from router.lifecycle.core import RouterCore
from router.lifecycle.jobs import job_id_of
from router.lifecycle.prompts import ModelPrompts
from router.lifecycle.tokenizer_queue import HEAVY_NICE, PROMPT, SHORT, TokenizerQueue, cores
from shared import protocol as p
from shared.config import Config

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
MODEL = "sim-long"


def test_long_prompts_run_on_the_configured_threads_and_a_short_one_on_the_spare():
    """tokenize_threads = 3: three long prompts run at once (a fourth waits),
    and a short prompt pushed after them all runs while they still hold their threads."""
    loop = asyncio.new_event_loop()
    tq = TokenizerQueue(loop, calls_per_tenant=8, calls_total=8, threads=3)
    release = threading.Event()
    lock = threading.Lock()
    started: list[int] = []
    nice: dict[str, set[int]] = {"long": set(), "short": set()}

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def long_prompt(i: int) -> int:
        with lock:
            started.append(i)
            nice["long"].add(priority())
        assert release.wait(30)
        return i

    def short_prompt() -> str:
        nice["short"].add(priority())
        return "short"

    async def scenario() -> None:
        longs = [tq.run(PROMPT, "a", long_prompt, i) for i in range(10)]
        deadline = time.monotonic() + 10
        while len(started) < 3:
            assert time.monotonic() < deadline, started
            await asyncio.sleep(0.005)
        short = tq.run(SHORT, "a", short_prompt)
        assert short is not None
        assert await asyncio.wait_for(short, 10) == "short"  # FIFO: after the ten long ones (never, here)
        assert sorted(started) == [0, 1, 2] and not any(f is not None and f.done() for f in longs)
        release.set()
        assert await asyncio.gather(*[f for f in longs if f is not None]) == list(range(10))
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if sys.platform == "linux":  # (elsewhere a thread's priority is its process's)
            assert nice == {"long": {min(19, base + HEAVY_NICE)}, "short": {base}}

    try:
        loop.run_until_complete(scenario())
    finally:
        release.set()
        tq.shutdown()
        loop.close()


def _config(**router: object) -> Config:
    return msgspec.convert(
        {"router": router, "models": [{"name": MODEL, "engine": "sim", "path": str(TINY), "max_model_len": 200_000}]},
        Config,
    )


@pytest.mark.skipif(not (TINY / "tokenizer.json").exists(), reason="models/tiny-llama not built")
def test_a_short_prompt_is_dispatched_while_a_burst_of_long_ones_is_tokenized():
    """One tenant sends 12 prompts of 220 KB (~150k tokens, ~0.1 s of a thread
    each), then one of 4 KB (over the inline limit): the short one is
    tokenized on the spare thread and dispatched before the long ones are
    all through (in one FIFO it came after all twelve)."""
    lt = LoopThread()
    on_loop = lt.call
    workers = FakeWorkers()

    async def start() -> RouterCore:
        core = RouterCore(_config(tokenize_threads=2), lt.loop, workers)
        workers.linked.add("w0")
        core.worker_joined(registration("w0", MODEL, max_model_len=200_000, kv=10**8, seqs=64))
        return core

    core = lt.run(start())
    try:
        sink = FakeSink()
        long_text = "alpha beta gamma delta " * 9_600  # 220 KB

        def submit_all() -> list[int]:
            handles = []
            for i in range(12):
                got = core.submit(p.Submit(f"long{i}", MODEL, prompt=f"{i} {long_text}", max_tokens=2), sink)
                assert isinstance(got, int), got
                handles.append(got)
            got = core.submit(p.Submit("short", MODEL, prompt="tell me more " * 320, max_tokens=2), sink)
            assert isinstance(got, int), got
            return handles

        handles = on_loop(submit_all)
        deadline = time.monotonic() + 60
        while True:
            sent = on_loop(lambda: [r.prompt_tokens for r in workers.dispatched.get("w0", [])])
            if any(n < 2_000 for n in sent):
                break
            assert time.monotonic() < deadline, "the short prompt was never dispatched"
            time.sleep(0.002)
        assert len(sent) < 12, f"the short prompt waited for {len(sent) - 1} long ones"
        assert on_loop(lambda: core.tokenizer.queue.queued[PROMPT]) > 0  # long ones were still waiting
        while on_loop(lambda: len(workers.dispatched.get("w0", []))) < 13:  # and they all go on
            assert time.monotonic() < deadline, "the long prompts were not all dispatched"
            time.sleep(0.01)
        # a long prompt's ids were encoded on the tokenizer thread: the worker decodes the same ids
        req = next(r for r in on_loop(lambda: list(workers.dispatched["w0"])) if r.request_id == job_id_of(handles[3]))
        assert isinstance(req.prompt_token_ids, msgspec.Raw)  # (encoded once, not on the loop)
        sent = p.to_worker_decoder.decode(p.encoder.encode(p.Dispatch(requests=[req], epoch=1)))
        assert isinstance(sent, p.Dispatch)
        assert sent.requests[0].prompt_token_ids == ModelPrompts(str(TINY)).encode(f"3 {long_text}", True)
    finally:
        lt.stop(core.close)


def test_the_pool_follows_the_config():
    loop = asyncio.new_event_loop()
    try:
        for configured, heavy in ((3, 3), (0, max(2, cores()))):
            core = RouterCore(_config(tokenize_threads=configured), loop, FakeWorkers())
            assert core.tokenizer.queue.threads == heavy
            assert core.tokenizer.pool._max_workers == heavy
            assert core.tokenizer.spare._max_workers == 1  # short prompts' own
            core.close()
    finally:
        loop.close()
