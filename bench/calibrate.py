"""Measure an engine's timing the way SimEngineConfig models it, and suggest sim parameters.

    python -m bench.calibrate                  # real vLLM on models/tiny-llama
    python -m bench.calibrate --engine sim     # the simulated engine with its defaults

Drives the Engine interface directly (no router, no sockets): TTFT and
per-output-token time (TPOT) at 1 and 16 concurrent requests with ~32-token
prompts, and TTFT of a ~256-token prompt alone (prefill cost per token).
Results for the defaults are in engine_worker/sim_model.py's docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from router.lifecycle.prompts import ModelPrompts, PromptTokens
from shared.config import SimEngineConfig
from shared.protocol import GenerateRequest, SamplingParams, Submit

WORDS = "the quick brown fox jumps over a lazy dog while weir routes tokens".split()


def _prompt(prompts: ModelPrompts, approx_tokens: int) -> PromptTokens:
    """A prompt tokenized as the router would (exact where the model has a tokenizer)."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(approx_tokens))
    return prompts.tokenize(Submit("calibrate", "", prompt=text))


async def _round(engine, n: int, prompt: PromptTokens, max_tokens: int, tag: str) -> tuple[float, float, int]:
    """n concurrent requests; returns (median TTFT s, median TPOT s, prompt tokens)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    prompt_tokens = [0]
    remaining = [n]

    def emit(d):
        now = time.perf_counter()
        if d.request_id not in first:
            first[d.request_id] = now
            prompt_tokens[0] = d.prompt_tokens
        last[d.request_id] = now
        if d.error is not None and not done.done():
            done.set_exception(RuntimeError(d.error.message))
        elif d.finish_reason:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set_result(None)

    t0 = time.perf_counter()
    for i in range(n):
        engine.submit(
            GenerateRequest(
                f"{tag}-{i}", prompt.ids, prompt.count, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            ),
            emit,
        )
    await done
    ttft = statistics.median(first[k] - t0 for k in first)
    tpot = statistics.median((last[k] - first[k]) / (max_tokens - 1) for k in first)
    return ttft, tpot, prompt_tokens[0]


async def measure(engine, prompts: ModelPrompts, repeats: int = 3) -> dict[str, float]:
    await engine.start()
    short, long = _prompt(prompts, 32), _prompt(prompts, 256)
    try:
        await _round(engine, 4, short, 8, "warmup")
        res: dict[str, list[float]] = {}
        for r in range(repeats):
            for n in (1, 16):
                ttft, tpot, pt = await _round(engine, n, short, 64, f"c{n}-{r}")
                res.setdefault(f"ttft_{n}_ms", []).append(ttft * 1e3)
                res.setdefault(f"tpot_{n}_ms", []).append(tpot * 1e3)
                res["prompt_tokens_short"] = [pt]
            ttft, _, pt = await _round(engine, 1, long, 2, f"long-{r}")
            res.setdefault("ttft_long_ms", []).append(ttft * 1e3)
            res["prompt_tokens_long"] = [pt]
        return {k: statistics.median(v) for k, v in res.items()}
    finally:
        await engine.shutdown()


def suggest(m: dict[str, float]) -> dict[str, float]:
    """Fit step_fixed_ms + decode_token_us * seqs, and prefill_token_us from the TTFT slope."""
    decode_us = max(0.0, (m["tpot_16_ms"] - m["tpot_1_ms"]) / 15 * 1e3)
    fixed_ms = max(0.1, m["tpot_1_ms"] - decode_us / 1e3)
    extra = m["prompt_tokens_long"] - m["prompt_tokens_short"]
    prefill_us = max(0.0, (m["ttft_long_ms"] - m["ttft_1_ms"]) / extra * 1e3) if extra > 0 else 0.0
    return {
        "step_fixed_ms": round(fixed_ms, 2),
        "decode_token_us": round(decode_us, 1),
        "prefill_token_us": round(prefill_us, 1),
    }


async def _main(args) -> None:
    if args.engine == "sim":
        from engine_worker.sim_engine import SimEngine

        engine = SimEngine(SimEngineConfig(), max_num_seqs=16, max_model_len=args.max_model_len)
        prompts = ModelPrompts(None)
    else:
        from engine_worker.vllm_engine import VllmEngine

        engine = VllmEngine(
            args.model,
            "calibration",
            max_model_len=args.max_model_len,
            max_num_seqs=16,
            dtype="bfloat16",
            kv_cache_bytes=64 << 20,
            gpu_memory_utilization=0.9,
        )
        prompts = ModelPrompts(args.model)
    m = await measure(engine, prompts, args.repeats)
    for k, v in m.items():
        print(f"{k:22s} {v:9.2f}")
    print("suggested SimEngineConfig:", suggest(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    ap.add_argument("--model", default="models/tiny-llama")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import uvloop

    uvloop.run(_main(args))


if __name__ == "__main__":
    main()
