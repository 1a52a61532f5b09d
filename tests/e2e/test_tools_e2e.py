"""Tool calling through Envoy with the openai SDK, on the real tiny vLLM model
(the session ``stack``: tiny-llama with the hermes tool-call parser).

``required`` and named choices are constrained by structured output, so
every call's arguments validate against the tool's schema, whatever the
random model would have written; ``auto`` parses the model's own format (the
tiny model never writes one, so its answers are content).  Also: streamed
calls equal the whole response's, a tool-result turn, the chat-template
options, and the 400s before anything is reserved.
"""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
import requests
from stackutil import KEY_ALPHA, SIM_MODEL, VLLM_MODEL

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALERT = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["on"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alert", "parameters": ALERT}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alert": ALERT}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.envoy_url + "/v1", api_key=KEY_ALPHA, max_retries=0, timeout=120)


def _valid(calls) -> list[bool]:
    out = []
    for c in calls:
        try:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
            out.append(True)
        except (ValueError, jsonschema.ValidationError):
            out.append(False)
    return out


def test_required_and_named_calls_always_validate(client):
    """Seeded sampling over the random model: every call is a valid call."""
    ok, total = 0, 0
    for seed in range(6):
        for choice in ("required", {"type": "function", "function": {"name": "set_alert"}}):
            r = client.chat.completions.create(
                model=VLLM_MODEL,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=200,
                temperature=1.0,
                seed=seed,
                parallel_tool_calls=False,
            )
            ch = r.choices[0]
            assert ch.finish_reason == ("tool_calls" if choice == "required" else "stop"), ch
            calls = ch.message.tool_calls or []
            assert calls and ch.message.content in (None, "")
            assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
            if choice != "required":
                assert [c.function.name for c in calls] == ["set_alert"]
            results = _valid(calls)
            ok += sum(results)
            total += len(results)
            assert r.system_fingerprint and r.system_fingerprint.startswith("weir-")
    print(f"\ntool calls whose arguments validate against the schema: {ok}/{total}")
    assert ok == total


def _streamed(client, **kw) -> dict:
    """A streamed chat: its calls [(name, arguments)], finish reason, content,
    and per call the chunks that carried it (the first: id, type and name)."""
    calls: dict[int, list[str]] = {}
    chunks: dict[int, list] = {}
    finish, content, first_at, t0 = None, "", None, time.perf_counter()
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            if first_at is None:
                first_at = time.perf_counter() - t0
            chunks.setdefault(tc.index, []).append((tc, ch.finish_reason))
            slot = calls.setdefault(tc.index, ["", ""])
            if tc.function and tc.function.name:
                slot[0] += tc.function.name
            if tc.function and tc.function.arguments:
                slot[1] += tc.function.arguments
        content += ch.delta.content or ""
        finish = ch.finish_reason or finish
    return {
        "calls": [(n, a) for _, (n, a) in sorted(calls.items())],
        "finish": finish,
        "content": content or None,
        "chunks": chunks,
        "first_at": first_at,
    }


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_streamed_calls_form_as_generated_and_equal_the_whole_response(client, choice):
    """The call's id, type and name come in its first delta, before the
    finishing chunk, and its arguments over several engine steps."""
    kw = {
        "model": VLLM_MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 7,
        "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    s = _streamed(client, **kw)
    assert whole.message.tool_calls and len(whole.message.tool_calls) == 1
    assert s["calls"] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert s["finish"] == whole.finish_reason
    (first, first_finish), *rest = s["chunks"][0]
    assert first.id and first.id.startswith("chatcmpl-tool-") and first.type == "function"
    assert first.function.name == whole.message.tool_calls[0].function.name and first_finish is None
    assert len(rest) >= 2 and all(tc.id is None and not tc.function.name for tc, _ in rest)
    print(
        f"\n{choice}: first tool_calls delta after {s['first_at'] * 1000:.0f} ms; "
        f"{1 + len(rest)} deltas for {whole.message.tool_calls[0].function.arguments!r}"
    )


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_a_call_cut_by_max_tokens_comes_back_as_generated(client, choice):
    """Greedy, so a shorter budget generates a prefix of the longer one's
    text: cut short, the call is the whole call's prefix (finish_reason
    length), streamed or not; cut before a name could be read, the text is
    content."""
    kw = {"model": VLLM_MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "temperature": 0}
    full = client.chat.completions.create(max_tokens=200, **kw)
    call = full.choices[0].message.tool_calls[0].function
    # The longest budget that cuts the arguments, by bisection (a shorter budget
    # never generates more of them): a handful of requests, not one per token.
    lo, hi, found = 1, full.usage.completion_tokens - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        choice_at = client.chat.completions.create(max_tokens=mid, **kw).choices[0]
        got = choice_at.message.tool_calls
        if not got or len(got[0].function.arguments) < len(call.arguments):
            found, lo = (mid, choice_at), mid + 1
        else:
            hi = mid - 1
    assert found is not None
    cut_at, cut = found
    assert cut.finish_reason == "length"
    assert cut.message.tool_calls and cut.message.tool_calls[0].function.name == call.name
    args = cut.message.tool_calls[0].function.arguments
    assert call.arguments.startswith(args)
    assert 0 < len(args) < len(call.arguments)
    s = _streamed(client, max_tokens=cut_at, **kw)
    assert s["calls"] == [(call.name, args)] and s["finish"] == "length"
    if choice == "required":
        text = '[{"name":"%s","parameters":%s}]' % (call.name, call.arguments)  # the compact array generated
        early = client.chat.completions.create(max_tokens=2, **kw).choices[0]
        assert early.finish_reason == "length" and not early.message.tool_calls
        assert early.message.content and text.startswith(early.message.content)


def test_constrained_calls_are_compact_and_fit_small_budgets(client):
    """No free whitespace in constrained calls: greedy on the random model,
    every finished call validates and is compact JSON, and each fits 64
    tokens.  Prints the share valid and the tokens per call per budget."""
    rows = []
    for choice in (
        "required",
        {"type": "function", "function": {"name": "get_weather"}},
        {"type": "function", "function": {"name": "set_alert"}},
    ):
        for budget in (16, 32, 64):
            r = client.chat.completions.create(
                model=VLLM_MODEL,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=budget,
                temperature=0,
                parallel_tool_calls=False,
            )
            ch = r.choices[0]
            finished = ch.finish_reason != "length"
            valid = finished and all(_valid(ch.message.tool_calls or [])) and bool(ch.message.tool_calls)
            if finished:
                args = ch.message.tool_calls[0].function.arguments
                assert valid and args == json.dumps(json.loads(args), separators=(",", ":"), ensure_ascii=False)
            rows.append(
                (
                    choice if isinstance(choice, str) else choice["function"]["name"],
                    budget,
                    valid,
                    r.usage.completion_tokens,
                )
            )
            if budget == 64:
                assert valid, (choice, ch)
    print("\n" + "\n".join(f"{c:12} max_tokens={b:3}: valid={v!s:5} tokens={t}" for c, b, v, t in rows))


def test_auto_parses_the_models_format_and_a_tool_result_turn_is_served(client):
    r = client.chat.completions.create(model=VLLM_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    ch = r.choices[0]
    assert not ch.message.tool_calls and ch.message.content  # the tiny model writes no <tool_call>
    assert ch.finish_reason in ("stop", "length")
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
    }
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "-3 C and snow"},
    ]
    turn = client.chat.completions.create(model=VLLM_MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert turn.choices[0].message.content is not None
    assert turn.usage.prompt_tokens > r.usage.prompt_tokens  # the tool result was rendered into the prompt


def test_chat_template_options_change_the_prompt(client):
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
    counts = {}
    for name, extra in [
        ("default", {}),
        ("no-generation-prompt", {"add_generation_prompt": False}),
        ("continue", {"add_generation_prompt": False, "continue_final_message": True}),
    ]:
        r = client.chat.completions.create(model=VLLM_MODEL, messages=msgs, max_tokens=1, extra_body=extra)
        counts[name] = r.usage.prompt_tokens
    # the generation prompt is "<|assistant|>\n"; continuing drops the final "</s>\n" too
    assert counts["default"] > counts["no-generation-prompt"] > counts["continue"]


BAD = [
    ({"model": SIM_MODEL, "tools": TOOLS}, "tool_choice"),  # no tool-call parser configured for it
    ({"model": SIM_MODEL, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                    },
                }
            ]
        },
        "tools[0].function.parameters",
    ),
    ({"tools": []}, "tools"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_requests_are_400s_that_reserve_nothing(stack, extra, param):
    body = {"model": VLLM_MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    r = requests.post(
        stack.envoy_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY_ALPHA}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    rows = requests.get(stack.router_url + "/admin/workers", timeout=5).json()
    assert all(row.get("reserved_tokens", 0) == 0 for row in rows), rows


def test_responses_stream_a_call_as_it_is_generated(client):
    """Responses with a named tool, greedy: the function_call item is added
    with its name before its arguments, which come over several
    function_call_arguments.delta events; the item and the stored response
    equal the non-streamed response's call."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    kw = {
        "model": VLLM_MODEL,
        "input": "What is the weather in Oslo?",
        "tools": tools,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 64,
    }
    whole = client.responses.create(**kw)
    [call] = [o for o in whole.output if o.type == "function_call"]
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert events[added].item.type == "function_call" and events[added].item.name == "get_weather"
    assert events[added].item.arguments == "" and len(deltas) >= 2
    assert kinds.index("response.function_call_arguments.delta") > added
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(deltas) == call.arguments == events[-2].item.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    stored = client.responses.retrieve(events[-1].response.id)
    assert [(o.name, o.arguments) for o in stored.output] == [("get_weather", call.arguments)]
