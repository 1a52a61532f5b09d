"""/v1/responses, the pure parts: a request's translation into its chat turn,
the refusals (with the Responses field in ``param``), the response object,
the streamed event sequence, and the in-memory store's bounds."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from router.api import RequestError
from router.api import responses as rs
from router.api.context import ResponseContext
from router.api.request import RequestMeta
from router.api.responses_stream import ResponsesAccumulator, ResponsesStream
from router.services.response_store import MemoryResponseStore, decode_record, encode_record
from shared.errors import Code, error
from shared.protocol import ChatMessage, Delta, RequestKind


def _req(**body) -> rs.ResponsesRequest:
    return rs.decode_responses(msgspec.json.encode({"model": "m", **body}))


def _turn(**body):
    return rs.build_turn(_req(**body), body.pop("_previous", None), RequestMeta(), "r1")


def test_a_turn_is_instructions_then_the_stored_conversation_then_the_input():
    previous = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    req = _req(
        input=[
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "three"}]},
        ],
        instructions="be brief",
        max_output_tokens=7,
        temperature=0.5,
    )
    sub, ctx, turn = rs.build_turn(req, previous, RequestMeta(), "r1")
    assert sub.kind == RequestKind.CHAT and sub.max_tokens == 7 and sub.params.temperature == 0.5
    assert sub.messages == [
        ChatMessage("system", "be brief"),
        ChatMessage("user", "one"),
        ChatMessage("assistant", "two"),
        ChatMessage("system", "rules"),
        ChatMessage("user", "three"),
    ]
    # what is stored for the next turn: no instructions (OpenAI does not carry them over)
    assert turn.history[0] == {"role": "user", "content": "one"} and len(turn.history) == 4
    assert ctx.id == turn.id and turn.id.startswith("resp_") and not ctx.stream


def test_function_call_items_become_one_assistant_turn_and_tool_messages():
    req = _req(
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"city":"A"}'},
            {"type": "function_call", "call_id": "c2", "name": "get", "arguments": '{"city":"B"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
    )
    msgs = rs.input_messages(req)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    out = [
        {"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"},
        {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
    ]
    assert rs.output_messages(out) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "assistant", "content": "hi"},
    ]


def test_function_tools_and_text_format_translate_to_chat_fields():
    req = _req(
        input="hi",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    )
    body = rs.chat_body(req, [])
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "background": True, "stream": True}, "background"),
        ({"input": "hi", "previous_response_id": ""}, "previous_response_id"),
    ],
)
def test_refused_before_anything_with_the_responses_field(body, param):
    with pytest.raises(RequestError) as e:
        _req(**body)
    assert e.value.info.status == 400 and e.value.info.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools[0]"),
        ({"input": "hi", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ],
)
def test_chat_refusals_name_the_responses_field(body, param):
    with pytest.raises(RequestError) as e:
        _turn(**body)
    assert e.value.info.status == 400 and e.value.info.param == param


def _ctx(turn, stream: bool) -> ResponseContext:
    return ResponseContext(turn.id, RequestKind.CHAT, "m", 0, stream, False)


def _deltas(*texts: str, finish: str | None = "stop") -> list[Delta]:
    out = [Delta("r", t, 1) for t in texts]
    out[0].prompt_tokens = 9
    out[-1].finish_reason = finish
    return out


def _events(raw: bytes) -> list[dict]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            body = json.loads(data.removeprefix("data: "))
            assert kind == "event: " + body["type"]
            events.append(body)
    return events


def test_stream_events_and_the_last_held_back_until_stored():
    _, ctx, turn = _turn(input="hi", max_output_tokens=5)
    r = ResponsesStream(_ctx(turn, True), turn)
    first = _events(r.render(_deltas("Hel", finish=None)))
    assert [e["type"] for e in first] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert first[0]["response"]["status"] == "in_progress" and first[0]["response"]["output"] == []
    rest = _events(r.render(_deltas("lo")))
    assert [e["type"] for e in rest] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert rest[1]["text"] == "Hello" and rest[3]["item"]["content"][0]["text"] == "Hello"
    assert not r.finished and r.final is not None  # waits for the store
    [last] = _events(r.release_final())
    assert r.finished and last["type"] == "response.completed"
    assert last["response"]["status"] == "completed" and last["response"]["usage"]["output_tokens"] == 2
    assert [e["sequence_number"] for e in first + rest + [last]] == list(range(10))


def test_stream_failure_is_an_error_event_then_response_failed():
    _, ctx, turn = _turn(input="hi")
    r = ResponsesStream(_ctx(turn, True), turn)
    d = _deltas("x", finish="error")
    d[-1].error = error(Code.WORKER_LOST, "worker lost")
    events = _events(r.render(d))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "worker_lost", "message": "worker lost"}
    assert r.finished and r.final is None


TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


def test_with_tools_a_call_streams_as_it_is_generated():
    sub, ctx, turn = _turn(input="hi", tools=TOOLS, tool_choice={"type": "function", "name": "f"})
    assert sub.params.structured is not None  # a named call: the arguments constrained to f's schema
    ctx.stream = True
    r = ResponsesStream(ctx, turn)
    first = _events(r.render(_deltas('{"a":', finish=None)))
    assert [e["type"] for e in first] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
    ]
    added = first[2]["item"]
    assert added["type"] == "function_call" and added["name"] == "f" and added["status"] == "in_progress"
    assert added["arguments"] == "" and first[3]["delta"] == '{"a":' and first[3]["item_id"] == added["id"]
    rest = _events(r.render(_deltas("1}")))
    assert [e["type"] for e in rest] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    call = rest[-1]["item"]
    assert call["type"] == "function_call" and call["name"] == "f" and call["arguments"] == '{"a":1}'
    assert rest[0]["delta"] == "1}" and rest[1]["arguments"] == '{"a":1}' and call["status"] == "completed"
    [last] = _events(r.release_final())
    assert last["response"]["output"] == [call] and last["response"]["status"] == "completed"
    assert [e["sequence_number"] for e in first + rest + [last]] == list(range(8))
    # the stored conversation continues with the call, then the tool's output
    assert rs.output_messages([call])[0]["tool_calls"][0]["id"] == call["call_id"]


@pytest.mark.parametrize(
    "choice,texts,finish",
    [
        ("auto", ["Let me ", "check.<tool", '_call>{"name": "f", "argu', 'ments": {"a": 1}}</tool_call>'], "stop"),
        ("required", ['[{"name":"f","parameters":{"a":1}},{"na', 'me":"f","parameters":{"a":2}}]'], "stop"),
        ("required", ['[{"name":"f","parameters":{"a":1}},{"na', 'me":"f","parameters":{"a'], "length"),  # cut
    ],
)
def test_with_tools_streamed_items_equal_the_whole_responses(choice, texts, finish):
    """Each item is opened, filled and closed in order (a message's text,
    then each call); the streamed items equal the non-streamed response's."""
    _, ctx, turn = _turn(input="hi", tools=TOOLS, tool_choice=choice)
    ctx.tools.parser, ctx.tools.auto_enabled = "hermes", True
    whole = ResponsesAccumulator(ctx, turn)
    whole.add(_deltas(*texts, finish=finish))
    ctx.stream = True
    r = ResponsesStream(ctx, turn)
    events = [e for t in texts[:-1] for e in _events(r.render(_deltas(t, finish=None)))]
    events += _events(r.render(_deltas(texts[-1], finish=finish)))
    [last] = _events(r.release_final())
    output = last["response"]["output"]

    def same(items):  # call ids are made per reading
        return [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in items]

    assert same(output) == same(json.loads(whole.render())["output"])
    assert last["response"]["status"] == ("completed" if finish == "stop" else "incomplete")
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == list(range(len(output)))
    for i, item in enumerate(output):
        if item["type"] == "function_call":
            deltas = [
                e["delta"]
                for e in events
                if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == i
            ]
            assert "".join(deltas) == item["arguments"]
    if choice == "auto":
        assert output[0]["content"][0]["text"] == "Let me check." and output[1]["name"] == "f"


def test_required_tool_calls_whole():
    _, ctx, turn = _turn(input="hi", tools=TOOLS, tool_choice="required")
    acc = ResponsesAccumulator(ctx, turn)
    acc.add(_deltas('[{"name": "f", "parameters": {"a": 1}}, {"name": "f", "parameters": {"a": 2}}]'))
    body = json.loads(acc.render())
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in body["output"]] == [
        ("function_call", "f", {"a": 1}),
        ("function_call", "f", {"a": 2}),
    ]
    assert len({o["call_id"] for o in body["output"]}) == 2


def test_whole_response_object_and_length_is_incomplete():
    _, ctx, turn = _turn(input="hi", max_output_tokens=2, metadata={"k": "v"})
    acc = ResponsesAccumulator(_ctx(turn, False), turn)
    acc.add(_deltas("a", "b", finish="length"))
    body = json.loads(acc.render())
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "ab" and body["metadata"] == {"k": "v"}
    assert body["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 11,
    }
    assert body["tool_choice"] == "auto" and body["store"] is True and body["max_output_tokens"] == 2


def test_memory_store_bounds_by_count_age_and_size():
    now = [0.0]
    store = MemoryResponseStore(max_stored=2, max_age_s=10.0, max_stored_bytes=100, clock=lambda: now[0])

    async def run():
        rec = encode_record(b'{"id":"a"}', [{"role": "user", "content": "x"}], "t", "k")
        got = decode_record(rec)
        assert got.messages == [{"role": "user", "content": "x"}] and (got.tenant, got.key) == ("t", "k")
        for rid in "abc":
            assert await store.put(rid, rec, "t")
        assert await store.get("a") is None and await store.get("c") == rec  # count: the oldest went
        now[0] = 5.0
        await store.put("d", rec, "t")  # b goes (count)
        now[0] = 10.5  # c is 10.5 s old: gone (age); d is 5.5
        assert await store.get("c") is None and await store.get("d") == rec
        assert not await store.put("big", b"x" * 101, "t")
        assert not await store.delete("d", "another tenant")  # only from its own tenant's shelf
        assert await store.delete("d", "t") and not await store.delete("d", "t")
        return store.counters()

    c = asyncio.run(run())
    assert c == {
        "stored": 0,
        "bytes": 0,
        "evicted_count": 2,
        "evicted_bytes": 0,
        "evicted_age": 1,
        "too_large": 1,
        "errors": 0,
    }


def test_memory_store_evicts_within_each_tenants_own_bounds():
    """One tenant storing far past its bound evicts only its own oldest; its
    byte bound counts too; another tenant's own (configured) bound applies to it."""
    bounds = {"noisy": (3, 10_000), "quiet": (2, 10_000), "small": (100, 260)}
    store = MemoryResponseStore(10, 3600.0, 1 << 20, bounds=lambda t: bounds[t])
    rec = encode_record(b"{}", [{"role": "user", "content": "y" * 50}])

    async def run():
        await store.put("q1", rec, "quiet")
        await store.put("q2", rec, "quiet")
        for i in range(1000):
            assert await store.put(f"n{i}", rec, "noisy")
        assert await store.get("q1") == rec and await store.get("q2") == rec
        assert [await store.get(f"n{i}") is not None for i in (996, 997, 998, 999)] == [False, True, True, True]
        await store.put("q3", rec, "quiet")  # quiet's own count bound: its oldest goes
        assert await store.get("q1") is None and await store.get("q3") == rec
        for i in range(5):  # small: 260 bytes hold 2 of these records
            await store.put(f"s{i}", rec, "small")
        assert [await store.get(f"s{i}") is not None for i in range(5)] == [False, False, False, True, True]
        return store.counters()

    c = asyncio.run(run())
    assert len(rec) * 3 > 260 >= len(rec) * 2
    assert c["stored"] == 3 + 2 + 2 and c["evicted_count"] == 997 + 1 and c["evicted_bytes"] == 3
