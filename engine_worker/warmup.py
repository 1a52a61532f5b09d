"""A short generation through a freshly started engine, before the worker
registers: the first real request then does not pay for what an engine does
only once (vLLM's first forward pass, its sampler's and detokenizer's first
use, allocations), and an engine that cannot generate never registers.

Its size: WARMUP_PROMPT_TOKENS of prompt and WARMUP_MAX_TOKENS generated,
greedy -- a prefill and a few decode steps, the two paths a first request
takes; its effect on the first request is measured in bench/README.md (Warm-up).

On vLLM a second one samples with top-k/top-p and logprobs beside it: vLLM
torch.compiles those samplers' kernels on first use (measured on a cold
inductor cache, as on a fresh machine: the first logprobs request 8-23 s,
the first top-k/top-p one 1.4 s, then ~0.05 s) -- long enough for the
router's stall watchdog (10 s) to move a first real request that paid it.
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
    """Seconds the warm-up generation took; WarmupFailed if one errs or it times out."""
    max_tokens = max(1, min(WARMUP_MAX_TOKENS, info.max_model_len // 2))
    n = max(1, min(WARMUP_PROMPT_TOKENS, info.max_model_len - max_tokens))
    # Small ids exist in every vocabulary; the simulated engine reads only the count.
    ids = [1 + i % 64 for i in range(n)]
    reqs = [GenerateRequest(WARMUP_ID, ids, n, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))]
    if info.embeds:  # an embedding model: one prompt through its pooler instead
        reqs = [GenerateRequest(WARMUP_ID, ids, n, SamplingParams(), embed=True)]
    elif info.engine == "vllm":
        reqs.append(
            GenerateRequest(
                WARMUP_ID + "-sampled",
                ids,
                n,
                SamplingParams(
                    max_tokens=max_tokens, temperature=1.0, top_k=5, top_p=0.9, logprobs=1, seed=0, ignore_eos=True
                ),
            )
        )
    loop = asyncio.get_running_loop()
    done = {r.request_id: loop.create_future() for r in reqs}

    def emit(d: Delta) -> None:
        f = done[d.request_id]
        if d.finished and not f.done():
            f.set_result(d)

    counted = engine.finished_total, engine.aborts_total, engine.tokens_total
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r, emit)
    try:
        finals = await asyncio.wait_for(asyncio.gather(*done.values()), timeout_s)
    except TimeoutError:
        engine.abort(list(done), tell=False)
        raise WarmupFailed(f"no result in {timeout_s:g} s") from None
    finally:  # not requests: the heartbeat's counters start from zero
        engine.finished_total, engine.aborts_total, engine.tokens_total = counted
    for final in finals:
        if final.error is not None:
            raise WarmupFailed(final.error.message)
    return time.perf_counter() - t0
