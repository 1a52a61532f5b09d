"""vLLM's extra response fields: ``stop_reason`` and ``return_token_ids``
(``prompt_token_ids`` / ``token_ids``), parsed, carried in Deltas and
rendered as vLLM 0.32's server renders them -- whole and streamed."""

from __future__ import annotations

import json

import msgspec
from fakes import FakeSink
from openai._streaming import SSEDecoder
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from router import api
from router.lifecycle.jobs import JobRecord
from router.tenancy.identity import Identity
from shared import protocol as p
from shared.protocol import Delta, RequestKind

NO_META = api.RequestMeta()
PROMPT = [1, 415, 2936]


def _ctx(kind=RequestKind.COMPLETION, stream=True, n=1, ids=False) -> api.ResponseContext:
    prefix = "cmpl-" if kind == RequestKind.COMPLETION else "chatcmpl-"
    ctx = api.ResponseContext(prefix + "x1", kind, "tiny", 1700000000, stream, False, n)
    ctx.return_token_ids = ids
    return ctx


def _events(data: bytes) -> list[dict]:
    events = [e.data for e in SSEDecoder().iter_bytes(iter([data]))]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------ parsing


def test_chat_return_token_ids_is_honoured_not_refused():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True})
    sub, ctx = api.parse_chat(body.encode(), NO_META, "r1")
    assert sub.return_token_ids and ctx.return_token_ids and ctx.rich
    sub, ctx = api.parse_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', NO_META, "r1")
    assert not sub.return_token_ids and not ctx.rich  # the plain path stays plain


def test_completion_return_token_ids_drops_the_echoed_text_as_vllm():
    body = json.dumps({"model": "m", "prompt": "hi there", "echo": True, "return_token_ids": True})
    sub, ctx = api.parse_completion(body.encode(), NO_META, "r1")
    assert sub.return_token_ids and ctx.return_token_ids and ctx.echo == ""
    _, ctx = api.parse_completion(b'{"model": "m", "prompt": "hi there", "echo": true}', NO_META, "r1")
    assert ctx.echo == "hi there" and not ctx.return_token_ids


def test_delta_and_submit_fields_round_trip_and_old_messages_still_decode():
    for reason in ("\n", 13, None):
        d = Delta("r", "x", 1, finish_reason="stop", stop_reason=reason, prompt_token_ids=PROMPT)
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=Delta)
        assert back.stop_reason == reason and back.prompt_token_ids == PROMPT
    old = msgspec.msgpack.encode(Delta("r", "x", 1, finish_reason="stop"))
    assert msgspec.msgpack.decode(old, type=Delta).stop_reason is None  # (defaults: nothing on the wire)
    sub = p.Submit("c", "m", prompt="x", return_token_ids=True)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sub), type=p.Submit).return_token_ids


def test_job_sends_the_prompt_ids_once_on_its_first_news_when_asked():
    for asked in (True, False):
        j = JobRecord("1", p.Submit("c", "m", prompt="x", return_token_ids=asked), FakeSink(), Identity("t", "n", 1), 0)
        j.prompt_ids = PROMPT
        first, second = [Delta("1", "a", 1, token_ids=[5])], [Delta("1", "b", 1, token_ids=[6])]
        j.as_one_stream(first)
        j.as_one_stream(second)
        assert first[0].prompt_token_ids == (PROMPT if asked else [])
        assert second[0].prompt_token_ids == []


# ------------------------------------------------------------------ whole responses


def test_plain_completion_carries_the_stop_string():
    body = api.render_completion(_ctx(stream=False), "Paris", "stop", 3, 2, stop_reason="\n")
    obj = json.loads(body)
    assert obj["choices"][0]["stop_reason"] == "\n"
    assert obj["choices"][0]["token_ids"] is None and obj["choices"][0]["prompt_token_ids"] is None
    Completion.model_validate(obj)
    body = api.render_completion(_ctx(RequestKind.CHAT, stream=False), "hi", "stop", 3, 1, stop_reason=2)
    assert json.loads(body)["choices"][0]["stop_reason"] == 2


def test_accumulated_completion_token_ids_and_stop_reasons_per_choice():
    acc = api.Accumulator(_ctx(stream=False, n=2, ids=True))
    acc.add(
        [
            Delta("x1", "a", 1, prompt_tokens=3, token_ids=[10], prompt_token_ids=PROMPT),
            Delta("x1", "b", 1, token_ids=[20], index=1),
        ]
    )
    acc.add([Delta("x1", "c", 1, token_ids=[11], choice_finish="stop", stop_reason="END")])
    acc.add([Delta("x1", "d", 1, token_ids=[21], index=1, finish_reason="length", completion_tokens=4)])
    obj = json.loads(acc.render())
    c0, c1 = obj["choices"]
    assert (c0["text"], c0["token_ids"], c0["prompt_token_ids"], c0["finish_reason"], c0["stop_reason"]) == (
        "ac",
        [10, 11],
        PROMPT,
        "stop",
        "END",
    )
    assert (c1["text"], c1["token_ids"], c1["prompt_token_ids"], c1["finish_reason"], c1["stop_reason"]) == (
        "bd",
        [20, 21],
        PROMPT,
        "length",
        None,
    )
    Completion.model_validate(obj)


def test_accumulated_chat_puts_the_prompt_ids_on_the_response():
    acc = api.Accumulator(_ctx(RequestKind.CHAT, stream=False, ids=True))
    acc.add([Delta("x1", "Hi", 1, prompt_tokens=3, token_ids=[7], prompt_token_ids=PROMPT)])
    acc.add([Delta("x1", "", 1, token_ids=[2], finish_reason="stop", stop_reason=2, completion_tokens=2)])
    obj = json.loads(acc.render())
    assert obj["prompt_token_ids"] == PROMPT
    assert obj["choices"][0]["token_ids"] == [7, 2] and obj["choices"][0]["stop_reason"] == 2
    ChatCompletion.model_validate(obj)
    plain = json.loads(api.Accumulator(_ctx(RequestKind.CHAT, stream=False, n=2)).render())
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


# ------------------------------------------------------------------ streams


def test_plain_streams_end_with_the_stop_reason():
    r = api.StreamRenderer(_ctx())
    chunks = _events(
        r.render([Delta("x1", "Par", 1, prompt_tokens=3)])
        + r.render([Delta("x1", "is", 1, finish_reason="stop", stop_reason="\n", completion_tokens=2)])
    )
    assert [c["choices"][0]["stop_reason"] for c in chunks] == [None, "\n"]  # vLLM: on every completions chunk
    r = api.StreamRenderer(_ctx(RequestKind.CHAT))
    chunks = _events(
        r.render([Delta("x1", "Hi", 1, prompt_tokens=3)])
        + r.render([Delta("x1", "", 1, finish_reason="stop", stop_reason=2, completion_tokens=2)])
    )
    assert ["stop_reason" in c["choices"][0] for c in chunks] == [False, False, False, True]  # chat: the last
    assert chunks[-1]["choices"][0]["stop_reason"] == 2 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    for c in chunks:
        ChatCompletionChunk.model_validate(c)


def test_streamed_completion_token_ids_add_up():
    r = api.StreamRenderer(_ctx(ids=True))
    out = r.render([Delta("x1", "a", 1, prompt_tokens=3, token_ids=[10], prompt_token_ids=PROMPT)])
    out += r.render([Delta("x1", "b", 2, token_ids=[11, 12], completion_tokens=3)])
    out += r.render([Delta("x1", "", 1, token_ids=[13], finish_reason="stop", stop_reason=13, completion_tokens=4)])
    choices = [c["choices"][0] for c in _events(out)]
    assert choices[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in c for c in choices[1:])
    assert sum((c["token_ids"] for c in choices), []) == [10, 11, 12, 13]
    assert "".join(c["text"] for c in choices) == "ab"
    assert [c["stop_reason"] for c in choices] == [None, None, 13]


def test_streamed_chat_token_ids_and_prompt_ids_on_the_role_chunk():
    r = api.StreamRenderer(_ctx(RequestKind.CHAT, ids=True))
    out = r.render([Delta("x1", "Hi", 1, prompt_tokens=3, token_ids=[7], prompt_token_ids=PROMPT)])
    out += r.render([Delta("x1", " you", 1, token_ids=[8], finish_reason="stop", stop_reason="!", completion_tokens=2)])
    chunks = _events(out)
    assert chunks[0]["prompt_token_ids"] == PROMPT and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == [7, 8]
    assert chunks[-1]["choices"][0]["stop_reason"] == "!" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    for c in chunks:
        ChatCompletionChunk.model_validate(c)


def test_streamed_tool_calls_carry_every_token_id_and_the_stop_reason():
    from test_tools import _spec  # the tools fixture of the tool-calling tests

    ctx = _ctx(RequestKind.CHAT, ids=True)
    ctx.tools = _spec("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    r = api.StreamRenderer(ctx)
    out = r.render([Delta("1", text[:10], 3, token_ids=[1, 2, 3], prompt_token_ids=PROMPT)])
    out += r.render([Delta("1", text[10:], 2, token_ids=[4, 5], finish_reason="stop", stop_reason="]")])
    chunks = _events(out)
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert sum((c["choices"][0].get("token_ids") or [] for c in chunks), []) == [1, 2, 3, 4, 5]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1]["choices"][0]["stop_reason"] == "]"
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
