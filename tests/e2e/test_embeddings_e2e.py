"""/v1/embeddings on real processes: the openai SDK through Envoy to the router
and a real vLLM worker serving the tiny pooling model (models/tiny-embed),
beside a simulated generation model.  Single, batched, base64 and float,
token ids, Matryoshka ``dimensions``; the refusals (other task, too long,
bad ``dimensions``) with nothing left reserved; budgets charged with the
prompt tokens the response reports.

One stack (``embed_stack``, tests/e2e/conftest.py; ~20 s to start: one vLLM
engine), shared with the differential test against ``vllm serve``."""

from __future__ import annotations

import math
import time

import numpy as np
import openai
import pytest
import requests
from stackutil import EMBED_DIR, EMBED_KEY, EMBED_MODEL, SIM_MODEL

from router.lifecycle.prompts import ModelPrompts
from shared import protocol as p

pytestmark = pytest.mark.vllm

EMBED = EMBED_MODEL
KEY = EMBED_KEY
WIDTH = 128  # the tiny model's hidden size
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def stack(embed_stack):
    return embed_stack


@pytest.fixture(scope="module")
def sdk(stack):
    return openai.OpenAI(base_url=stack.envoy_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _vec(item) -> np.ndarray:
    return np.asarray(item.embedding, dtype=np.float32)


def _prompt_tokens(text: str) -> int:
    return ModelPrompts(str(EMBED_DIR)).tokenize(p.Submit("r", EMBED, kind=p.RequestKind.EMBEDDING, prompt=text)).count


def _tenant_prompt_tokens(stack) -> int:
    t = requests.get(stack.router_url + "/admin/tenants", timeout=5).json()["tenants"].get("emb", {})
    return t.get("usage", {}).get("prompt_tokens", 0)


def _reserved(stack) -> int:
    rows = requests.get(stack.router_url + "/admin/workers", timeout=5).json()
    return sum(r["reserved_tokens"] for r in rows)


def test_single_and_batched_embeddings_in_both_encodings_agree(sdk, stack):
    before = _tenant_prompt_tokens(stack)
    one = sdk.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float")
    assert one.model == EMBED and len(one.data) == 1 and one.data[0].index == 0
    v = _vec(one.data[0])
    assert v.shape == (WIDTH,) and math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-3)
    assert one.usage.prompt_tokens == one.usage.total_tokens == _prompt_tokens(TEXTS[0])
    # the SDK's default: base64 on the wire, decoded by the SDK with numpy
    batch = sdk.embeddings.create(model=EMBED, input=TEXTS)
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == sum(_prompt_tokens(t) for t in TEXTS)
    assert np.array_equal(_vec(batch.data[0]), v)  # the same prompt, alone or in a batch, float or base64
    assert not np.allclose(_vec(batch.data[0]), _vec(batch.data[1]))
    raw = requests.post(
        stack.envoy_url + "/v1/embeddings",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": EMBED, "input": TEXTS[1], "encoding_format": "base64"},
        timeout=30,
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["id"].startswith("embd-")
    # budgets count every input's prompt tokens (settled when each ends)
    used = one.usage.prompt_tokens + batch.usage.prompt_tokens + raw["usage"]["prompt_tokens"]
    assert _tenant_prompt_tokens(stack) - before == used
    assert _reserved(stack) == 0


def test_token_ids_embed_as_their_text_does(sdk):
    ids = ModelPrompts(str(EMBED_DIR)).tokenize(p.Submit("r", EMBED, kind=p.RequestKind.EMBEDDING, prompt=TEXTS[2])).ids
    by_text = sdk.embeddings.create(model=EMBED, input=TEXTS[2], encoding_format="float")
    by_ids = sdk.embeddings.create(model=EMBED, input=ids, encoding_format="float")
    lists = sdk.embeddings.create(model=EMBED, input=[ids, ids[:3]], encoding_format="float")
    assert np.array_equal(_vec(by_ids.data[0]), _vec(by_text.data[0]))
    assert np.array_equal(_vec(lists.data[0]), _vec(by_text.data[0])) and lists.usage.prompt_tokens == len(ids) + 3


def test_matryoshka_dimensions(sdk):
    short = sdk.embeddings.create(model=EMBED, input=TEXTS[0], dimensions=32, encoding_format="float")
    v = _vec(short.data[0])
    assert v.shape == (32,) and math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-3)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.embeddings.create(model=EMBED, input=TEXTS[0], dimensions=WIDTH + 1)
    assert e.value.body["param"] == "dimensions"


def test_refusals_name_the_field_and_leave_nothing_reserved(sdk, stack):
    cases = [
        (lambda: sdk.embeddings.create(model=SIM_MODEL, input="hi"), "model"),  # a generation model
        (lambda: sdk.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}]), "model"),
        (lambda: sdk.completions.create(model=EMBED, prompt="hi"), "model"),
        (lambda: sdk.embeddings.create(model=EMBED, input="word " * 400), "input"),  # over the 256 context
        (lambda: sdk.embeddings.create(model=EMBED, input=[]), "input"),
        (lambda: sdk.embeddings.create(model=EMBED, input=[10**6]), "input"),  # outside the vocabulary
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, e.value.body
    too_long = requests.post(
        stack.envoy_url + "/v1/embeddings",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": EMBED, "input": "word " * 400},
        timeout=30,
    ).json()
    assert too_long["error"]["code"] == "context_length_exceeded"
    time.sleep(0.2)
    assert _reserved(stack) == 0


def test_a_batch_is_served_concurrently_and_quickly(sdk):
    t0 = time.perf_counter()
    out = sdk.embeddings.create(model=EMBED, input=[f"sentence number {i}" for i in range(64)])
    took = time.perf_counter() - t0
    assert len(out.data) == 64 and [d.index for d in out.data] == list(range(64))
    assert took < 10, took
