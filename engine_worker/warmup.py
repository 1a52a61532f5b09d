"""A short generation through a freshly started engine, before the worker
registers: the first real request then does not pay for what an engine does
only once (vLLM's first forward pass, its sampler's and detokenizer's first
use, allocations), and an engine that cannot generate never registers.

Its size: WARMUP_PROMPT_TOKENS of prompt and WARMUP_MAX_TOKENS generated,
greedy -- a prefill and a few decode steps, the two paths a first request
takes; its effect on the first request is measured in bench/README.md (Warm-up).
"""

from __future__ import annotations

import asyncio
import time

from shared.protocol import Delta, GenerateRequest, SamplingParams

from .base import EngineBase, EngineInfo

WARMUP_PROMPT_TOKENS = 32
WARMUP_MAX_TOKENS = 8
WARMUP_ID = "weir-warmup"


class WarmupFailed(RuntimeError):
    pass


async def warm_up(engine: EngineBase, info: EngineInfo, timeout_s: float) -> float:
    """Seconds the warm-up generation took; WarmupFailed if it errs or times out."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def emit(d: Delta) -> None:
        if d.finished and not done.done():
            done.set_result(d)

    max_tokens = max(1, min(WARMUP_MAX_TOKENS, info.max_model_len // 2))
    n = max(1, min(WARMUP_PROMPT_TOKENS, info.max_model_len - max_tokens))
    # Small ids exist in every vocabulary; the simulated engine reads only the count.
    req = GenerateRequest(WARMUP_ID, [1 + i % 64 for i in range(n)], n,
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    counted = engine.finished_total, engine.aborts_total, engine.tokens_total
    t0 = time.perf_counter()
    engine.submit(req, emit)
    try:
        final = await asyncio.wait_for(done, timeout_s)
    except asyncio.TimeoutError:
        engine.abort([WARMUP_ID], tell=False)
        raise WarmupFailed(f"no result in {timeout_s:g} s") from None
    finally:  # not a request: the heartbeat's counters start from zero
        engine.finished_total, engine.aborts_total, engine.tokens_total = counted
    if final.error is not None:
        raise WarmupFailed(final.error.message)
    return time.perf_counter() - t0
