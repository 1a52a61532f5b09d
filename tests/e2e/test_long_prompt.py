"""A long prompt is tokenized off the router's event loop: other streams keep flowing.

A simulated model that has a real tokenizer (tiny-llama's) and a 200k-token
context; one stream runs while a ~60k-token prompt is admitted.  Tokenizing
that prompt takes tens of ms (measured here, in this process); on the
router's loop it would hold every stream for that long.  The running
stream's largest inter-token gap meanwhile must stay well under it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import stackutil
from stackutil import TINY_MODEL_DIR

from router.lifecycle.prompts import ModelPrompts
from shared.client import AsyncClient
from shared.protocol import Submit

LONG_MODEL = "sim-long"
LONG_TEXT = "word " * 30_000  # ~60k tokens of tiny-llama


@pytest.fixture(scope="module")
def long_stack(tmp_path_factory):
    if not (TINY_MODEL_DIR / "tokenizer.json").exists():
        pytest.skip("models/tiny-llama not built")
    d = tmp_path_factory.mktemp("long_prompt")
    cfg = stackutil.write_config(
        d,
        models=[{"name": LONG_MODEL, "engine": "sim", "path": str(TINY_MODEL_DIR), "max_model_len": 200_000}],
        workers=[
            stackutil.sim_worker(
                "sim-long-0",
                model=LONG_MODEL,
                max_num_seqs=8,
                sim={"kv_capacity_tokens": 400_000, "prefill_token_us": 0.2, "max_prefill_tokens": 8192},
            )
        ],
    )
    with stackutil.start_stack(cfg, d / "run") as s:
        yield s


def test_streams_keep_flowing_while_a_long_prompt_is_tokenized(long_stack):
    prompts = ModelPrompts(str(TINY_MODEL_DIR))
    t0 = time.perf_counter()
    n_tokens = prompts.tokenize(Submit("r", LONG_MODEL, prompt=LONG_TEXT)).count
    tokenize_s = time.perf_counter() - t0
    assert n_tokens > 50_000

    async def scenario():
        async with AsyncClient(long_stack.zmq_frontend) as c:
            arrivals: list[float] = []
            window: list[float] = []

            async def running():
                async for d in c.stream(LONG_MODEL, prompt="hello", max_tokens=3000, ignore_eos=True):
                    if d.num_tokens:
                        arrivals.append(time.perf_counter())

            async def long_one():
                while len(arrivals) < 50:  # the stream is flowing
                    await asyncio.sleep(0.005)
                window.append(time.perf_counter())
                out = await c.complete(LONG_MODEL, prompt=LONG_TEXT, max_tokens=2)
                window.append(time.perf_counter())
                return out

            run = asyncio.ensure_future(running())
            out = await long_one()
            run.cancel()
            return arrivals, window, out

    arrivals, (start, end), out = asyncio.run(scenario())
    assert out.prompt_tokens == n_tokens  # the router's exact count reached the engine and came back
    # every gap that overlaps the admission (a stall's first token after may
    # land in the same message as the long request's answer, so after ``end``)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end]
    assert len(gaps) >= 5, "the running stream produced nothing while the long prompt was admitted"
    # (blocking would leave a gap of at least tokenize_s, measured idle; a loaded
    # machine's scheduling stretches the others, hence not a tighter bound)
    assert max(gaps) < 0.75 * tokenize_s, (
        f"largest inter-token gap {max(gaps) * 1e3:.1f} ms while a prompt that takes "
        f"{tokenize_s * 1e3:.1f} ms to tokenize was admitted"
    )
