"""Every completions prompt form and /tokenize, /detokenize through Envoy with
the openai SDK, on the real vLLM worker (the session ``stack``): a list of
prompts is one job per prompt -- numbered as vLLM numbers them, usage
summed, cancelled together, refused together without leaking a reservation.
"""

from __future__ import annotations

import json
import socket

import openai
import requests
from stackutil import KEY_ALPHA, KEY_BETA, LONG_STREAM_TOKENS, STACK_VLLM_MAX_LEN, VLLM_MODEL
from test_e2e_api import sdk, wait_until, worker_row

PROMPTS = ["The river runs", "A mountain stands", "In the city"]


def _tokenize(stack, **body) -> dict:
    r = requests.post(
        stack.envoy_url + "/tokenize",
        json={"model": VLLM_MODEL, **body},
        headers={"authorization": f"Bearer {KEY_ALPHA}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_list_of_prompts_is_one_choice_per_prompt_with_usage_summed(stack):
    client = sdk(stack)
    alone = [client.completions.create(model=VLLM_MODEL, prompt=p, max_tokens=6, temperature=0) for p in PROMPTS]
    together = client.completions.create(model=VLLM_MODEL, prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_token_id_prompts_answer_as_their_text_does(stack):
    ids = _tokenize(stack, prompt=PROMPTS[0])["tokens"]
    client = sdk(stack)
    by_text = client.completions.create(model=VLLM_MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=VLLM_MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    lists = client.completions.create(model=VLLM_MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0, n=1)
    assert [c.index for c in lists.choices] == [0, 1]
    assert lists.usage.prompt_tokens == len(ids) + 3


def test_streamed_prompt_list_numbers_choices_prompt_times_n(stack):
    stream = sdk(stack).completions.create(
        model=VLLM_MODEL,
        prompt=PROMPTS[:2],
        max_tokens=5,
        n=2,
        temperature=0.8,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finished = set()
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert finished == {0, 1, 2, 3}  # prompt i's choice j is i * n + j
    assert usage is not None and usage.completion_tokens == 4 * 5


def test_leaving_a_prompt_list_stream_cancels_every_prompt(stack):
    before = worker_row(stack, "vllm-0")["aborts"]
    body = json.dumps({"model": VLLM_MODEL, "prompt": PROMPTS, "max_tokens": LONG_STREAM_TOKENS,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    host, port = stack.envoy_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + KEY_BETA.encode() + b"\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        got = b""
        while got.count(b"data: ") < 6:  # every prompt's stream is flowing
            got += s.recv(65536)
    assert wait_until(lambda: worker_row(stack, "vllm-0")["aborts"] >= before + len(PROMPTS), timeout=15)
    assert wait_until(lambda: worker_row(stack, "vllm-0")["reserved_tokens"] == 0, timeout=15)


def test_a_prompt_refused_refuses_the_list_and_leaks_nothing(stack):
    client = sdk(stack)
    too_long = [1] + [50] * (STACK_VLLM_MAX_LEN + 10)
    try:
        client.completions.create(model=VLLM_MODEL, prompt=[[1, 50, 60], too_long], max_tokens=4)
    except openai.BadRequestError as e:
        assert e.body["param"] in ("prompt", "max_tokens"), e.body
    else:
        raise AssertionError("a prompt longer than the context was served")
    # the first prompt, admitted before the second was refused, was cancelled: nothing stays reserved
    assert wait_until(lambda: worker_row(stack, "vllm-0")["reserved_tokens"] == 0, timeout=15)
    for bad, param in (([1, 10**9], "prompt"), (["x"] * 129, "prompt"), ([[1], []], "prompt")):
        try:
            client.completions.create(model=VLLM_MODEL, prompt=bad, max_tokens=2)
        except openai.BadRequestError as e:
            assert e.body["param"] == param, e.body
        else:
            raise AssertionError(f"{str(bad)[:40]} was served")


def test_tokenize_and_detokenize_through_envoy(stack):
    got = _tokenize(stack, prompt="Hello, world", return_token_strs=True)
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) and got["max_model_len"] == STACK_VLLM_MAX_LEN
    chat = _tokenize(stack, messages=[{"role": "user", "content": "Hi"}])
    done = sdk(stack).chat.completions.create(
        model=VLLM_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert chat["count"] == done.usage.prompt_tokens  # the same ids a chat request sends
    # ... with the chat-template fields too: a final assistant message continued
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    continued = _tokenize(stack, messages=prefill, **fields)
    done = sdk(stack).chat.completions.create(model=VLLM_MODEL, messages=prefill, max_tokens=1, extra_body=fields)
    assert continued["count"] == done.usage.prompt_tokens != chat["count"]
    own_template = {"model": VLLM_MODEL, "messages": prefill, "chat_template": "{{ messages }}"}
    auth = {"authorization": f"Bearer {KEY_ALPHA}"}
    r = requests.post(stack.envoy_url + "/tokenize", json=own_template, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    plain = _tokenize(stack, prompt="Hello, world", add_special_tokens=False)["tokens"]
    r = requests.post(stack.envoy_url + "/detokenize", json={"model": VLLM_MODEL, "tokens": plain},
                      headers={"authorization": f"Bearer {KEY_ALPHA}"}, timeout=30)  # fmt: skip
    assert r.status_code == 200 and r.json() == {"prompt": "Hello, world"}
    # Envoy's key check applies as to /v1/
    assert requests.post(stack.envoy_url + "/tokenize", json={"model": VLLM_MODEL, "prompt": "x"},
                         timeout=30).status_code == 401  # fmt: skip
