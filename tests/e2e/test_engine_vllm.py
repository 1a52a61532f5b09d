"""VllmEngine on the real vLLM (CPU build) with the tiny local model.

One engine for the whole module (start-up ~16 s), on one uvloop loop that each
test drives with run_until_complete.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
KV_BYTES = 1 << 20  # tiny-llama: 512 B of KV per token -> 2048 tokens: preemption is reachable

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="models/tiny-llama not built")

from router.lifecycle.prompts import ModelPrompts  # noqa: E402
from shared.protocol import ChatMessage, Delta, GenerateRequest, RequestKind, SamplingParams, Submit  # noqa: E402

PROMPTS = ModelPrompts(str(MODEL))  # the router's tokenizing, as the worker receives it


@pytest.fixture(scope="module")
def env():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import uvloop

    from engine_worker.vllm_engine import VllmEngine

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    engine = VllmEngine(
        str(MODEL),
        "tiny-llama",
        max_model_len=512,
        max_num_seqs=8,
        dtype="bfloat16",
        kv_cache_bytes=KV_BYTES,
        gpu_memory_utilization=0.9,
    )
    info = loop.run_until_complete(engine.start())
    try:
        yield loop, engine, info
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
        asyncio.set_event_loop(None)


def completion(rid, prompt="The quick brown fox", max_tokens=8, **kw):
    tokens = PROMPTS.tokenize(Submit(rid, "tiny-llama", prompt=prompt))
    return GenerateRequest(rid, tokens.ids, tokens.count, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


class Collector:
    """Gathers Deltas per request; ``wait()`` returns once every request has its final one."""

    def __init__(self):
        self.deltas: dict[str, list[Delta]] = {}
        self.open: set[str] = set()
        self.event = asyncio.Event()

    def submit(self, engine, req):
        self.deltas[req.request_id] = []
        self.open.add(req.request_id)
        self.event.clear()  # open again: wait() waits for this one too
        engine.submit(req, self.emit)

    def emit(self, d: Delta):
        self.deltas[d.request_id].append(d)
        if d.finish_reason or d.error:
            assert d.request_id in self.open, f"second final Delta for {d.request_id}"
            self.open.discard(d.request_id)
            if not self.open:
                self.event.set()

    async def wait(self, timeout=30.0):
        if self.open:
            await asyncio.wait_for(self.event.wait(), timeout)
        return self.deltas


def check_stream(ds: list[Delta], prompt_tokens: int, completion_tokens: int, finish: str):
    finals = [d for d in ds if d.finish_reason or d.error]
    assert finals == [ds[-1]], "exactly one final Delta, and it is the last"
    assert ds[-1].finish_reason == finish and ds[-1].error is None
    assert ds[0].prompt_tokens == prompt_tokens == ds[-1].prompt_tokens
    assert sum(d.num_tokens for d in ds) == completion_tokens == ds[-1].completion_tokens
    running = 0
    for d in ds:
        running += d.num_tokens
        assert d.completion_tokens == running


def test_capacity_is_read_from_the_engine(env):
    _, engine, info = env
    cache = engine.engine.vllm_config.cache_config
    assert info.engine == "vllm" and info.max_model_len == 512 and info.max_num_seqs == 8
    assert info.block_size == cache.block_size
    assert info.kv_capacity_tokens == (cache.num_gpu_blocks - 1) * cache.block_size  # less the null block
    assert 0 < info.kv_capacity_tokens <= KV_BYTES // 512


def test_completion_streams_exact_counts(env):
    loop, engine, _ = env
    prompt = "The quick brown fox jumps over the lazy dog"
    c = Collector()
    c.submit(engine, completion("cmpl-1", prompt, max_tokens=12))
    ds = loop.run_until_complete(c.wait())["cmpl-1"]
    n_prompt = len(engine.engine.tokenizer.encode(prompt))
    check_stream(ds, n_prompt, 12, "length")
    assert len(ds) >= 2  # streamed, not one blob
    s = engine.stats()
    assert s.finished_total >= 1 and s.running == 0 and s.waiting == 0


CHATS = [
    [ChatMessage("user", "Hello there")],
    [ChatMessage("system", "Be brief."), ChatMessage("user", "Hello there")],
    [
        ChatMessage("system", "You route tokens."),
        ChatMessage("user", "hi " * 120),
        ChatMessage("assistant", "Sure: ünïcødé ✓ 日本語"),
        ChatMessage("user", "again"),
    ],
]


@pytest.mark.parametrize("messages", CHATS, ids=["one", "system", "multi-turn-long"])
def test_router_renders_and_tokenizes_chat_exactly_as_vllm(env, messages):
    """The router's ids (rendered with the model's template, then tokenized)
    equal vLLM's own rendering of the same chat, as its OpenAI server does it."""
    from vllm.renderers.params import ChatParams

    loop, engine, _ = env
    ours = PROMPTS.tokenize(Submit("c", "tiny-llama", RequestKind.CHAT, messages=messages))
    conv = [{"role": m.role, "content": m.content} for m in messages]
    _, (theirs,) = loop.run_until_complete(
        engine.engine.renderer.render_chat_async(
            [conv], ChatParams(chat_template_kwargs={"add_generation_prompt": True})
        )
    )
    assert ours.ids == list(theirs["prompt_token_ids"]) and ours.count == len(ours.ids)


@pytest.mark.parametrize("text", ["The quick brown fox", "ünïcødé ✓ 日本語 " * 8, "word " * 200])
def test_router_tokenizes_completions_exactly_as_vllm(env, text):
    loop, engine, _ = env
    ours = PROMPTS.tokenize(Submit("c", "tiny-llama", prompt=text))
    (theirs,) = loop.run_until_complete(engine.engine.renderer.render_cmpl_async([{"prompt": text}]))
    assert ours.ids == list(theirs["prompt_token_ids"])


def test_chat_generates_from_the_routers_ids(env):
    loop, engine, _ = env
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hello there")]
    tokens = PROMPTS.tokenize(Submit("chat-1", "tiny-llama", RequestKind.CHAT, messages=messages))
    c = Collector()
    c.submit(
        engine,
        GenerateRequest(
            "chat-1", tokens.ids, tokens.count, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
        ),
    )
    ds = loop.run_until_complete(c.wait())["chat-1"]
    check_stream(ds, tokens.count, 6, "length")
    assert sum(len(d.token_ids) for d in ds) == 6  # generated ids travel in the Deltas


def test_many_concurrent_and_stats(env):
    loop, engine, _ = env
    c = Collector()
    for i in range(12):  # more than max_num_seqs=8: some wait
        c.submit(engine, completion(f"conc-{i}", max_tokens=40))

    async def watch():
        seen = []
        while c.open:
            seen.append(engine.stats())
            await asyncio.sleep(0.005)
        return seen

    seen, deltas = loop.run_until_complete(asyncio.gather(watch(), c.wait()))
    for ds in deltas.values():
        check_stream(ds, ds[0].prompt_tokens, 40, "length")
    assert max(s.running for s in seen) == 8
    assert max(s.waiting for s in seen) >= 1
    assert max(s.kv_usage for s in seen) > 0
    end = engine.stats()
    assert (end.running, end.waiting, end.kv_usage) == (0, 0, 0.0)


def test_kv_oversubscription_preempts_and_stats_count_it(env):
    loop, engine, info = env
    before = engine.stats().preemptions_total
    n = 8
    max_tokens = 400  # 8 x ~404 tokens: about 1.6x the 2048 tokens of KV
    c = Collector()
    for i in range(n):
        c.submit(engine, completion(f"pre-{i}", max_tokens=max_tokens))
    deltas = loop.run_until_complete(c.wait(timeout=120))
    for ds in deltas.values():  # preempted requests are recomputed, never repeated
        check_stream(ds, ds[0].prompt_tokens, max_tokens, "length")
    assert engine.stats().preemptions_total > before


def test_abort_ends_with_abort(env):
    loop, engine, _ = env
    aborts_before = engine.stats().aborts_total
    c = Collector()
    c.submit(engine, completion("long-1", max_tokens=400))
    c.submit(engine, completion("short-1", max_tokens=4))

    async def scenario():
        while len(c.deltas["long-1"]) < 3:
            await asyncio.sleep(0.002)
        engine.abort(["long-1", "unknown-id"])
        await c.wait()
        await asyncio.sleep(0.2)  # anything vLLM still had for it must not surface

    loop.run_until_complete(scenario())
    ds = c.deltas["long-1"]
    assert ds[-1].finish_reason == "abort" and ds[-1].completion_tokens < 400
    assert [d for d in ds if d.finish_reason] == [ds[-1]]
    check_stream(c.deltas["short-1"], ds[0].prompt_tokens, 4, "length")
    assert engine.stats().aborts_total == aborts_before + 1
    engine.abort(["long-1"])  # already over: no second final
    loop.run_until_complete(asyncio.sleep(0.05))
    assert c.deltas["long-1"][-1] is ds[-1]


def test_same_id_dispatched_again_right_after_its_abort_runs_whole(env):
    """The worker's end of a job moved off a stalled worker onto the same one
    (the only worker of its model): Abort (silent), then the same request id
    again.  The second attempt runs whole, logprobs and all: vLLM aborts by
    id, and each attempt has its own engine id, so nothing of the first
    attempt's abort can end the second."""
    loop, engine, _ = env
    c = Collector()

    async def scenario():
        for attempt in range(3):
            rid = f"again-{attempt}"
            c.submit(engine, completion(rid, max_tokens=300))
            while len(c.deltas[rid]) < 2 * attempt:  # abort at varying points, even before any output
                await asyncio.sleep(0.002)
            c.open.discard(rid)
            engine.abort([rid], tell=False)
            c.submit(engine, completion(rid, max_tokens=6, logprobs=1))
            await c.wait()
            await asyncio.sleep(0.1)  # a late abort of the first attempt would surface here

    loop.run_until_complete(scenario())
    for attempt in range(3):
        ds = c.deltas[f"again-{attempt}"]
        check_stream(ds, ds[0].prompt_tokens, 6, "length")
        assert sum(len(d.logprobs) for d in ds) == 6 * 2 * 4  # [sampled, top-1] float32 per token


def test_too_long_prompt_is_a_400_and_engine_keeps_working(env):
    loop, engine, _ = env
    c = Collector()
    c.submit(engine, completion("huge", prompt="word " * 2000, max_tokens=4))
    c.submit(engine, GenerateRequest("no-ids", [], 5, SamplingParams(max_tokens=4)))
    deltas = loop.run_until_complete(c.wait())
    ds = deltas["huge"]
    assert len(ds) == 1 and ds[0].error is not None
    assert ds[0].error.status == 400 and ds[0].error.type == "invalid_request_error"
    assert "maximum context length is 512" in ds[0].error.message
    assert [d.error.status for d in deltas["no-ids"]] == [400]
    c2 = Collector()
    c2.submit(engine, completion("after", max_tokens=3))
    check_stream(
        loop.run_until_complete(c2.wait())["after"],
        len(engine.engine.tokenizer.encode("The quick brown fox")),
        3,
        "length",
    )
    assert engine.fatal_error is None


# ------------------------------------------------------------------ issue 13: n, logprobs, structured, extras

import json  # noqa: E402

from router.policy.estimate import kv_cost  # noqa: E402
from shared.protocol import StructuredOutput, unpack_logprobs  # noqa: E402


def run_one(env, req, timeout=60):
    loop, engine, _ = env
    c = Collector()
    c.submit(engine, req)
    return loop.run_until_complete(c.wait(timeout))[req.request_id]


def gen(rid, prompt="The quick brown fox", **kw):
    tokens = PROMPTS.tokenize(Submit(rid, "tiny-llama", prompt=prompt))
    return GenerateRequest(rid, tokens.ids, tokens.count, SamplingParams(**kw))


def ids_of(ds, index=0):
    return [t for d in ds if d.index == index for t in d.token_ids]


def test_n_choices_have_indices_one_final_delta_and_summed_counts(env):
    ds = run_one(env, gen("n2", n=3, max_tokens=5, ignore_eos=True, temperature=1.0, seed=7))
    assert [d for d in ds if d.finished] == [ds[-1]]  # one final Delta for the request
    assert {d.index for d in ds} == {0, 1, 2}
    for i in range(3):
        assert len(ids_of(ds, i)) == 5
    ended = [d.index for d in ds if d.choice_finish] + [ds[-1].index]
    assert sorted(ended) == [0, 1, 2]  # each choice ended exactly once
    assert all(d.choice_finish in (None, "length") for d in ds) and ds[-1].finish_reason == "length"
    assert ds[-1].completion_tokens == 15 and sum(d.num_tokens for d in ds) == 15


def test_logprobs_are_compact_rows_in_rank_order(env):
    k = 3
    ds = run_one(env, gen("lp", max_tokens=6, ignore_eos=True, logprobs=k))
    n = 0
    for d in ds:
        if not d.token_ids:
            continue
        vals = unpack_logprobs(d.logprobs)
        assert len(vals) == len(d.token_ids) * (1 + k) and len(d.top_ids) == len(d.token_ids) * k
        for t, tid in enumerate(d.token_ids):
            row = vals[t * (1 + k) : (t + 1) * (1 + k)]
            tops = list(row[1:])
            assert all(v <= 0 for v in row) and tops == sorted(tops, reverse=True)
            ids = d.top_ids[t * k : (t + 1) * k]
            if tid in ids:
                assert row[0] == tops[ids.index(tid)]
            else:
                assert row[0] <= tops[-1]
            n += 1
    assert n == 6


def test_logprobs_zero_sends_the_tokens_own_only(env):
    ds = run_one(env, gen("lp0", max_tokens=4, ignore_eos=True, logprobs=0))
    assert sum(len(unpack_logprobs(d.logprobs)) for d in ds) == 4 and not any(d.top_ids for d in ds)


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(env):
    import jsonschema

    so = StructuredOutput(json=json.dumps(SCHEMA))
    for seed in (1, 2):
        ds = run_one(env, gen(f"js{seed}", max_tokens=200, seed=seed, structured=so))
        assert ds[-1].finish_reason == "stop", "the grammar ended it, not max_tokens"
        jsonschema.validate(json.loads("".join(d.text for d in ds)), SCHEMA)


def test_choice_and_regex_constraints(env):
    ds = run_one(env, gen("ch", max_tokens=20, structured=StructuredOutput(choice=["alpha", "beta"])))
    assert "".join(d.text for d in ds) in ("alpha", "beta")
    ds = run_one(env, gen("re", max_tokens=20, structured=StructuredOutput(regex="[0-9]{4}")))
    text = "".join(d.text for d in ds)
    assert len(text) == 4 and text.isdigit()


def test_sampling_extras_reach_the_engine(env):
    greedy = ids_of(run_one(env, gen("g", max_tokens=8, ignore_eos=True, temperature=0.0)))
    # logit_bias -100 bans the greedy first token
    banned = ids_of(
        run_one(env, gen("ban", max_tokens=8, ignore_eos=True, temperature=0.0, logit_bias={greedy[0]: -100.0}))
    )
    assert banned[0] != greedy[0] and greedy[0] not in banned
    # +100 forces a token; stop_token_ids on it stops at once
    forced = 7
    ds = run_one(env, gen("force", max_tokens=8, ignore_eos=True, logit_bias={forced: 100.0}))
    assert set(ids_of(ds)) == {forced}
    ds = run_one(env, gen("stopid", max_tokens=8, logit_bias={forced: 100.0}, stop_token_ids=[forced]))
    assert ds[-1].finish_reason == "stop" and ds[-1].completion_tokens == 1
    # min_tokens holds the stop back
    ds = run_one(env, gen("mint", max_tokens=8, logit_bias={forced: 100.0}, stop_token_ids=[forced], min_tokens=5))
    assert ds[-1].finish_reason == "stop" and ds[-1].completion_tokens == 6
    # top_k=1 and min_p=1 sample the greedy token at any temperature
    assert ids_of(run_one(env, gen("tk", max_tokens=8, ignore_eos=True, temperature=1.5, top_k=1, seed=3))) == greedy
    assert ids_of(run_one(env, gen("mp", max_tokens=8, ignore_eos=True, temperature=1.5, min_p=1.0, seed=3))) == greedy
    # a huge repetition penalty: no generated token repeats (greedy alone loops)
    long_greedy = ids_of(run_one(env, gen("g30", max_tokens=30, ignore_eos=True, temperature=0.0)))
    assert len(set(long_greedy)) < 30
    rp = ids_of(run_one(env, gen("rp", max_tokens=30, ignore_eos=True, temperature=0.0, repetition_penalty=1e6)))
    assert len(set(rp)) == 30


def test_n_sequences_share_the_prompts_full_blocks_as_kv_cost_says(env):
    """The ledger's n > 1 price (estimate.kv_cost, shared_prompt) equals vLLM's
    own peak KV usage: prefix caching holds the prompt's full blocks once."""
    loop, engine, info = env
    assert info.prefix_caching  # vLLM's default, and what the worker registers
    bs = info.block_size
    blocks = info.kv_capacity_tokens // bs
    req = gen("kvn", prompt="word " * 150, n=4, max_tokens=30, ignore_eos=True, temperature=1.0)
    c = Collector()
    c.submit(engine, req)

    async def watch():
        peak = 0.0
        while c.open:
            peak = max(peak, engine.stats().kv_usage)
            await asyncio.sleep(0.002)
        return peak

    peak, _ = loop.run_until_complete(asyncio.gather(watch(), c.wait()))
    used = round(peak * blocks)
    assert used * bs == kv_cost(req.prompt_tokens, 30, bs, 4, shared_prompt=True)
    assert used * bs < kv_cost(req.prompt_tokens, 30, bs, 4, shared_prompt=False)


# ------------------------------------------------------------ prefix caching, exactly


@pytest.fixture(scope="module")
def kv(env):
    """The engine's KV events through the worker's own consumer (vllm_events -> PrefixFeed)."""
    import zmq

    from engine_worker.prefix_feed import PrefixFeed
    from engine_worker.vllm_events import VllmKvEvents
    from shared.transport import SocketPump

    loop, engine, info = env
    sent = []
    feed = PrefixFeed(loop, sent.append)
    ctx = zmq.Context()
    source = VllmKvEvents(
        ctx, SocketPump(loop), loop, info.kv_events_endpoint, info.kv_events_replay, feed, engine.reset_prefix_cache
    )
    loop.run_until_complete(asyncio.sleep(0.3))
    # It joins a running engine: if earlier tests made it publish, its first
    # batch shows a gap, filled by replay from seq 0 (test_replay_fills_a_gap...
    # checks that on its own).  Ready once this request's own blocks are in:
    # the replay is over then (its batch came last), so the tests that follow
    # see only their own events.  A SUB that joined late misses a batch:
    # another request's blocks make the next one.
    from router.fleet.block_hash import BlockHasher
    from router.lifecycle.models import tokenize_hashed

    hasher = BlockHasher(info.prefix_hash, info.block_size, info.prefix_hash_seed)
    joined = False
    for attempt in range(3):
        sub = Submit(f"kv-join-{attempt}", "tiny-llama", prompt=_words(40, 77 + attempt))
        tokens = tokenize_hashed(PROMPTS, sub, hasher)
        assert tokens.hashes  # a full block at least: a batch
        c = Collector()
        c.submit(
            engine,
            GenerateRequest(sub.request_id, tokens.ids, tokens.count, SamplingParams(max_tokens=1, temperature=0.0)),
        )
        loop.run_until_complete(c.wait())
        joined = _wait(loop, lambda want=set(tokens.hashes): feed.trusted and want <= feed.blocks, 10.0)
        if joined:
            break
    assert joined and source.last >= 0
    try:
        yield feed, sent
    finally:
        source.close()
        ctx.term()


def _words(n: int, seed: int) -> str:
    return " ".join(f"w{(i * 7 + seed) % 97}x{seed}" for i in range(n))


def _wait(loop, cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        loop.run_until_complete(asyncio.sleep(0.02))
    return cond()


def test_router_block_hashes_equal_the_engines_kv_events(env, kv):
    """The router's tokens + block hashes (router.lifecycle.models.tokenize_hashed) are
    exactly the blocks the engine reports storing, for 1-3 blocks, completion
    and chat (template applied)."""
    from router.fleet.block_hash import BlockHasher
    from router.lifecycle.models import tokenize_hashed
    from shared.protocol import PrefixEvents

    loop, engine, info = env
    feed, sent = kv
    assert info.prefix_hash == "sha256" and info.block_size == 128 and info.kv_events_endpoint
    hasher = BlockHasher(info.prefix_hash, info.block_size, info.prefix_hash_seed)
    cases = [
        Submit("x1", "tiny-llama", prompt=_words(30, 1)),
        Submit("x3", "tiny-llama", prompt=_words(95, 2)),
        Submit(
            "xc",
            "tiny-llama",
            kind=RequestKind.CHAT,
            messages=[ChatMessage("system", _words(50, 3)), ChatMessage("user", _words(10, 4))],
        ),
    ]
    counts = set()
    for sub in cases:
        tokens = tokenize_hashed(PROMPTS, sub, hasher)
        assert len(tokens.hashes) == tokens.count // 128 >= 1 and tokens.count < 500, tokens.count
        counts.add(len(tokens.hashes))
        before = len(sent)
        c = Collector()
        c.submit(
            engine,
            GenerateRequest(sub.request_id, tokens.ids, tokens.count, SamplingParams(max_tokens=1, temperature=0.0)),
        )
        loop.run_until_complete(c.wait())
        assert _wait(loop, lambda want=set(tokens.hashes): want <= feed.blocks), (tokens.hashes, sent[before:])
        stored = [h for m in sent[before:] if isinstance(m, PrefixEvents) for h in m.stored]
        assert sorted(stored) == sorted(tokens.hashes)  # exactly its blocks: nothing else, nothing missed
    assert len(counts) == 3


def test_cached_tokens_come_from_the_engine(env, kv):
    loop, engine, _ = env
    tokens = PROMPTS.tokenize(Submit("cc", "tiny-llama", prompt=_words(70, 9)))
    full = tokens.count // 128 * 128
    assert full >= 256
    out = {}
    for rid in ("cc1", "cc2"):
        c = Collector()
        c.submit(engine, GenerateRequest(rid, tokens.ids, tokens.count, SamplingParams(max_tokens=2)))
        out.update(loop.run_until_complete(c.wait()))
    assert out["cc1"][0].cached_tokens == 0
    hit = out["cc2"][0].cached_tokens
    assert hit >= 128 and hit % 128 == 0 and out["cc2"][-1].cached_tokens == hit


def test_reset_prefix_cache_is_reported_as_cleared(env, kv):
    from shared.protocol import PrefixEvents

    loop, engine, _ = env
    feed, sent = kv
    assert _wait(loop, lambda: bool(feed.blocks))
    before = len(sent)
    engine.reset_prefix_cache()
    c = Collector()  # AllBlocksCleared is published at the engine's next step
    c.submit(engine, completion("after-reset", "hi", max_tokens=1))
    loop.run_until_complete(c.wait())
    assert _wait(loop, lambda: any(isinstance(m, PrefixEvents) and m.cleared for m in sent[before:]))


def test_reset_prefix_cache_while_a_request_runs_takes_once_it_ends(env, kv):
    """vLLM refuses a reset while any block is in use (gaps come under load):
    the worker asks again until it takes, so the cleared event still comes."""
    from shared.protocol import PrefixEvents

    loop, engine, _ = env
    feed, sent = kv
    before = len(sent)
    c = Collector()
    c.submit(engine, completion("busy-reset", _words(40, 55), max_tokens=500))
    assert _wait(loop, lambda: len(c.deltas["busy-reset"]) >= 2)  # decoding: it holds blocks
    engine.reset_prefix_cache()  # refused by vLLM now
    loop.run_until_complete(c.wait())

    def cleared():
        return any(isinstance(m, PrefixEvents) and m.cleared for m in sent[before:])

    for i in range(20):  # AllBlocksCleared is published at the engine step after the retry took
        c = Collector()
        c.submit(engine, completion(f"busy-reset-after-{i}", "hi", max_tokens=1))
        loop.run_until_complete(c.wait())
        if _wait(loop, cleared, 1.0):
            break
    assert cleared()


def test_extra_keys_match_vllm():
    """cache_salt / LoRA go into the first block's extra keys: the router's
    hasher agrees with vLLM's own hash_block_tokens (weir sends neither yet)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    from router.fleet.block_hash import BlockHasher

    ids = list(range(1000, 1000 + 128 * 3 + 5))
    for algo in ("sha256", "sha256_cbor"):
        hf = get_hash_fn_by_name(algo)
        kcu.init_none_hash(hf)
        for extra in (None, (("cache_salt", "tenant-a"),)):
            parent, want = None, []
            for i in range(3):
                parent = kcu.hash_block_tokens(hf, parent, ids[i * 128 : (i + 1) * 128], extra if i == 0 else None)
                want.append(kcu.maybe_convert_block_hash(parent))
            assert BlockHasher(algo, 128).hashes(ids, extra) == want


@pytest.mark.parametrize("buffer_steps, recovers", [(100, True), (2, False)])
def test_replay_fills_a_gap_and_loss_beyond_it_goes_blind(buffer_steps, recovers):
    """vLLM's real publisher: a subscriber that missed batches gets them from
    the replay socket; one that missed more than the buffer is cache-blind
    until an AllBlocksCleared."""
    import tempfile

    import uvloop
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, ZmqEventPublisher

    from engine_worker.prefix_feed import PrefixFeed
    from engine_worker.vllm_events import VllmKvEvents
    from shared.protocol import PrefixEvents, PrefixSnapshot
    from shared.transport import SocketPump

    def batch(*events):
        return KVEventBatch(ts=time.time(), events=list(events))

    def stored(*hs):
        return BlockStored(
            block_hashes=list(hs),
            parent_block_hash=None,
            token_ids=[],
            block_size=128,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )

    d = tempfile.mkdtemp(prefix="weir-kvt-")
    loop = uvloop.new_event_loop()
    try:
        ep, rep = f"ipc://{d}/pub{buffer_steps}", f"ipc://{d}/rep{buffer_steps}"
        pub = ZmqEventPublisher(0, ep, rep, buffer_steps=buffer_steps)
        for i in range(4):  # published before anyone subscribed: missed
            pub.publish(batch(stored(i + 1)))
        time.sleep(0.3)
        sent, lost = [], []
        feed = PrefixFeed(loop, sent.append)
        ctx = zmq.Context()
        src = VllmKvEvents(ctx, SocketPump(loop), loop, ep, rep, feed, lambda: lost.append(1))
        loop.run_until_complete(asyncio.sleep(1.0))  # the SUB joins (a slow joiner misses what is sent)
        pub.publish(batch(stored(5)))  # seq 4: the gap shows
        if recovers:
            assert _wait(loop, lambda: feed.trusted and feed.blocks == {1, 2, 3, 4, 5}, 10.0)
            assert src.gaps >= 1 and not lost
        else:
            assert _wait(loop, lambda: lost, 10.0)
            assert not feed.trusted and not feed.blocks
            assert isinstance(sent[-1], PrefixSnapshot) and not sent[-1].trusted
            pub.publish(batch(AllBlocksCleared(), stored(9)))
            assert _wait(loop, lambda: feed.trusted, 10.0)
            assert feed.blocks == {9}
            assert isinstance(sent[-1], PrefixEvents) and sent[-1].cleared and sent[-1].stored == [9]
        src.close()
        pub.shutdown()
        ctx.term()
    finally:
        loop.close()
