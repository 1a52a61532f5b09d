"""Embedding requests through the router's lifecycle (router.lifecycle.core) with fake
workers: priced and budgeted as prefill only, dispatched with ``embed``,
released once; refused before anything is reserved when the model serves the
other task, the input is too long or ``dimensions`` does not fit the model."""

from __future__ import annotations

import msgspec
import pytest
from fakes import registration
from test_lifecycle import Harness, Sink

from router.policy.estimate import kv_cost
from shared import protocol as p
from shared.config import Config
from shared.keys import digest

KEY = "sk-embed"
PROMPT = "x" * 40  # the sim models (no tokenizer) count 40 bytes as 10 tokens
PROMPT_TOKENS = 10


def config() -> Config:
    return msgspec.convert(
        {
            "router": {"heartbeat_interval_s": 0.5},
            "models": [
                {"name": "sim-m", "engine": "sim", "max_model_len": 4096},
                {"name": "sim-e", "engine": "sim", "task": "embed", "max_model_len": 64},
            ],
            "api_keys": [{"key_sha256": digest(KEY), "tenant": "a", "tokens_per_minute": 1000}],
        },
        Config,
    )


@pytest.fixture
def h():
    harness = Harness(config())
    for wid, model in (("wm", "sim-m"), ("we", "sim-e")):
        harness.workers.linked.add(wid)
        harness.core.worker_joined(registration(wid, model))
    yield harness
    harness.close()


def embed(h: Harness, prompt: str = PROMPT, model: str = "sim-e", **fields) -> int | p.ErrorInfo:
    sink = Sink()
    sub = p.Submit("c", model, kind=p.RequestKind.EMBEDDING, prompt=prompt, api_key=KEY, **fields)
    got = h.core.submit(sub, sink)
    if isinstance(got, int):
        h.sinks[got] = sink
    return got


def tokens_left(h: Harness) -> float:
    q = h.core.quota
    (bucket,) = next(iter(q.by_key.values()))
    return q.store.level(bucket, h.clock())


def test_an_embedding_is_reserved_as_prefill_dispatched_and_released_once(h):
    a = embed(h, dimensions=16)
    assert isinstance(a, int)
    assert tokens_left(h) == 1000 - PROMPT_TOKENS  # the budget holds the prompt only
    h.settle()
    (req,) = h.workers.dispatched["we"]
    assert req.embed and req.dimensions == 16 and req.params.max_tokens == 0 and req.prompt_tokens == PROMPT_TOKENS
    assert h.reserved() == kv_cost(PROMPT_TOKENS, 0, 16) == 16  # one block: nothing to generate
    vector = p.pack_floats([0.6, 0.8])
    h.core.on_outputs(
        "we", [p.Delta(req.request_id, finish_reason="stop", prompt_tokens=PROMPT_TOKENS, embedding=vector)]
    )
    (final,) = h.sinks[a].finals
    assert final.embedding == vector and final.prompt_tokens == PROMPT_TOKENS
    assert h.reserved() == 0 and not h.core.jobs
    assert tokens_left(h) == 1000 - PROMPT_TOKENS and h.core.quota.outstanding == 0  # charged what it used


def test_a_lost_worker_dispatches_an_embedding_again(h):
    a = embed(h)
    h.settle()
    h.workers.linked.add("we2")
    h.core.worker_joined(registration("we2", "sim-e"))
    h.workers.linked.discard("we")
    h.core.worker_left("we", "heartbeat_timeout")
    h.settle()
    (again,) = h.workers.dispatched["we2"]
    assert again.embed and again.request_id == "%x" % a and h.reserved() == 16


@pytest.mark.parametrize(
    "model, kind, fields, param",
    [
        ("sim-m", p.RequestKind.EMBEDDING, {}, "model"),  # an embedding request to a generation model
        ("sim-e", p.RequestKind.COMPLETION, {"max_tokens": 4}, "model"),  # and the reverse
        ("sim-e", p.RequestKind.EMBEDDING, {"prompt": "x" * 400}, "input"),  # 100 tokens > 64
        ("sim-e", p.RequestKind.EMBEDDING, {"dimensions": 65}, "dimensions"),  # the sim is 64 wide
        ("sim-e", p.RequestKind.EMBEDDING, {"prompt": "", "prompt_token_ids": []}, "input"),
    ],
)
def test_refusals_come_before_anything_is_reserved(h, model, kind, fields, param):
    sub = p.Submit("c", model, kind=kind, prompt=fields.pop("prompt", PROMPT), api_key=KEY, **fields)
    got = h.core.submit(sub, Sink())
    assert isinstance(got, p.ErrorInfo) and got.status == 400 and got.param == param, got
    h.settle()
    assert h.reserved() == 0 and not h.core.jobs and not h.workers.dispatched
    assert tokens_left(h) == 1000 and h.core.quota.outstanding == 0


def test_token_id_input_is_counted_exactly(h):
    a = embed(h, prompt="", prompt_token_ids=[3] * 30)
    assert isinstance(a, int)
    h.settle()
    (req,) = h.workers.dispatched["we"]
    assert req.prompt_tokens == 30 and tokens_left(h) == 1000 - 30
