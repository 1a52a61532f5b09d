"""Bad sampling extras for a vLLM model are 400s naming the field, and nothing
is reserved or queued: the HTTP decoder (router.api) and then the
lifecycle's checks against the tiny model's tokenizer and grammar compiler
(router.lifecycle.core, router.lifecycle.prompts), in-process with fake workers.  The wire
mapping of such a refusal (status, JSON body) is tests/inproc/test_http_server.py's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from fakes import registration
from test_lifecycle import Harness, Sink

from router import api
from router.lifecycle import prompts as prompts_module
from router.lifecycle.prompts import ModelPrompts
from shared import protocol as p
from shared.config import Config

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 2048  # the e2e stack's vLLM context
KV_TOKENS = 32768  # its KV cache: 16 MiB of the tiny model
PROMPT = "The quick brown fox jumps over the lazy dog."

# The tokenizer is built by `make test` / `make test-fast` (models/tiny-llama): a missing one fails here.

BAD = [
    ({"n": 2, "temperature": 0}, "n"),
    ({"n": 128, "max_tokens": 1500}, "n"),  # each fits the context; 128 of them fit no worker's KV
    ({"logprobs": 21}, "logprobs"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
        "response_format",
    ),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"top_k": -5}, "top_k"),
]


@pytest.fixture(scope="module")
def prompts() -> Iterator[ModelPrompts]:
    # The first structured request of a process imports xgrammar on the
    # tokenizing thread; later ones compile inline.  test_lifecycle checks the
    # first path, so the process forgets the import again afterwards.
    first = prompts_module._xgr
    yield ModelPrompts(str(TINY))
    prompts_module._xgr = first


@pytest.fixture
def h(prompts: ModelPrompts):
    cfg = msgspec.convert(
        {"models": [{"name": MODEL, "engine": "vllm", "path": str(TINY), "max_model_len": MAX_MODEL_LEN}]}, Config
    )
    harness = Harness(cfg, prompts={MODEL: prompts})
    harness.workers.linked.add("vllm-0")
    harness.core.worker_joined(
        registration("vllm-0", MODEL, max_model_len=MAX_MODEL_LEN, kv=KV_TOKENS, seqs=8, engine="vllm")
    )
    yield harness
    harness.close()


def _requests_total(h: Harness) -> float:
    total = 0.0
    for family in h.core.metrics.registry.collect():
        for s in family.samples:
            if s.name == "weir_requests_total" and s.labels.get("model") == MODEL:
                total += s.value
    return total


def _refusal(h: Harness, body: dict) -> p.ErrorInfo:
    """What the client hears: the decoder's refusal, submit's, or (a schema
    compiled off the loop) the job's one final Delta."""
    try:
        sub, _ = api.parse_completion(json.dumps(body).encode(), api.meta_from_headers(None, None), "r")
    except api.RequestError as e:
        return e.info
    sink = Sink()
    handle = h.core.submit(sub, sink)
    if isinstance(handle, p.ErrorInfo):
        return handle
    for _ in range(1000):
        if sink.finals:
            break
        h.loop.run_until_complete(asyncio.sleep(0.01))
    (final,) = sink.finals
    assert final.error is not None, "a bad request was served"
    return final.error


@pytest.mark.parametrize("fields,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_extras_are_400s_naming_the_field_and_reserve_nothing(h: Harness, fields: dict, param: str) -> None:
    before = _requests_total(h)
    err = _refusal(h, {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **fields})
    assert err.status == 400, err
    assert err.param == param
    assert _requests_total(h) == before  # never queued
    assert h.reserved() == 0
    assert not h.core.jobs and not h.workers.dispatched
