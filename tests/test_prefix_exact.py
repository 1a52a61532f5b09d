"""Prefix caching, exactly: the router's block hashes == the real engine's KV events.

A real vLLM engine (tiny model, CPU, 128-token blocks) in-process, its KV
events consumed by the worker's own consumer (engine_worker.vllm_events ->
PrefixFeed) over its ipc sockets; prompts tokenized and hashed by the
router's code (router.core.tokenize_hashed).  Plus the replay path against
vLLM's real publisher, and the extra-key case against vLLM's own function.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="models/tiny-llama not built")

from router.block_hash import BlockHasher  # noqa: E402
from router.core import tokenize_hashed  # noqa: E402
from router.prompts import ModelPrompts  # noqa: E402
from shared.protocol import (ChatMessage, GenerateRequest, PrefixEvents, PrefixSnapshot,  # noqa: E402
                             RequestKind, SamplingParams, Submit)

PROMPTS = ModelPrompts(str(MODEL))
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa ".split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] + str((i + seed) % 13) for i in range(n_words))


@pytest.fixture(scope="module")
def env():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import uvloop
    import zmq

    from engine_worker.prefix_feed import PrefixFeed
    from engine_worker.vllm_engine import VllmEngine
    from engine_worker.vllm_events import VllmKvEvents
    from shared.transport import SocketPump

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    engine = VllmEngine(str(MODEL), "tiny-llama", max_model_len=1024, max_num_seqs=4, dtype="bfloat16",
                        kv_cache_bytes=4 << 20, gpu_memory_utilization=0.9)
    info = loop.run_until_complete(engine.start())
    sent = []
    feed = PrefixFeed(loop, sent.append)
    ctx = zmq.Context()
    source = VllmKvEvents(ctx, SocketPump(loop), loop, info.kv_events_endpoint, info.kv_events_replay, feed,
                          engine.reset_prefix_cache)
    loop.run_until_complete(asyncio.sleep(0.3))  # the SUB connects before the first batch
    try:
        yield loop, engine, info, feed, sent
    finally:
        source.close()
        loop.run_until_complete(engine.shutdown())
        ctx.term()
        loop.close()
        asyncio.set_event_loop(None)


def run(loop, engine, req: GenerateRequest):
    done = asyncio.Event()
    deltas = []

    def emit(d):
        deltas.append(d)
        if d.finished:
            done.set()

    engine.submit(req, emit)
    loop.run_until_complete(asyncio.wait_for(done.wait(), 60))
    return deltas


def wait_for(loop, cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        loop.run_until_complete(asyncio.sleep(0.02))
    return cond()


def test_router_hashes_equal_engine_events(env):
    loop, engine, info, feed, sent = env
    assert info.prefix_caching and info.prefix_hash == "sha256" and info.block_size == 128
    hasher = BlockHasher(info.prefix_hash, info.block_size, info.prefix_hash_seed)
    cases = [Submit("c1", "tiny-llama", prompt=text(25, 1)),  # ~6 tokens a word: 1 block
             Submit("c3", "tiny-llama", prompt=text(75, 2)),  # 3 blocks
             Submit("ch", "tiny-llama", kind=RequestKind.CHAT,  # 2 blocks, chat template applied
                    messages=[ChatMessage("system", text(40, 3)), ChatMessage("user", text(8, 4))])]
    counts = []
    for sub in cases:
        tokens = tokenize_hashed(PROMPTS, sub, hasher)
        assert len(tokens.hashes) == tokens.count // 128 >= 1
        counts.append(len(tokens.hashes))
        before = len(sent)
        run(loop, engine, GenerateRequest(sub.request_id, tokens.ids, tokens.count,
                                          SamplingParams(max_tokens=1, temperature=0.0)))
        assert wait_for(loop, lambda: set(tokens.hashes) <= feed.blocks), (tokens.hashes, feed.blocks)
        stored = [h for m in sent[before:] if isinstance(m, PrefixEvents) for h in m.stored]
        # the engine stored exactly the router's blocks for this prompt (nothing else, nothing missed)
        assert sorted(stored) == sorted(tokens.hashes)
    assert len(set(counts)) == 3  # several block counts


def test_cached_tokens_reported_on_repeat(env):
    loop, engine, info, feed, sent = env
    sub = Submit("r", "tiny-llama", prompt=text(70, 9))
    tokens = PROMPTS.tokenize(sub)
    first = run(loop, engine, GenerateRequest("r1", tokens.ids, tokens.count, SamplingParams(max_tokens=2)))
    again = run(loop, engine, GenerateRequest("r2", tokens.ids, tokens.count, SamplingParams(max_tokens=2)))
    assert first[0].cached_tokens == 0
    full = tokens.count // 128 * 128
    # vLLM recomputes the last block of a fully cached prompt, so at least the blocks before it hit
    assert again[0].cached_tokens >= full - 128 >= 128 and again[-1].cached_tokens == again[0].cached_tokens


def test_reset_clears_entries(env):
    loop, engine, info, feed, sent = env
    if not feed.blocks:
        run(loop, engine, GenerateRequest("z", PROMPTS.tokenize(Submit("z", "tiny-llama", prompt=text(80, 5))).ids,
                                          0, SamplingParams(max_tokens=1)))
    assert wait_for(loop, lambda: bool(feed.blocks))
    before = len(sent)
    engine.reset_prefix_cache()
    # AllBlocksCleared is published at the engine's next step: give it one
    sub = Submit("y", "tiny-llama", prompt="hi")
    ids = PROMPTS.tokenize(sub).ids
    run(loop, engine, GenerateRequest("y", ids, len(ids), SamplingParams(max_tokens=1)))
    assert wait_for(loop, lambda: any(isinstance(m, PrefixEvents) and m.cleared for m in sent[before:]))
    assert not feed.blocks


def test_extra_keys_match_vllm():
    """cache_salt / LoRA go into the first block's extra keys: the router's
    hasher agrees with vLLM's own hash_block_tokens (weir sends neither yet)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    ids = list(range(1000, 1000 + 128 * 3 + 5))
    for algo in ("sha256", "sha256_cbor"):
        hf = get_hash_fn_by_name(algo)
        kcu.init_none_hash(hf)
        for extra in (None, (("cache_salt", "tenant-a"),)):
            parent, want = None, []
            for i in range(3):
                parent = kcu.hash_block_tokens(hf, parent, ids[i * 128:(i + 1) * 128], extra if i == 0 else None)
                want.append(kcu.maybe_convert_block_hash(parent))
            assert BlockHasher(algo, 128).hashes(ids, extra) == want


def test_replay_fills_a_gap_and_loss_beyond_it_goes_blind():
    """vLLM's real publisher: a subscriber that missed batches gets them from
    the replay socket; one that missed more than the buffer is cache-blind
    until an AllBlocksCleared."""
    import tempfile

    import uvloop
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, ZmqEventPublisher

    from engine_worker.prefix_feed import PrefixFeed
    from engine_worker.vllm_events import VllmKvEvents
    from shared.transport import SocketPump

    def batch(*events):
        return KVEventBatch(ts=time.time(), events=list(events))

    def stored(*hs):
        return BlockStored(block_hashes=list(hs), parent_block_hash=None, token_ids=[], block_size=128,
                           lora_id=None, medium="GPU", lora_name=None)

    d = tempfile.mkdtemp(prefix="weir-kvt-")
    loop = uvloop.new_event_loop()
    try:
        for buffer_steps, recovers in ((100, True), (2, False)):
            ep, rep = f"ipc://{d}/pub{buffer_steps}", f"ipc://{d}/rep{buffer_steps}"
            pub = ZmqEventPublisher(0, ep, rep, buffer_steps=buffer_steps)
            for i in range(4):  # published before anyone subscribed: missed
                pub.publish(batch(stored(i + 1)))
            time.sleep(0.3)
            sent, lost = [], []
            feed = PrefixFeed(loop, sent.append)
            ctx = zmq.Context()
            src = VllmKvEvents(ctx, SocketPump(loop), loop, ep, rep, feed, lambda: lost.append(1))
            loop.run_until_complete(asyncio.sleep(0.3))
            pub.publish(batch(stored(5)))  # seq 4: the gap shows
            loop.run_until_complete(asyncio.sleep(0.5))
            if recovers:
                assert feed.trusted and feed.blocks == {1, 2, 3, 4, 5} and src.gaps >= 1 and not lost
            else:
                assert not feed.trusted and lost and not feed.blocks
                assert isinstance(sent[-1], PrefixSnapshot) and not sent[-1].trusted
                pub.publish(batch(AllBlocksCleared(), stored(9)))
                loop.run_until_complete(asyncio.sleep(0.5))
                assert feed.trusted and feed.blocks == {9}
                assert isinstance(sent[-1], PrefixEvents) and sent[-1].cleared and sent[-1].stored == [9]
            src.close()
            pub.shutdown()
            ctx.term()
    finally:
        loop.close()
