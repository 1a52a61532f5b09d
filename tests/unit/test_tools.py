"""Tool calling's pure parts: the request's tool fields, the constraint for
required / named choices, and tool calls out of whole and streamed text
(streamed calls always equal the whole response's)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import api
from router.api.tokenize import parse_tokenize
from router.api.tools import (
    ChatTool,
    ChoiceToolStream,
    NamedFunction,
    NamedToolChoice,
    chat_deltas,
    extract_calls,
    tool_finish_reason,
    tool_schema,
    tool_spec,
    unsupported_tool_choice,
)
from router.lifecycle.prompts import BadInput, ModelPrompts
from shared.protocol import ChatMessage, ChatOptions, Delta, RequestKind, Submit

TOOLS = msgspec.convert(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ],
    list[ChatTool],
)


def _spec(choice, parallel=None, parser="hermes", auto=True):
    spec = tool_spec(TOOLS, choice, parallel)
    assert spec is not None
    spec.parser, spec.auto_enabled = parser, auto
    return spec


def test_tool_choice_defaults_to_auto_and_none_keeps_tools_out_of_parsing():
    assert _spec(None).choice == "auto"
    assert not _spec("none").parses
    assert not _spec("auto", auto=False).parses  # a parser without enable_auto_tool_choice: content
    assert _spec(NamedToolChoice(function=NamedFunction("now"))).named == "now"
    assert tool_spec(None, "none") is None


def test_required_schema_is_an_array_of_calls_and_named_the_arguments():
    req = tool_schema(_spec("required"))
    assert req is not None and req["type"] == "array" and req["minItems"] == 1 and "maxItems" not in req
    names = [item["properties"]["name"]["enum"] for item in req["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    assert req["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert tool_schema(_spec("required", parallel=False))["maxItems"] == 1  # type: ignore[index]
    named = tool_schema(_spec(NamedToolChoice(function=NamedFunction("get_weather"))))
    assert named == TOOLS[0].function.parameters
    assert tool_schema(_spec("auto")) is None


def test_whole_text_to_calls_per_choice():
    content, calls = extract_calls(
        _spec("required"),
        '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    )
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("now", {}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    _, calls = extract_calls(
        _spec("required", parallel=False), '[{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]'
    )
    assert len(calls) == 1
    content, calls = extract_calls(_spec(NamedToolChoice(function=NamedFunction("now"))), '{"x": 1}')
    assert content is None and calls[0].function.name == "now" and calls[0].function.arguments == '{"x": 1}'
    content, calls = extract_calls(_spec("auto"), 'Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert content == "Sure. " and calls[0].function.arguments == "{}"
    assert extract_calls(_spec("auto"), "just words") == ("just words", [])
    assert extract_calls(_spec("auto", auto=False), "<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])


def test_finish_reasons_as_openai():
    assert tool_finish_reason(_spec("required"), True, "stop") == "tool_calls"
    assert tool_finish_reason(_spec("required"), True, "length") == "length"
    assert tool_finish_reason(_spec("auto"), True, "stop") == "tool_calls"
    assert tool_finish_reason(_spec("auto"), False, "stop") == "stop"
    assert tool_finish_reason(_spec(NamedToolChoice(function=NamedFunction("now"))), True, "stop") == "stop"


def _stream(spec, pieces):
    """Feed ``pieces`` one by one: (content, [(name, arguments)], bodies per feed)."""
    s = ChoiceToolStream(spec)
    per_feed = [chat_deltas(s.feed(p)) for p in pieces] + [chat_deltas(s.finish())]
    bodies = [b for feed in per_feed for b in feed]
    content = "".join(b.get("content", "") for b in bodies) or None
    calls: dict[int, dict] = {}
    for b in bodies:
        for tc in b.get("tool_calls", []):
            if "id" in tc:  # a call's first entry: index, id, type and name together
                assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["name"]
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            assert "name" not in tc["function"] or "id" in tc
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], per_feed


def _cut(text, cuts):
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i : i + c])
        i += c
    pieces.append(text[i:])
    return pieces


AUTO_TEXTS = [
    "no call at all <tool",
    'I will call. <tool_call>{"name": "now", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Ösló"}}</tool_call>\n'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    "<tool_call>broken",
    "a < b and <tool_ c",
    '<tool_call>\n{"arguments": {"q": "}]\\"{"}, "name": "now"}\n</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Os',  # cut by max_tokens
]
LLAMA_TEXTS = [
    '{"name": "get_weather", "parameters": {"city": "Ösló"}}',
    '<|python_tag|>{"name": "now", "arguments": {"x": [1, "}]"]}}; {"name": "get_weather", "parameters": {}}',
    '  {"parameters": {"q": "{"}, "name": "now"}',  # leading whitespace; the name after the arguments
    '{"name": "get_weather", "parameters": {"city": "Os',  # cut by max_tokens
    'Here: {"name": "now", "arguments": {}}',  # not at the start: content (vLLM's streaming parser)
    '{"foo": 1}',  # no name: content
    "{not json",
    "<|python_t",
    "plain text",
]
REQUIRED_TEXTS = [
    '[{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"city":"O\\"slo]}"}}]',
    '[{"name": "get_weather", "parameters": {"city": [1, {"a": null}]}}]',
    '[{"name":"get_weather","parameters":{"ci',  # cut by max_tokens: the call as far as made
    '[{"name":"get_wea',  # nothing readable: content
]


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(
        [("auto", "hermes", t) for t in AUTO_TEXTS]
        + [("auto", "llama3_json", t) for t in LLAMA_TEXTS]
        + [("required", "hermes", t) for t in REQUIRED_TEXTS]
    ),
    st.lists(st.integers(1, 9), min_size=1, max_size=40),
)
def test_streamed_calls_equal_the_whole_responses(case, cuts):
    """However the text is split into engine steps, the streamed calls and
    content equal the whole response's."""
    choice, parser, text = case
    spec = _spec(choice, parser=parser)
    whole_content, whole_calls = extract_calls(spec, text)
    content, calls, _ = _stream(spec, _cut(text, cuts))
    assert calls == [(c.function.name, c.function.arguments) for c in whole_calls]
    assert (content or None) == (whole_content or None)


def test_whole_calls_are_the_generated_text_and_nothing_is_dropped():
    content, calls = extract_calls(_spec("required"), REQUIRED_TEXTS[0])
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("now", "{}"),
        ("get_weather", '{"city":"O\\"slo]}"}'),
    ]
    _, calls = extract_calls(_spec("auto"), AUTO_TEXTS[5])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("now", {"q": '}]"{'})]
    # cut by max_tokens: the partial call, as OpenAI returns it
    content, calls = extract_calls(_spec("required"), REQUIRED_TEXTS[2])
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"ci')]
    content, calls = extract_calls(_spec("auto"), AUTO_TEXTS[6])
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Os')
    ]
    # llama3_json: the calls' arguments as generated; a call not at the start is content
    llama = _spec("auto", parser="llama3_json")
    content, calls = extract_calls(llama, LLAMA_TEXTS[1])
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("now", '{"x": [1, "}]"]}'),
        ("get_weather", "{}"),
    ]
    assert extract_calls(llama, LLAMA_TEXTS[4]) == (LLAMA_TEXTS[4], [])
    # no call could be read: the text is content, as vLLM returns it
    assert extract_calls(_spec("required"), REQUIRED_TEXTS[3]) == (REQUIRED_TEXTS[3], [])
    assert extract_calls(_spec("auto"), AUTO_TEXTS[3]) == (AUTO_TEXTS[3], [])


@pytest.mark.parametrize(
    "choice,parser,text,name_at",
    [
        (
            "required",
            "hermes",
            '[{"name":"get_weather","parameters":{"city":"Oslo"}}]',
            len('[{"name":"get_weather"'),
        ),
        (
            "auto",
            "hermes",
            'Hi<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            len('Hi<tool_call>{"name": "get_weather"'),
        ),
        (
            "auto",
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            len('{"name": "get_weather"'),
        ),
        (
            "auto",
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}',
            len('<|python_tag|>{"name": "get_weather"'),
        ),
    ],
)
def test_a_call_streams_as_it_forms(choice, parser, text, name_at):
    """One character per engine step: the call's id, type and name come in
    the step that closes the name, then each step's argument text."""
    _, calls, per_feed = _stream(_spec(choice, parser=parser), list(text))
    first = next(i for i, bodies in enumerate(per_feed) if any("tool_calls" in b for b in bodies))
    assert first == name_at - 1
    args = [
        tc["function"]["arguments"]
        for bodies in per_feed[first + 1 :]
        for b in bodies
        for tc in b.get("tool_calls", [])
    ]
    assert len(args) >= len('{"city":"Oslo"}') and all(len(a) == 1 for a in args)
    assert json.loads(calls[0][1]) == {"city": "Oslo"}


def test_streamed_named_call_sends_its_header_with_the_first_arguments():
    s = ChoiceToolStream(_spec(NamedToolChoice(function=NamedFunction("get_weather"))))
    assert s.feed("  ") == []  # whitespace only: no call yet
    first = chat_deltas(s.feed('{"city"'))
    assert first == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": s.calls[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '  {"city"'},
                }
            ]
        }
    ]
    assert chat_deltas(s.feed(': "Oslo"}')) == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}]
    assert s.finish() == [] and s.called


def _ctx(spec, stream):
    ctx = api.ResponseContext("chatcmpl-1", RequestKind.CHAT, "m", 1, stream, False)
    ctx.tools = spec
    return ctx


def test_rendered_bodies_are_openai_shapes():
    """Non-streamed and streamed chat with tools, parsed by the openai SDK's types."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    acc = api.Accumulator(_ctx(_spec("required"), False))
    acc.add([Delta("1", text, 9, finish_reason="stop", prompt_tokens=3, completion_tokens=9)])
    body = ChatCompletion.model_validate_json(acc.render())
    msg = body.choices[0].message
    assert body.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls is not None and msg.tool_calls[0].function.name == "get_weather"
    assert body.system_fingerprint and body.system_fingerprint.startswith("weir-")
    r = api.StreamRenderer(_ctx(_spec("required"), True))
    out = r.render([Delta("1", text[:10], 3)]) + r.render([Delta("1", text[10:], 6, finish_reason="stop")])
    chunks = [ChatCompletionChunk.model_validate_json(e[6:]) for e in out.decode().split("\n\n") if e[6:7] == "{"]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("get_weather", '{"city": "Oslo"}')]  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_bad_tool_fields_are_400s_before_anything_else():
    for tools, choice, param in [
        ([], None, "tools"),
        (None, "auto", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, NamedToolChoice(function=NamedFunction("unknown")), "tool_choice"),
    ]:
        with pytest.raises(api.RequestError) as e:
            tool_spec(tools, choice)
        assert e.value.info.status == 400 and e.value.info.param == param


def _tool_sub(choice: str) -> Submit:
    return Submit(
        "r",
        "m",
        RequestKind.CHAT,
        messages=[ChatMessage("user", "x")],
        chat=ChatOptions(tools=json.dumps([{"type": "function", "function": {"name": "f"}}]), tool_choice=choice),
    )


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_a_model_without_a_parser_refuses_tool_choices_that_need_one(choice):
    assert unsupported_tool_choice(choice, "hermes", True) is None
    with pytest.raises(BadInput) as e:
        ModelPrompts(None).tokenize(_tool_sub(choice))  # the simulated engine's model: no parser configured
    assert e.value.param == "tool_choice" and "tool_call_parser" in str(e.value)
    assert ModelPrompts(None).tokenize(_tool_sub("none")).count > 0


@pytest.mark.parametrize(
    "opts,param",
    [
        (ChatOptions(tools="not json", tool_choice="none"), "tools"),
        (ChatOptions(tools='{"a": 1}', tool_choice="none"), "tools"),
        (ChatOptions(tools='["x"]', tool_choice="none"), "tools"),
        (ChatOptions(template_kwargs="[1]"), "chat_template_kwargs"),
        (ChatOptions(documents='"doc"'), "documents"),
        (ChatOptions(tool_choice="sometimes"), "tool_choice"),
    ],
)
def test_chat_options_from_zeromq_are_checked_not_trusted(opts, param):
    """A ZeroMQ client's Submit.chat is whatever it sent: a 400 naming the field, never a crash."""
    sub = Submit("r", "m", RequestKind.CHAT, messages=[ChatMessage("user", "x")], chat=opts)
    with pytest.raises(BadInput) as e:
        ModelPrompts(None).tokenize(sub)
    assert e.value.param == param


def _auto_spec(tools: list[dict], choice=None, parallel=None, parser="hermes", auto=True):
    spec = tool_spec(msgspec.convert(tools, list[ChatTool]), choice, parallel)
    assert spec is not None
    spec.parser, spec.auto_enabled = parser, auto
    return spec


STRICT = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
LOOSE = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
NOT_STRICT = {"type": "function", "function": {"name": "h", "strict": False}}


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "parser", "auto", "constrained"),
    [
        ([LOOSE], None, None, "hermes", True, False),  # auto, nothing strict: free (vLLM's default)
        ([LOOSE, NOT_STRICT], "auto", True, "hermes", True, False),
        ([LOOSE, STRICT], None, None, "hermes", True, True),  # one strict tool constrains auto
        ([STRICT], "auto", None, "llama3_json", True, True),
        ([LOOSE], "auto", False, "hermes", True, True),  # one call only: the envelope is in the grammar
        ([STRICT], "none", None, "hermes", True, False),
        ([STRICT], "required", None, "hermes", True, False),  # required / named: tool_constraint's schema
        ([STRICT], "auto", None, "hermes", False, False),  # auto not enabled: no calls are read
        ([STRICT], "auto", None, None, True, False),  # no parser
        ([STRICT], "auto", None, "pythonic", True, False),  # a parser weir has no tag for
    ],
)
def test_auto_is_constrained_where_vllm_constrains_it(tools, choice, parallel, parser, auto, constrained):
    spec = _auto_spec(tools, choice, parallel, parser, auto)
    assert api.tools.constrains_auto(spec) is constrained
    so = api.tools.auto_constraint(spec)
    assert (so is not None) is constrained
    sub = Submit("r", "m", kind=RequestKind.CHAT, messages=[ChatMessage("user", "x")])
    api.constrain_auto(sub, spec)
    assert (sub.params is not None and sub.params.structured == so) is constrained


def test_an_auto_tag_that_does_not_compile_names_tools_the_field_the_client_sent():
    """auto with a strict tool or parallel_tool_calls false is constrained by the structural tag the
    router builds from the tools; its compile error names ``tools`` (the client never sent a tag).
    ``check`` alone: ``tokenize`` compiles each tool's schema first (naming the tool)."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}, "strict": True}}
    prompts = ModelPrompts(None, "hermes", True)
    for extra in ({}, {"parallel_tool_calls": False, "tool_choice": "auto"}):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [bad, LOOSE], **extra}
        sub, ctx = api.parse_chat(json.dumps(body).encode(), api.RequestMeta(), "r")
        assert ctx.tools is not None
        ctx.tools.parser, ctx.tools.auto_enabled = "hermes", True
        api.constrain_auto(sub, ctx.tools)
        assert sub.params is not None and sub.params.structured is not None
        assert sub.params.structured.structural_tag is not None
        with pytest.raises(BadInput) as e:
            prompts.check(sub)
        assert e.value.param == "tools" and "does not compile" in str(e.value), extra
        with pytest.raises(BadInput) as e:
            prompts.tokenize(sub)
        assert e.value.param == "tools[0].function.parameters"
    # a ZeroMQ client's own tag, without tools: its own field
    assert sub.params is not None
    own = Submit("r", "m", RequestKind.COMPLETION, prompt="x", params=sub.params)
    with pytest.raises(BadInput) as e:
        prompts.check(own)
    assert e.value.param == "structured_outputs.structural_tag"


def test_auto_constraint_pins_strict_tools_only_and_yields_to_response_format():
    so = api.tools.auto_constraint(_auto_spec([LOOSE, STRICT], parallel=False))
    assert so is not None and so.kinds() == ["structural_tag"]
    fmt = json.loads(so.structural_tag or "")["format"]
    assert fmt["triggers"] == ["<tool_call>"] and fmt["stop_after_first"] is True
    schemas = {t["begin"]: t["content"]["json_schema"] for t in fmt["tags"]}
    assert schemas['<tool_call>{"name": "f", "arguments": '] == {"type": "object"}  # strict: its schema
    assert schemas['<tool_call>{"name": "g", "arguments": '] is True  # not strict: any JSON
    # a request with its own structured output keeps it (its tools are read, not constrained)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [STRICT],
        "response_format": {"type": "json_object"},
    }
    sub, ctx = api.parse_chat(json.dumps(body).encode(), api.RequestMeta(), "r")
    assert ctx.tools is not None
    ctx.tools.parser, ctx.tools.auto_enabled = "hermes", True
    api.constrain_auto(sub, ctx.tools)
    assert sub.params is not None and sub.params.structured is not None and sub.params.structured.json_object


def _nested(depth: int) -> str:
    return '{"a":' * depth + "{}" + "}" * depth


@pytest.mark.parametrize("where", ["tool", "strict-auto", "call-arguments", "tokenize"])
def test_json_nested_near_the_decoders_limit_is_a_400_never_a_recursion_error(where):
    """The body decoder takes ~990 levels (fewer with more frames above it); the parsers re-encode tool schemas
    and call arguments with json.dumps, whose limit is lower by the frames
    above it.  At every depth up to the decoder's: parsed, or a 400."""
    top = 1
    while True:  # the decoder's limit from here (it depends on the frames above)
        try:
            msgspec.json.decode(_nested(top + 10).encode())
        except RecursionError:
            break
        top += 10
    refused = 0
    for depth in range(top - 40, top + 10):
        if where == "call-arguments":
            call = '{"id":"c","type":"function","function":{"name":"f","arguments":' + _nested(depth) + "}}"
            body = (
                '{"model":"m","messages":[{"role":"user","content":"x"},'
                '{"role":"assistant","tool_calls":[' + call + "]}]}"
            )
        else:
            strict = "true" if where == "strict-auto" else "false"
            fn = '{"name":"f","strict":' + strict + ',"parameters":' + _nested(depth) + "}"
            body = (
                '{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":'
                + fn
                + "}]}"
            )
        try:
            if where == "tokenize":  # (/tokenize with messages and tools: the chat template's inputs)
                parse_tokenize(body.encode())
                continue
            sub, ctx = api.parse_chat(body.encode(), api.RequestMeta(), "r")
            if ctx.tools is not None:
                ctx.tools.parser, ctx.tools.auto_enabled = "hermes", True
                api.constrain_auto(sub, ctx.tools)
        except api.RequestError as e:
            assert e.info.status == 400, depth
            refused += 1
    assert refused  # (the range reaches past what can be re-encoded)
