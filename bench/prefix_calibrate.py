"""TTFT of the real tiny vLLM engine (CPU build, in-process) with and without a
prefix-cache hit, for the sim's prefill cost in bench/scenarios/prefix.py.

    python -m bench.prefix_calibrate      (~1 min; the deployment's one OpenMP thread)
"""

import asyncio
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
from bench.localconfig import TINY_MODEL_DIR
from engine_worker.vllm_engine import VllmEngine
from router.lifecycle.prompts import ModelPrompts
from shared.protocol import GenerateRequest, SamplingParams, Submit

MODEL = str(TINY_MODEL_DIR)
P = ModelPrompts(MODEL)


async def main():
    eng = VllmEngine(
        MODEL,
        "tiny-llama",
        max_model_len=2048,
        max_num_seqs=4,
        dtype="bfloat16",
        kv_cache_bytes=16 << 20,
        gpu_memory_utilization=0.9,
    )
    await eng.start()

    async def ttft(rid, ids):
        done = asyncio.Event()
        t0 = time.perf_counter()
        got = []

        def emit(d):
            if not got:
                got.append((time.perf_counter() - t0, d.cached_tokens))
            if d.finished:
                done.set()

        eng.submit(GenerateRequest(rid, ids, len(ids), SamplingParams(max_tokens=1)), emit)
        await done.wait()
        return got[0]

    res = {}
    for n_words in (40, 80, 150):
        miss, hit = [], []
        for r in range(6):
            base = " ".join(f"q{r}w{i}n{n_words}" for i in range(n_words))
            ids = P.tokenize(Submit("x", "tiny-llama", prompt=base)).ids
            miss.append(await ttft(f"m{n_words}-{r}", ids))
            hit.append(await ttft(f"h{n_words}-{r}", ids[:-3] + [100, 200, 300]))
            await asyncio.sleep(0.05)
        res[n_words] = (
            len(ids),
            statistics.median(t for t, _ in miss[1:]) * 1e3,
            statistics.median(t for t, _ in hit[1:]) * 1e3,
            statistics.median(c for _, c in hit),
        )
    for n, m, h, c in res.values():
        print(f"prompt {n} tokens: TTFT miss {m:.1f} ms, hit {h:.1f} ms (cached {c:.0f})", flush=True)
    await eng.shutdown()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
