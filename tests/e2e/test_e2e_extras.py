"""End to end: n, logprobs, structured output and vLLM's sampling extras
through Envoy with the openai SDK on the real tiny model, and the same over
ZeroMQ.  Uses the session ``stack`` fixture (tests/e2e/conftest.py).  Bad
extras refused before anything is reserved: tests/inproc/test_bad_extras.py.

The model has random weights: its text is gibberish, so tests assert shapes,
counts and constraints (a grammar, a banned or forced token), never words.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests
from stackutil import KEY_BETA, SIM_MODEL, TINY_MODEL_DIR, VLLM_MODEL
from test_e2e_api import metric, sdk, wait_until, worker_row
from tokenizers import Tokenizer

from shared.client import Client, WeirError

PROMPT = "The quick brown fox jumps over the lazy dog."
TOK = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def client(stack):
    return sdk(stack, KEY_BETA)


def test_n_gives_n_choices_and_summed_usage(stack):
    r = client(stack).completions.create(
        model=VLLM_MODEL, prompt=PROMPT, max_tokens=6, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(TOK.encode(PROMPT).ids)
    chunks = list(
        client(stack).chat.completions.create(
            model=VLLM_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    finish = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    }
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 15


def test_completion_logprobs_shapes_stream_and_not(stack):
    r = client(stack).completions.create(
        model=VLLM_MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # top_logprobs is OpenAI's {token text: logprob}: the sampled token + the top 2, fewer where
    # texts collide (256 of tiny-llama's 454 tokens are bytes, each alone decoding to U+FFFD).
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(
        client(stack).completions.create(
            model=VLLM_MODEL, prompt=PROMPT, max_tokens=5, logprobs=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 5


def test_chat_logprobs_shapes_stream_and_not(stack):
    msgs = [{"role": "user", "content": "hi"}]
    r = client(stack).chat.completions.create(
        model=VLLM_MODEL, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 == r.usage.completion_tokens
    for c in content:
        assert c.logprob <= 0 and c.bytes == list(c.token.encode("utf-8", errors="replace"))
        assert len(c.top_logprobs) == 3 and [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True
        )
    chunks = list(
        client(stack).chat.completions.create(
            model=VLLM_MODEL, messages=msgs, max_tokens=4, logprobs=True, stream=True, extra_body={"ignore_eos": True}
        )
    )
    content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(content) == 4 and all(t.top_logprobs == [] for t in content)


def test_json_schema_response_parses_and_validates(stack):
    msgs = [{"role": "user", "content": "Give me JSON."}]
    for seed in (1, 2):
        r = client(stack).chat.completions.create(
            model=VLLM_MODEL,
            messages=msgs,
            max_tokens=200,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client(stack).completions.create(
        model=VLLM_MODEL, prompt=PROMPT, max_tokens=100, seed=3, extra_body={"response_format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = client(stack).completions.create(
        model=VLLM_MODEL, prompt=PROMPT, max_tokens=20, extra_body={"structured_outputs": {"choice": ["left", "right"]}}
    )
    assert r.choices[0].text in ("left", "right")


def test_disable_any_whitespace_makes_json_compact(stack):
    """vLLM's per-request structured_outputs.disable_any_whitespace (vLLM 0.32
    takes it only server-wide): json and json_object come out with no free
    whitespace, greedy on the random model (the worker's grammar has none)."""
    msgs = [{"role": "user", "content": "Give me JSON."}]
    for so in ({"json": SCHEMA}, {"json_object": True}):
        r = client(stack).chat.completions.create(
            model=VLLM_MODEL,
            messages=msgs,
            max_tokens=48,
            temperature=0,
            extra_body={"structured_outputs": {**so, "disable_any_whitespace": True}},
        )
        text = r.choices[0].message.content
        outside_strings = text.split('"')[0::2]  # (no escaped quotes in this output)
        assert text and not any(ch.isspace() for seg in outside_strings for ch in seg), text
        print(f"\n{so}: {r.choices[0].finish_reason}, {r.usage.completion_tokens} tokens: {text}")
        if r.choices[0].finish_reason == "stop":
            value = json.loads(text)
            assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            if "json" in so:
                jsonschema.validate(value, SCHEMA)


def test_each_sampling_extra_reaches_the_engine(stack):
    c = client(stack)
    eos = {"ignore_eos": True}
    greedy = c.completions.create(
        model=VLLM_MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, extra_body=eos
    )
    first = (
        TOK.token_to_id(greedy.choices[0].logprobs.tokens[0])
        or TOK.encode(greedy.choices[0].logprobs.tokens[0], add_special_tokens=False).ids[0]
    )
    banned = c.completions.create(
        model=VLLM_MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        logit_bias={str(first): -100},
        extra_body=eos,
    )
    assert banned.choices[0].logprobs.tokens[0] != greedy.choices[0].logprobs.tokens[0]
    forced = 7
    r = c.completions.create(
        model=VLLM_MODEL,
        prompt=PROMPT,
        max_tokens=8,
        logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced]},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = c.completions.create(
        model=VLLM_MODEL,
        prompt=PROMPT,
        max_tokens=8,
        logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced], "min_tokens": 5},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 6
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = c.completions.create(
            model=VLLM_MODEL, prompt=PROMPT, max_tokens=6, temperature=1.5, seed=5, extra_body={**eos, **extra}
        )
        assert r.choices[0].text == greedy.choices[0].text, extra
    plain = c.completions.create(model=VLLM_MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body=eos)
    r = c.completions.create(
        model=VLLM_MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={**eos, "repetition_penalty": 1e6}
    )
    assert r.choices[0].text != plain.choices[0].text  # (ids never repeat: tests/e2e/test_engine_vllm.py)
    r = c.completions.create(model=VLLM_MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0, extra_body=eos)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def test_user_is_recorded_under_the_keys_tenant(stack):
    before = metric(stack, "weir_user_field_requests_total", tenant="beta")
    client(stack).completions.create(model=SIM_MODEL, prompt="hi", max_tokens=2, user="alice")
    assert metric(stack, "weir_user_field_requests_total", tenant="beta") == before + 1
    assert metric(stack, "weir_tenant_distinct_users", tenant="beta") >= 1
    assert metric(stack, "weir_tenant_distinct_users", tenant="alice") == 0  # never an identity


def test_chat_top_logprobs_above_20_is_a_400(stack):
    r = requests.post(
        stack.envoy_url + "/v1/chat/completions",
        timeout=30,
        headers={"x-api-key": KEY_BETA},
        json={
            "model": VLLM_MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_sim_engine_refuses_structured_output_and_logprobs(stack):
    for fields, param in (
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n"),
    ):
        r = requests.post(
            stack.envoy_url + "/v1/chat/completions",
            timeout=30,
            headers={"x-api-key": KEY_BETA},
            json={"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "simulated engine cannot honour" in err["message"]
    assert wait_until(lambda: worker_row(stack, "sim-0")["reserved_tokens"] == 0)


def test_ledger_back_to_zero_after_n_streams_are_cancelled_midway(stack):
    c = client(stack)
    streams = [
        c.completions.create(
            model=VLLM_MODEL, prompt=f"{PROMPT} {i}", max_tokens=1500, n=3, stream=True, extra_body={"ignore_eos": True}
        )
        for i in range(3)
    ]
    for s in streams:
        got = 0
        for _ in s:
            got += 1
            if got >= 4:
                break
    assert worker_row(stack, "vllm-0")["reserved_tokens"] > 0
    for s in streams:
        s.close()
    assert wait_until(lambda: worker_row(stack, "vllm-0")["reserved_tokens"] == 0, timeout=15)
    assert wait_until(lambda: worker_row(stack, "vllm-0")["running"] == 0, timeout=15)


def test_the_same_fields_over_zeromq(stack):
    with Client(stack.zmq_frontend, api_key=KEY_BETA) as zc:
        r = zc.complete(VLLM_MODEL, prompt=PROMPT, max_tokens=4, n=2, logprobs=2, ignore_eos=True, user="bob")
        assert len(r.texts) == 2 and r.finish_reasons == ["length", "length"] and r.completion_tokens == 8
        assert [len(x) for x in r.logprobs] == [4, 4] and all(len(top) == 2 for x in r.logprobs for _, _, top in x)
        r = zc.complete(VLLM_MODEL, prompt=PROMPT, max_tokens=200, seed=1, structured={"json": SCHEMA})
        jsonschema.validate(json.loads(r.text), SCHEMA)
        r = zc.complete(
            VLLM_MODEL, prompt=PROMPT, max_tokens=8, logit_bias={"7": 100}, stop_token_ids=[7], min_tokens=3
        )
        assert r.completion_tokens == 4 and r.finish_reason == "stop"
        r = zc.complete(VLLM_MODEL, prompt=PROMPT, max_tokens=2, echo=True)
        assert r.text.startswith(PROMPT)
        for kw, param in (
            ({"n": 2, "temperature": 0.0}, "n"),
            ({"logprobs": 21}, "params.logprobs"),
            ({"structured": {"json": {"type": "objectx"}}}, "response_format"),
            ({"logit_bias": {100000: 1.0}}, "logit_bias"),
        ):
            with pytest.raises(WeirError) as e:
                zc.complete(VLLM_MODEL, prompt=PROMPT, max_tokens=4, **kw)
            assert e.value.status == 400 and e.value.error.param == param, kw
    assert worker_row(stack, "vllm-0")["reserved_tokens"] == 0


def test_stop_reason_and_return_token_ids_as_vllm_gives_them(stack):
    c = client(stack)
    ids_body = {"return_token_ids": True, "ignore_eos": True}
    # return_token_ids: the prompt's ids as the router tokenized them; the generated ones are the text
    r = c.completions.create(model=VLLM_MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=ids_body)
    ch = r.choices[0].model_dump()
    assert ch["prompt_token_ids"] == TOK.encode(PROMPT).ids
    assert len(ch["token_ids"]) == r.usage.completion_tokens == 8
    assert TOK.decode(ch["token_ids"]) == ch["text"]
    assert ch["finish_reason"] == "length" and ch["stop_reason"] is None
    chunks = [
        x.choices[0].model_dump()
        for x in c.completions.create(
            model=VLLM_MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body=ids_body
        )
    ]
    assert chunks[0]["prompt_token_ids"] == ch["prompt_token_ids"]
    assert sum((x["token_ids"] for x in chunks), []) == ch["token_ids"]
    # chat: the rendered prompt's ids on the response (streamed: on the first chunk)
    msgs = [{"role": "user", "content": "Hello! How are you today?"}]
    w = c.chat.completions.create(model=VLLM_MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=ids_body)
    wd = w.model_dump()
    assert len(wd["prompt_token_ids"]) == w.usage.prompt_tokens and "How are you today?" in TOK.decode(
        wd["prompt_token_ids"]
    )
    assert TOK.decode(wd["choices"][0]["token_ids"]) == w.choices[0].message.content
    chunks = [
        x.model_dump()
        for x in c.chat.completions.create(
            model=VLLM_MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True, extra_body=ids_body
        )
    ]
    assert chunks[0]["prompt_token_ids"] == wd["prompt_token_ids"]
    assert sum((x["choices"][0].get("token_ids") or [] for x in chunks), []) == wd["choices"][0]["token_ids"]
    # stop_reason: the stop string that ended the choice (" fox" forced), whole and streamed
    forced = {
        "model": VLLM_MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "stop": ["zzz", "fox"],
        "logit_bias": {str(TOK.token_to_id("Ġfox")): 100},
    }
    r = c.completions.create(**forced)
    assert (r.choices[0].finish_reason, r.choices[0].model_dump()["stop_reason"]) == ("stop", "fox")
    last = list(c.completions.create(**forced, stream=True))[-1].choices[0].model_dump()
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "fox")
    # ... or the stop token id (an int), on chat
    forced = {
        "model": VLLM_MODEL,
        "messages": msgs,
        "max_tokens": 8,
        "logit_bias": {"7": 100},
        "extra_body": {"stop_token_ids": [7], "min_tokens": 2},
    }
    w = c.chat.completions.create(**forced)
    assert (w.choices[0].finish_reason, w.choices[0].model_dump()["stop_reason"]) == ("stop", 7)
    last = list(c.chat.completions.create(**forced, stream=True))[-1].choices[0].model_dump()
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", 7)
    assert worker_row(stack, "vllm-0")["reserved_tokens"] == 0
