"""What vLLM pays the first time a sampling path is used, on an empty
torch inductor cache (a fresh machine, as CI's): vLLM torch.compiles its
logprobs rank kernel and its top-k/top-p sampler on first use.  Why the
worker's warm-up (engine_worker/warmup.py) runs a sampled request with
logprobs before it registers.

    python -m bench.vllm_first_use     # AsyncLLM on the tiny model, a temp inductor cache
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"
PROMPT = [1 + i % 64 for i in range(13)]


async def _run(engine, rid: str, **kw) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    p = SamplingParams(max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **kw)
    t0 = time.perf_counter()
    async for _ in engine.generate({"prompt_token_ids": PROMPT}, p, rid):
        pass
    return time.perf_counter() - t0


async def _main() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(MODEL),
            max_model_len=2048,
            max_num_seqs=16,
            dtype="bfloat16",
            enforce_eager=True,
            disable_log_stats=True,
            kv_cache_memory_bytes=64 << 20,
        )
    )
    try:
        rows = [
            ("greedy", dict(temperature=0.0)),
            ("sampled", dict(temperature=1.0)),
            ("top-k/top-p", dict(temperature=1.0, top_k=5, top_p=0.9)),
            ("logprobs, first", dict(temperature=1.0, logprobs=1)),
            ("logprobs, again", dict(temperature=1.0, logprobs=2)),
        ]
        for i, (name, kw) in enumerate(rows):
            print(f"{name:18s} {await _run(engine, f'r{i}', **kw):8.3f} s", flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="weir-inductor-")
    asyncio.run(_main())
