"""router.api: request validation -> Submit, and response rendering as
the openai SDK parses it (its own SSE decoder and pydantic response types)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from router import api
from router.api.context import system_fingerprint
from shared.protocol import Delta, ErrorInfo, RequestKind, TaskType

NO_META = api.RequestMeta()


def _completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def _chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _refusal(parse, body: bytes, meta=NO_META) -> ErrorInfo:
    with pytest.raises(api.RequestError) as e:
        parse(body, meta, "r1")
    return e.value.info


# ------------------------------------------------------------------ validation

BAD_COMPLETIONS = [
    # (body, param, code)
    (b"", None, None),
    (b"{not json", None, None),
    (b"[1, 2]", None, None),
    (b'{"prompt": "hi"}', "model", None),
    (b'{"model": "m"}', "prompt", None),
    (_completion(model=3), "model", None),
    (_completion(prompt=None), "prompt", None),
    (_completion(prompt=[]), "prompt", None),
    (_completion(prompt=[1, "a"]), "prompt", None),
    (_completion(prompt=["a", 1]), "prompt", None),
    (_completion(prompt=[[1], []]), "prompt", None),
    (_completion(prompt=[[1], 2]), "prompt", None),
    (_completion(prompt=[-1]), "prompt", None),
    (_completion(prompt=[True]), "prompt", None),
    (_completion(prompt=[1.5]), "prompt", None),
    (_completion(prompt=[{"a": 1}]), "prompt", None),
    (_completion(prompt=["a"] * 129), "prompt", None),  # over router.max_prompts_per_request's default
    (_completion(max_tokens=0), "max_tokens", None),
    (_completion(max_tokens=-5), "max_tokens", None),
    (_completion(max_tokens="10"), "max_tokens", None),
    (_completion(max_tokens=1.5), "max_tokens", None),
    (_completion(temperature=2.5), "temperature", None),
    (_completion(temperature=-0.1), "temperature", None),
    (_completion(temperature="hot"), "temperature", None),
    (_completion(top_p=0), "top_p", None),
    (_completion(top_p=1.01), "top_p", None),
    (_completion(n=0), "n", None),
    (_completion(n=129), "n", None),
    (_completion(n=2, temperature=0), "n", None),  # vLLM: "n must be 1 when using greedy sampling"
    (_completion(n="1"), "n", None),
    (_completion(stream="yes"), "stream", None),
    (_completion(stream_options={"include_usage": True}), "stream_options", None),
    (_completion(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage", None),
    (_completion(stop=["a", "b", "c", "d", "e"]), "stop", None),
    (_completion(stop=7), "stop", None),
    (_completion(stop=["a", 1]), "stop[1]", None),
    (_completion(seed="x"), "seed", None),
    (_completion(user=5), "user", None),
    (_completion(priority=True), "priority", None),  # a class name or vLLM's integer
    (_completion(task_type="medium"), "task_type", None),
    (_completion(suffix="tail"), "suffix", "unsupported_value"),
    (_completion(logprobs=21), "logprobs", None),
    (_completion(logprobs=-1), "logprobs", None),
    (_completion(top_k=-2), "top_k", None),
    (_completion(min_p=1.5), "min_p", None),
    (_completion(repetition_penalty=0), "repetition_penalty", None),
    (_completion(min_tokens=-1), "min_tokens", None),
    (_completion(stop_token_ids=[-1]), "stop_token_ids[0]", None),
    (_completion(stop_token_ids=list(range(65))), "stop_token_ids", None),
    (_completion(logit_bias={"5": 101}), "logit_bias", None),
    (_completion(logit_bias={"x": 1}), "logit_bias", None),
    (_completion(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", None),
    (_completion(user="u" * 257), "user", None),
    (_completion(response_format={"type": "json_schema"}), "response_format.json_schema", None),
    (_completion(response_format={"type": "structural_tag"}), "response_format.type", "unsupported_value"),
    (_completion(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex", None),
    (_completion(prompt=""), "prompt", None),
    (_completion(prompt=[""]), "prompt", None),
    (_completion(presence_penalty=2.5), "presence_penalty", None),
    (_completion(frequency_penalty=-3), "frequency_penalty", None),
    (_completion(frequency_penalty="high"), "frequency_penalty", None),
]


@pytest.mark.parametrize("body,param,code", BAD_COMPLETIONS)
def test_completion_validation_errors(body, param, code):
    info = _refusal(api.parse_completion, body)
    assert info.status == 400
    assert info.type == "invalid_request_error"
    assert info.param == param
    assert info.code == code
    assert info.message


TOOL_F = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BAD_CHATS = [
    (b'{"model": "m"}', "messages", None),
    (_chat(messages=[]), "messages", None),
    (_chat(messages="hi"), "messages", None),
    (_chat(messages=[{"content": "x"}]), "messages[0].role", None),
    (_chat(messages=[{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}]), "messages[1].role", None),
    (_chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", None),
    (_chat(messages=[{"role": "user"}]), "messages[0].content", None),
    (_chat(messages=[{"role": "user", "content": None}]), "messages[0].content", None),
    (
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages[0].content[0]",
        "unsupported_value",
    ),
    (_chat(messages=[{"role": "user", "content": [{"text": "no type"}]}]), "messages[0].content[0].type", None),
    (_chat(max_completion_tokens=0), "max_completion_tokens", None),
    (_chat(max_tokens=0), "max_tokens", None),
    (_chat(temperature=3), "temperature", None),
    (_chat(n=3, temperature=0.0), "n", None),
    (_chat(top_logprobs=2), "top_logprobs", None),  # needs logprobs: true
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs", None),
    (_chat(logprobs=3), "logprobs", None),
    (_chat(tools=[]), "tools", None),
    (_chat(tool_choice="required"), "tool_choice", None),  # tool_choice without tools
    (_chat(tools=TOOL_F, tool_choice="sometimes"), "tool_choice", None),
    (_chat(tools=TOOL_F, tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", None),
    (_chat(tools=TOOL_F, tool_choice={"type": "function", "function": {}}), "tool_choice.function.name", None),
    (_chat(tools=[{"type": "function"}]), "tools[0].function", None),
    (
        _chat(tools=TOOL_F, tool_choice={"type": "function", "function": {"name": "f"}}, guided_regex="a+"),
        "tool_choice",
        None,
    ),
    (
        _chat(
            messages=[{"role": "user", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}],
            tools=TOOL_F,
        ),
        "messages[0].tool_calls",
        None,
    ),
    (_chat(add_generation_prompt=True, continue_final_message=True), "continue_final_message", None),
    (_chat(chat_template="{{ messages }}"), "chat_template", None),
    (_chat(chat_template_kwargs={"chat_template": "x"}), "chat_template", None),
    (_chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs", None),
    (_chat(echo=True), "echo", "unsupported_value"),
    (_chat(skip_special_tokens=False), "skip_special_tokens", "unsupported_value"),
    (_chat(use_beam_search=True), "use_beam_search", "unsupported_value"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema", None),
    (_chat(stream_options={"include_usage": True}), "stream_options", None),
]


@pytest.mark.parametrize("body,param,code", BAD_CHATS)
def test_chat_validation_errors(body, param, code):
    info = _refusal(api.parse_chat, body)
    assert (info.status, info.type, info.param, info.code) == (400, "invalid_request_error", param, code)


def test_malformed_json_says_so():
    info = _refusal(api.parse_completion, b'{"model": "m", "prompt": ')
    assert info.message.startswith("Malformed JSON")
    assert "type" in api.encode(api.ErrorEnvelope(api.ErrorBody("x", "t", None, None))).decode()


def test_bad_task_type_header_names_the_header():
    meta = api.meta_from_headers(None, None, None, "huge")
    assert _refusal(api.parse_completion, _completion(), meta).param == "x-weir-task-type"


# ------------------------------------------------------------------ conversion to Submit


def test_completion_to_submit_defaults():
    sub, ctx = api.parse_completion(_completion(), NO_META, "abc")
    assert sub.request_id == "abc" and sub.model == "m" and sub.prompt == "hi"
    assert sub.kind == RequestKind.COMPLETION and sub.messages == []
    assert sub.max_tokens == api.DEFAULT_COMPLETION_MAX_TOKENS  # OpenAI's legacy default
    assert sub.params is None  # no sampling field given: the engine's defaults
    assert sub.task_type == TaskType.AUTO and sub.priority is None and sub.api_key is None
    assert (ctx.id, ctx.kind, ctx.model, ctx.stream, ctx.include_usage) == (
        "cmpl-abc",
        RequestKind.COMPLETION,
        "m",
        False,
        False,
    )


def test_completion_sampling_fields_and_extensions():
    body = _completion(
        prompt=["only one"],
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        seed=42,
        stop="\n",
        stream=True,
        stream_options={"include_usage": True},
        priority="low",
        task_type="long",
        user="u1",
        logit_bias={},
        some_future_field={"x": 1},
        n=1,
        best_of=1,
        echo=False,
    )
    sub, ctx = api.parse_completion(body, NO_META, "r")
    assert sub.prompt == "only one" and sub.max_tokens == 7
    p = sub.params
    assert (p.temperature, p.top_p, p.seed, p.stop) == (0.0, 0.5, 42, ["\n"])
    assert sub.priority == "low" and sub.task_type == TaskType.LONG
    assert ctx.stream and ctx.include_usage


def test_deeply_nested_json_is_a_400_not_a_crash():
    body = b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    info = _refusal(api.parse_completion, body)
    assert info.status == 400 and "nested too deeply" in info.message
    info = _refusal(api.parse_chat, body)
    assert info.status == 400


def test_penalties_pass_through_and_zero_means_default():
    sub, _ = api.parse_completion(_completion(presence_penalty=0.5, frequency_penalty=-2), NO_META, "r")
    assert (sub.params.presence_penalty, sub.params.frequency_penalty) == (0.5, -2.0)
    assert sub.params.temperature == 1.0  # the rest stays at the engine's defaults
    sub, _ = api.parse_completion(_completion(presence_penalty=0, frequency_penalty=0.0), NO_META, "r")
    assert sub.params is None  # what SDKs send by default changes nothing


def test_stop_list_and_partial_sampling_defaults():
    sub, _ = api.parse_completion(_completion(stop=["a", "b", "c", "d"], temperature=None), NO_META, "r")
    assert sub.params.stop == ["a", "b", "c", "d"]
    assert (sub.params.temperature, sub.params.top_p, sub.params.seed) == (1.0, 1.0, None)


def test_chat_to_submit():
    body = _chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": "42", "tool_call_id": "t1"},
        ],
        max_tokens=9,
        max_completion_tokens=5,
    )
    sub, ctx = api.parse_chat(body, NO_META, "q")
    assert sub.kind == RequestKind.CHAT and sub.prompt == ""
    assert [(m.role, m.content) for m in sub.messages] == [
        ("system", "be brief"),
        ("user", "a\nb"),
        ("assistant", "ok"),
        ("tool", "42"),
    ]
    assert sub.max_tokens == 5  # max_completion_tokens wins
    assert ctx.id == "chatcmpl-q" and ctx.kind == RequestKind.CHAT


def test_chat_max_tokens_default_is_rest_of_context():
    sub, _ = api.parse_chat(_chat(), NO_META, "q")
    assert sub.max_tokens is None
    sub, _ = api.parse_chat(_chat(max_tokens=3), NO_META, "q")
    assert sub.max_tokens == 3


@pytest.mark.parametrize(
    "auth,xkey,expected",
    [
        ("Bearer sk-1", None, "sk-1"),
        ("bearer  sk-2 ", None, "sk-2"),
        ("Basic abc", None, None),
        ("Bearer ", None, None),
        (None, "k-3", "k-3"),
        ("Bearer sk-1", "k-3", "k-3"),  # the header Envoy rate-limits on wins
        (None, None, None),
    ],
)
def test_api_key_from_headers(auth, xkey, expected):
    sub, _ = api.parse_completion(_completion(), api.meta_from_headers(auth, xkey), "r")
    assert sub.api_key == expected


def test_priority_and_task_type_headers_with_body_precedence():
    meta = api.meta_from_headers(None, None, "batch", "Short")
    sub, _ = api.parse_chat(_chat(), meta, "r")
    assert sub.priority == "batch" and sub.task_type == TaskType.SHORT
    sub, _ = api.parse_chat(_chat(priority="low", task_type="long"), meta, "r")
    assert sub.priority == "low" and sub.task_type == TaskType.LONG


def test_request_ids_are_unique():
    ids = {api.new_request_id() for _ in range(1000)}
    assert len(ids) == 1000


# ------------------------------------------------------------------ rendering


FP = system_fingerprint("tiny")


def _ctx(kind=RequestKind.COMPLETION, stream=True, include_usage=False, model="tiny"):
    prefix = "cmpl-" if kind == RequestKind.COMPLETION else "chatcmpl-"
    return api.ResponseContext(prefix + "x1", kind, model, 1700000000, stream, include_usage)


def _sse(data: bytes) -> list[str]:
    """Events as the openai SDK's own decoder yields them, fed in awkward pieces."""
    pieces = [data[i : i + 7] for i in range(0, len(data), 7)]
    return [e.data for e in SSEDecoder().iter_bytes(iter(pieces))]


def _choice_text(event: str) -> str:
    choice = json.loads(event)["choices"][0]
    return choice["text"] if "text" in choice else (choice["delta"].get("content") or "")


def test_non_stream_completion_shape():
    body = api.render_completion(_ctx(stream=False), "hello world", "length", 3, 2)
    obj = json.loads(body)
    assert obj == {
        "id": "cmpl-x1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "hello world",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "system_fingerprint": FP,
    }
    parsed = Completion.model_validate(obj)
    assert parsed.choices[0].text == "hello world" and parsed.usage.total_tokens == 5


def test_non_stream_chat_shape():
    body = api.render_completion(_ctx(RequestKind.CHAT, stream=False), "hi", "stop", 10, 1)
    obj = json.loads(body)
    assert obj["object"] == "chat.completion" and obj["id"] == "chatcmpl-x1"
    assert obj["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
        }
    ]
    assert obj["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    parsed = ChatCompletion.model_validate(obj)
    assert parsed.choices[0].message.content == "hi"


def test_completion_stream_events():
    r = api.StreamRenderer(_ctx())
    first = r.render(
        [Delta("x1", "Hel", 1, prompt_tokens=4, completion_tokens=1), Delta("x1", "lo", 1, completion_tokens=2)]
    )
    assert not r.finished
    last = r.render([Delta("x1", "!", 1, finish_reason="stop", prompt_tokens=4, completion_tokens=3)])
    assert r.finished
    events = _sse(first + last)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks == [
        {
            "id": "cmpl-x1",
            "object": "text_completion",
            "created": 1700000000,
            "model": "tiny",
            "system_fingerprint": FP,
            "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None, "stop_reason": None}],
        },
        {
            "id": "cmpl-x1",
            "object": "text_completion",
            "created": 1700000000,
            "model": "tiny",
            "system_fingerprint": FP,
            "choices": [{"index": 0, "text": "!", "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
        },
    ]
    # The SDK builds stream chunks without validation (its Completion type insists on a
    # finish_reason, which OpenAI's own mid-stream chunks lack); the final one validates.
    assert Completion.model_validate(chunks[-1]).choices[0].finish_reason == "stop"
    assert first.count(b"\n\n") == 1 and first.startswith(b"data: {")  # one batch -> one event


def test_chat_stream_events_with_usage():
    r = api.StreamRenderer(_ctx(RequestKind.CHAT, include_usage=True))
    out = r.render([Delta("x1", "", 0, prompt_tokens=5)])
    out += r.render([Delta("x1", "Hi", 1, completion_tokens=1), Delta("x1", " there", 1, completion_tokens=2)])
    out += r.render([Delta("x1", "", 0, finish_reason="length", prompt_tokens=5, completion_tokens=2)])
    events = _sse(out)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    assert [c.object for c in chunks] == ["chat.completion.chunk"] * 4
    role, content, finish, usage = chunks
    assert role.choices[0].delta.role == "assistant" and role.choices[0].delta.content == ""
    assert content.choices[0].delta.content == "Hi there" and content.choices[0].finish_reason is None
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].delta.content is None
    u = usage.usage.model_dump()
    assert usage.choices == [] and u["prompt_tokens_details"]["cached_tokens"] == 0
    assert {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details")} == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "completion_tokens_details": None,
    }
    # include_usage: every other chunk says "usage": null, as OpenAI does
    assert all(json.loads(e)["usage"] is None for e in events[:3])


def test_stream_batch_without_news_renders_nothing():
    r = api.StreamRenderer(_ctx())
    assert r.render([Delta("x1", "", 0, prompt_tokens=3)]) == b""
    r = api.StreamRenderer(_ctx(RequestKind.CHAT))
    assert r.render([Delta("x1", "a", 1)]) != b""
    assert r.render([Delta("x1", "", 0)]) == b""


@pytest.mark.parametrize("kind", [RequestKind.COMPLETION, RequestKind.CHAT])
def test_stream_error_after_start_is_an_sse_error_event(kind):
    r = api.StreamRenderer(_ctx(kind, include_usage=True))
    out = r.render([Delta("x1", "partial", 1)])
    err = ErrorInfo(503, "worker lost", type="server_error", code="worker_lost")
    out += r.render([Delta("x1", " more", 1), Delta("x1", error=err)])
    assert r.finished
    events = _sse(out)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {
        "error": {"message": "worker lost", "type": "server_error", "param": None, "code": "worker_lost"}
    }
    assert "".join(_choice_text(e) for e in events[:-2]) == "partial more"
    # no usage chunk and no finish_reason after an error
    assert all(
        json.loads(e).get("choices") and json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2]
    )


def test_usage_falls_back_to_counting_num_tokens():
    r = api.StreamRenderer(_ctx(include_usage=True))
    out = r.render([Delta("x1", "a", 2), Delta("x1", "b", 3, finish_reason="stop", prompt_tokens=7)])
    usage = json.loads(_sse(out)[-2])["usage"]
    assert usage == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_error_body_shape():
    info = ErrorInfo(429, "queue full", type="rate_limit_error", code="queue_full", retry_after=1.2)
    assert json.loads(api.error_body(info)) == {
        "error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }


def test_models_listing():
    obj = json.loads(api.render_models([("tiny", 512, 0, "loading"), ("sim-a", 4096, 2, "ready")], 5))
    assert obj["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in obj["data"]] == [
        ("tiny", "model", 512),
        ("sim-a", "model", 4096),
    ]
    assert [m["ready_workers"] for m in obj["data"]] == [0, 2]
    assert [m["state"] for m in obj["data"]] == ["loading", "ready"]


@settings(max_examples=200, deadline=None)
@given(text=st.text(), model=st.text(min_size=1), kind=st.sampled_from(list(RequestKind)))
def test_template_events_roundtrip_any_text(text, model, kind):
    """The byte templates are JSON-safe for any text and model name, and equal
    what a plain JSON encoder produces."""
    r = api.StreamRenderer(_ctx(kind, model=model))
    out = r.render([Delta("x1", text, 1, finish_reason="stop")])
    events = _sse(out)
    assert events[-1] == "[DONE]"
    assert "".join(_choice_text(e) for e in events[:-1]) == text
    assert all(json.loads(e)["model"] == model for e in events[:-1])
    # byte-identical to encoding the same object with msgspec (no stray spaces/escapes)
    for e in events[:-1]:
        assert e.encode() == msgspec.json.encode(json.loads(e))


# ------------------------------------------------------------------ issue 13: n, logprobs, structured, extras

from openai.types.chat import ChatCompletionChunk as _Chunk  # noqa: E402

from shared.protocol import StructuredOutput, pack_logprobs  # noqa: E402


def test_extras_become_wire_params():
    sub, ctx = api.parse_completion(
        _completion(
            n=2,
            logprobs=3,
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.2,
            min_tokens=2,
            stop_token_ids=[3, 4],
            logit_bias={"7": -100, "9": 2.5},
            user="alice",
            seed=1,
        ),
        NO_META,
        "r",
    )
    p = sub.params
    assert (p.n, p.logprobs, p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (2, 3, 5, 0.1, 1.2, 2)
    assert p.stop_token_ids == [3, 4] and p.logit_bias == {7: -100.0, 9: 2.5} and sub.user == "alice"
    assert (ctx.n, ctx.logprobs, ctx.echo, ctx.rich) == (2, 3, "", True)
    assert api.parse_completion(_completion(echo=True), NO_META, "r")[1].echo == "hi"
    sub, ctx = api.parse_chat(_chat(logprobs=True, top_logprobs=2), NO_META, "r")
    assert sub.params.logprobs == 2 and ctx.logprobs == 2
    sub, ctx = api.parse_chat(_chat(logprobs=True), NO_META, "r")
    assert sub.params.logprobs == 0
    sub, ctx = api.parse_chat(_chat(), NO_META, "r")
    assert sub.params is None and not ctx.rich  # the plain path stays plain
    sub, _ = api.parse_completion(_completion(top_k=-1, repetition_penalty=1.0, logit_bias={}), NO_META, "r")
    assert sub.params is None  # "off" values are the wire's defaults


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            StructuredOutput(json=json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput(regex="[0-9]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput(choice=["a", "b"])),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(json=json.dumps(SCHEMA))),
        ({"guided_grammar": 'root ::= "x"'}, StructuredOutput(grammar='root ::= "x"')),
    ],
)
def test_structured_output_fields_map_to_one_constraint(fields, expected):
    sub, _ = api.parse_chat(_chat(**fields), NO_META, "r")
    got = sub.params.structured if sub.params is not None else None
    if expected is not None and expected.json is not None:
        assert json.loads(got.json) == json.loads(expected.json)
    else:
        assert got == expected


class _Vocab:
    def __call__(self, tid):
        return {1: "a", 2: "b", 3: " c", 4: "ü"}.get(tid, f"<{tid}>")


def _lp_delta(ids, k, index=0, **kw):
    vals, tops = [], []
    for t in ids:
        vals.append(-0.5 * t)
        for j in range(k):
            tops.append(j + 1)
            vals.append(-0.1 * (j + 1))
    return Delta(
        "x1",
        "".join(_Vocab()(t) for t in ids),
        len(ids),
        token_ids=ids,
        index=index,
        logprobs=pack_logprobs(vals),
        top_ids=tops,
        **kw,
    )


def _rich_ctx(kind, n=1, logprobs=None, echo="", stream=True, include_usage=False):
    ctx = _ctx(kind, stream=stream, include_usage=include_usage)
    ctx.n, ctx.logprobs, ctx.echo, ctx.token_text = n, logprobs, echo, _Vocab()
    return ctx


def test_non_stream_n_and_logprobs_completion_parse_with_the_sdk():
    acc = api.Accumulator(_rich_ctx(RequestKind.COMPLETION, n=2, logprobs=2, stream=False))
    acc.add(
        [
            _lp_delta([1, 2], 2, prompt_tokens=5, completion_tokens=2),
            _lp_delta([3], 2, index=1, completion_tokens=3, choice_finish="stop"),
        ]
    )
    acc.add([_lp_delta([4], 2, completion_tokens=4, finish_reason="length")])
    obj = json.loads(acc.render())
    parsed = Completion.model_validate(obj)
    assert [c.index for c in parsed.choices] == [0, 1]
    assert [c.finish_reason for c in parsed.choices] == ["length", "stop"]
    assert parsed.choices[0].text == "abü" and parsed.usage.completion_tokens == 4
    lp = parsed.choices[0].logprobs
    assert lp.tokens == ["a", "b", "ü"] and lp.token_logprobs == [-0.5, -1.0, -2.0]
    assert lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs[0] == {"a": -0.5, "b": pytest.approx(-0.2)}  # sampled + top 2 (one shared)
    assert len(parsed.choices[1].logprobs.tokens) == 1


def test_non_stream_chat_logprobs_shape():
    acc = api.Accumulator(_rich_ctx(RequestKind.CHAT, logprobs=1, stream=False))
    acc.add([_lp_delta([4, 3], 1, prompt_tokens=5, completion_tokens=2, finish_reason="stop")])
    parsed = ChatCompletion.model_validate(json.loads(acc.render()))
    content = parsed.choices[0].logprobs.content
    assert [c.token for c in content] == ["ü", " c"] and content[0].bytes == list("ü".encode())
    assert [len(c.top_logprobs) for c in content] == [1, 1] and content[0].top_logprobs[0].token == "a"


def test_streamed_n_choices_and_logprobs_chat():
    r = api.StreamRenderer(_rich_ctx(RequestKind.CHAT, n=2, logprobs=0, include_usage=True))
    out = r.render(
        [_lp_delta([1], 0, prompt_tokens=3, completion_tokens=1), _lp_delta([2], 0, index=1, completion_tokens=2)]
    )
    out += r.render([_lp_delta([3], 0, index=1, completion_tokens=3, choice_finish="length")])
    out += r.render([_lp_delta([4], 0, completion_tokens=4, finish_reason="stop")])
    assert r.finished
    events = _sse(out)
    assert events[-1] == "[DONE]"
    chunks = [_Chunk.model_validate(json.loads(e)) for e in events[:-1]]
    text = {0: "", 1: ""}
    finish = {}
    tokens = {0: [], 1: []}
    for c in chunks[:-1]:
        (ch,) = c.choices
        text[ch.index] += ch.delta.content or ""
        if ch.logprobs is not None:
            tokens[ch.index] += [t.token for t in ch.logprobs.content]
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
    assert text == {0: "aü", 1: "b c"} and tokens == {0: ["a", "ü"], 1: ["b", " c"]}
    assert finish == {0: "stop", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == 3


def test_streamed_completion_echo_and_logprobs_offsets():
    r = api.StreamRenderer(_rich_ctx(RequestKind.COMPLETION, echo="Say: "))
    out = r.render([Delta("x1", "hi", 1, prompt_tokens=3, completion_tokens=1)])
    out += r.render([Delta("x1", "!", 1, completion_tokens=2, finish_reason="stop")])
    texts = [json.loads(e)["choices"][0]["text"] for e in _sse(out)[:-1]]
    assert "".join(texts) == "Say: hi!" and texts[0].startswith("Say: ")
    r = api.StreamRenderer(_rich_ctx(RequestKind.COMPLETION, logprobs=1))
    out = r.render([_lp_delta([3, 1], 1, prompt_tokens=3, completion_tokens=2)])
    out += r.render([_lp_delta([2], 1, completion_tokens=3, finish_reason="length")])
    lps = [json.loads(e)["choices"][0]["logprobs"] for e in _sse(out)[:-1]]
    assert [lp["text_offset"] for lp in lps] == [[0, 2], [3]]  # offsets run on across events
    assert [lp["tokens"] for lp in lps] == [[" c", "a"], ["b"]]


def test_plain_stream_is_unchanged_by_the_rich_path():
    """The hot path renders exactly what it did (index 0, logprobs null)."""
    r = api.StreamRenderer(_ctx())
    assert r._choices is None
    out = r.render([Delta("x1", "a", 1, prompt_tokens=1, completion_tokens=1)])
    assert out == (
        b'data: {"id":"cmpl-x1","object":"text_completion","created":1700000000,"model":"tiny",'
        b'"system_fingerprint":"' + FP.encode() + b'",'
        b'"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
    )


def _prompt_lp_delta(prompt, k, index=0):
    """A worker's first Delta with the prompt's logprobs (positions 1.. : own, top k)."""
    vals, tops = [], []
    for t in prompt[1:]:
        vals.append(-0.25 * t)
        for j in range(k):
            tops.append(j + 1)
            vals.append(-0.1 * (j + 1))
    return Delta("x1", index=index, prompt_logprobs=pack_logprobs(vals), prompt_top_ids=list(prompt) + tops)


def test_echo_with_logprobs_asks_the_engine_for_the_prompts():
    jobs = api.parse_completions(
        _completion(prompt=["x", "y"], echo=True, logprobs=2, n=2, temperature=1), api.RequestMeta(), "r"
    )
    assert all(s.params.prompt_logprobs == 2 for s in jobs.subs) and jobs.ctx.echo_logprobs == 2
    plain = api.parse_completions(_completion(prompt="x", logprobs=2), api.RequestMeta(), "r")
    assert plain.subs[0].params.prompt_logprobs is None and plain.ctx.echo_logprobs == 0
    with pytest.raises(api.RequestError) as e:  # vLLM's raw field: refused, never dropped
        api.parse_completions(_completion(prompt="x", prompt_logprobs=1), api.RequestMeta(), "r")
    assert e.value.info.param == "prompt_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_starts_each_choice_with_its_prompts(stream):
    """As vLLM: the prompt's tokens first (the first without a logprob), then
    the generated ones, offsets counted over both; both choices of prompt 1
    get prompt 1's (n = 2, two prompts: choices 2 and 3)."""
    ctx = _rich_ctx(RequestKind.COMPLETION, n=4, logprobs=1, echo="", stream=stream)
    ctx.echo_logprobs = 2
    first = [
        _prompt_lp_delta([2, 1], 1, index=2),
        _lp_delta([3], 1, index=2, prompt_tokens=2, completion_tokens=1),
        _lp_delta([4], 1, index=3, completion_tokens=2),
    ]
    last = [_lp_delta([1], 1, index=3, completion_tokens=3, finish_reason="stop")]
    if stream:
        r = api.StreamRenderer(ctx)
        chunks = [json.loads(e) for e in _sse(r.render(first) + r.render(last))[:-1]]
        lps: dict[int, dict] = {}
        for ch in (c for chunk in chunks for c in chunk["choices"]):
            if ch["logprobs"]:
                got = lps.setdefault(
                    ch["index"], {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                )
                for key in got:
                    got[key] += ch["logprobs"][key]
    else:
        acc = api.Accumulator(ctx)
        acc.add(first)
        acc.add(last)
        body = json.loads(acc.render())  # (the SDK's pydantic type has no None logprob; OpenAI and vLLM send one)
        lps = {c["index"]: c["logprobs"] for c in body["choices"] if c["logprobs"]["tokens"]}
    assert lps[2]["tokens"] == ["b", "a", " c"] and lps[2]["token_logprobs"] == [None, -0.25, -1.5]
    assert lps[2]["top_logprobs"][0] is None and lps[2]["top_logprobs"][1] == {"a": -0.25}
    assert lps[2]["text_offset"] == [0, 1, 2]
    assert lps[3]["tokens"] == ["b", "a", "ü", "a"] and lps[3]["text_offset"] == [0, 1, 2, 3]
