"""LoRA adapters end to end: real Envoy, router and vLLM (CPU build) workers.

One stack for the module: ``tiny-llama`` with two tiny adapters
(deploy/make_adapter.py, seeds 1 and 2) on a LoRA worker that holds one
adapter in its engine at a time (``max_loras`` 1, so the two take turns),
and ``tiny-plain``: the same weights on a worker without LoRA, the
reference for the base model's output.
"""

from __future__ import annotations

import pytest
import requests
import stackutil

from deploy.make_adapter import build as build_adapter
from shared.client import Client

BASE = stackutil.VLLM_MODEL
PLAIN = "tiny-plain"
LORA_A, LORA_B = "tiny-lora-a", "tiny-lora-b"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_stack")
    a = build_adapter(str(d / "lora-a"), str(stackutil.TINY_MODEL_DIR), seed=1)
    b = build_adapter(str(d / "lora-b"), str(stackutil.TINY_MODEL_DIR), seed=2)
    models = stackutil.localconfig.models()
    models[0]["lora"] = {"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 2}
    models.append({"name": PLAIN, "engine": "vllm", "path": str(stackutil.TINY_MODEL_DIR), "max_model_len": 512})
    cfg = stackutil.write_config(
        d,
        models=models,
        adapters=[{"name": LORA_A, "base": BASE, "path": str(a)}, {"name": LORA_B, "base": BASE, "path": str(b)}],
        workers=[stackutil.vllm_worker("vllm-lora"), stackutil.vllm_worker("vllm-plain", model=PLAIN)],
    )
    with stackutil.start_stack(cfg, d / "run") as s:
        yield s


def _complete(stack, model: str, prompt: str = PROMPT) -> requests.Response:
    return requests.post(
        stack.envoy_url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )


def _text(stack, model: str, prompt: str = PROMPT) -> str:
    r = _complete(stack, model, prompt)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model  # the answer names what was asked for: the adapter, not its base
    return body["choices"][0]["text"]


def test_adapters_listed_with_their_base_as_parent(lora_stack):
    data = {m["id"]: m for m in requests.get(lora_stack.envoy_url + "/v1/models", timeout=5).json()["data"]}
    assert data[LORA_A]["parent"] == BASE and data[LORA_B]["parent"] == BASE
    assert data[BASE]["parent"] is None
    one = requests.get(lora_stack.envoy_url + f"/v1/models/{LORA_B}", timeout=5).json()
    assert one["id"] == LORA_B and one["parent"] == BASE


def test_adapter_output_differs_from_the_base_and_is_deterministic(lora_stack):
    base = _text(lora_stack, BASE)
    plain = _text(lora_stack, PLAIN)
    a1 = _text(lora_stack, LORA_A)
    b1 = _text(lora_stack, LORA_B)  # (max_loras 1: b takes a's engine slot)
    a2 = _text(lora_stack, LORA_A)  # ... and a comes back from the CPU cache
    base2 = _text(lora_stack, BASE)
    assert base == plain  # LoRA on the worker leaves the base model's output as it was
    assert a1 != base and b1 != base and a1 != b1
    assert a1 == a2 and base2 == base  # greedy under an adapter is deterministic; the base stays untouched


def test_adapter_in_chat_and_over_zeromq(lora_stack):
    r = requests.post(
        lora_stack.envoy_url + "/v1/chat/completions",
        json={"model": LORA_A, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == LORA_A
    http_text = _text(lora_stack, LORA_B)
    with Client(lora_stack.zmq_frontend, api_key=None) as c:
        zmq = c.complete(LORA_B, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert zmq.text == http_text  # the same adapter over the direct ZeroMQ client


def test_unknown_adapter_is_model_not_found(lora_stack):
    r = _complete(lora_stack, "tiny-lora-nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
