"""weir's tool calling and chat rendering against vLLM's own code, imported
(no server): the tool parsers on one corpus, the tool dicts the template
gets, and chat prompts rendered token for token -- add_generation_prompt,
continue_final_message, chat_template_kwargs, documents, tools and a tool
turn in the history.  Importing vLLM takes ~15 s: marked slow (make test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from router.api import parse_chat
from router.api.request import RequestMeta
from router.api.tool_parsers import extract
from router.api.tools import ChatTool, template_tools, tool_spec
from router.lifecycle.prompts import BadInput, ModelPrompts

pytestmark = pytest.mark.slow

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
if not (MODEL / "tokenizer.json").exists():
    pytest.skip("models/tiny-llama not built", allow_module_level=True)

# A template that shows the model its tools, tool calls and tool results, and
# reads a template kwarg and documents (the tiny model's own reads none of them).
TOOLS_TEMPLATE = """{% if tools %}<|system|>
Tools:{% for t in tools %} {{ t['function']['name'] }}={{ t['function'] | tojson }}{% endfor %}</s>
{% endif %}{% if documents %}<|system|>
Docs: {{ documents | tojson }}</s>
{% endif %}{% for m in messages %}<|{{ m['role'] }}|>
{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'],
'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{% endif %}{% if m['role'] == 'tool' %}[{{
m['tool_call_id'] }}] {% endif %}{{ m['content'] }}</s>
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% if enable_thinking %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def vllm_side():
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    cfg = ModelConfig(model=str(MODEL), tokenizer=str(MODEL), max_model_len=512)
    tok = get_tokenizer(str(MODEL))

    def render(body: dict, template: str | None) -> list[int]:
        """vLLM's chat endpoint's rendering: its request model, its message
        parsing and its apply_chat_template, with the kwargs it builds."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        req = ChatCompletionRequest.model_validate(body)
        conv, _, _ = parse_chat_messages(req.messages, cfg, content_format="string")
        params = req.build_chat_params(template, "string")
        tools = [t.model_dump() for t in req.tools] if req.tools else None
        return safe_apply_chat_template(
            cfg,
            tok,
            conv,
            tools=tools,
            chat_template=params.chat_template or tok.chat_template,
            tokenize=True,
            **params.chat_template_kwargs,
        )

    return render, tok


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tools-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(MODEL / name, d / name)
    (d / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return d


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now", "strict": True}},
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call-2", "type": "function", "function": {"name": "now", "arguments": "not json"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "-3 C"},
]
USER = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can"}]

CASES = {
    "plain": {"messages": USER[:1]},
    "no-generation-prompt": {"messages": USER, "add_generation_prompt": False},
    "continue-final": {"messages": USER, "add_generation_prompt": False, "continue_final_message": True},
    "continue-final-spaces": {
        "messages": [USER[0], {"role": "assistant", "content": "Sure  "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "kwargs-read": {"messages": USER[:1], "chat_template_kwargs": {"enable_thinking": True}},
    "kwargs-unread": {"messages": USER[:1], "chat_template_kwargs": {"nobody_reads_this": 1}},
    "kwargs-generation-prompt": {"messages": USER[:1], "chat_template_kwargs": {"add_generation_prompt": False}},
    "documents": {"messages": USER[:1], "documents": [{"title": "a", "text": "b"}]},
    "reasoning-effort": {"messages": USER[:1], "reasoning_effort": "low"},
    "reasoning-effort-none": {
        "messages": USER[:1],
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": True},
    },
    "tools": {"messages": USER[:1], "tools": TOOLS},
    "tools-none": {"messages": USER[:1], "tools": TOOLS, "tool_choice": "none"},
    "tool-turn": {"messages": HISTORY, "tools": TOOLS},
    "special-tokens": {"messages": USER[:1], "add_special_tokens": True},
}


@pytest.mark.parametrize("template", ["tiny", "tools"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_ids_equal_vllms(vllm_side, tools_model, template, case):
    render, _ = vllm_side
    body = {"model": "tiny-llama", **CASES[case]}
    model_dir = MODEL if template == "tiny" else tools_model
    ours = ModelPrompts(str(model_dir), "hermes", True)
    sub, _ = parse_chat(json.dumps(body).encode(), RequestMeta(), "r")
    theirs = render(body, None if template == "tiny" else TOOLS_TEMPLATE)
    if body.get("add_special_tokens"):
        # vLLM's chat endpoint tokenizes the rendered text itself with add_special_tokens
        _, tok = vllm_side
        theirs = tok.encode(tok.decode(theirs), add_special_tokens=True)
    assert ours.tokenize(sub).ids == list(theirs)


def test_tool_dicts_are_vllms_model_dump():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    spec = tool_spec(msgspec.convert(TOOLS, list[ChatTool]), None)
    assert spec is not None
    assert json.loads(template_tools(spec)) == [ChatCompletionToolsParam.model_validate(t).model_dump() for t in TOOLS]


OUTPUTS = [
    "plain text, no call",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Ösló"}}</tool_call>'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # unterminated
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>["a list"]</tool_call>',
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}; {"name": "now", "parameters": {}}',
    '<|python_tag|>{"name": "now", "arguments": {"x": [1, 2]}}',
    'Here: {"name": "now"}',  # llama3_json: a key missing -> content
    "{not json at all",
    "   ",
    "",
]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_parsers_equal_vllms(vllm_side, parser):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    _, tok = vllm_side

    class LlamaVocab:  # llama3_json insists on Llama 3's tag in the vocabulary, which tiny-llama lacks
        def get_vocab(self) -> dict[str, int]:
            return {"<|python_tag|>": 128010}

    theirs_parser = ToolParserManager.get_tool_parser(parser)(LlamaVocab() if parser == "llama3_json" else tok)
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    )
    for text in OUTPUTS:
        got = theirs_parser.extract_tool_calls(text, req)
        theirs = ([(c.function.name, c.function.arguments) for c in got.tool_calls], got.content)
        calls, content = extract(parser, text)
        assert ([tuple(c) for c in calls], content) == theirs, text


def test_bad_tool_schema_is_a_400_naming_the_tool():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                },
            }
        ],
    }
    sub, _ = parse_chat(json.dumps(body).encode(), RequestMeta(), "r")
    with pytest.raises(BadInput) as e:
        ModelPrompts(str(MODEL), "hermes", True).tokenize(sub)
    assert e.value.param == "tools[0].function.parameters"
    body["tool_choice"] = "required"
    sub, _ = parse_chat(json.dumps(body).encode(), RequestMeta(), "r")
    with pytest.raises(BadInput) as e:
        ModelPrompts(str(MODEL), "hermes", True).tokenize(sub)
    assert e.value.param == "tools"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_calls_are_compact_json_that_vllm_takes(choice):
    """required / named calls are generated with no free whitespace: the
    worker hands vLLM an EBNF grammar of the schema that has none (vLLM takes
    disable_any_whitespace only server-wide), which vLLM's own validation
    accepts; the compact call is allowed, a newline or a space is not."""
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    from xgrammar.testing import _is_grammar_accept_string

    from engine_worker.vllm_engine import vllm_params

    weather = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
    sub, _ = parse_chat(json.dumps(body).encode(), RequestMeta(), "r1")
    assert sub.params is not None and sub.params.structured is not None
    assert sub.params.structured.disable_any_whitespace
    params = vllm_params(msgspec.structs.replace(sub.params, max_tokens=16))
    so = params.structured_outputs
    assert so is not None and so.json is None and so.grammar
    validate_xgrammar_grammar(params)
    args = '{"city":"Oslo","days":3}'
    call = args if choice != "required" else '[{"name":"get_weather","parameters":' + args + "}]"
    assert _is_grammar_accept_string(so.grammar, call)
    for loose in (call.replace(":", ": ", 1), call.replace("{", "{\n", 1), call.replace(",", " ,", 1)):
        assert not _is_grammar_accept_string(so.grammar, loose)


LLAMA_STREAMS = [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Ösló"}}',
    '{"name": "now", "arguments": {"x": [1, 2]}}; {"name": "get_weather", "parameters": {"city": "Lima"}}',
    '{"name": "get_weather", "parameters": {"city": "Os',  # cut by max_tokens
    "plain text, no call",
    'Here: {"name": "now", "arguments": {}}',  # not at the start: content in vLLM's streaming parser too
]


@pytest.mark.parametrize("text", LLAMA_STREAMS)
def test_llama3_json_streams_as_vllms_parser(vllm_side, text):
    """The same text, token by token, through vLLM's llama3_json streaming
    parser and weir's: the same content, the same calls (arguments as JSON
    values: vLLM re-serializes them, weir sends them as generated; a cut call's
    as far as generated), and each call's name in the same engine step."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    from router.api.tools import ChoiceToolStream, chat_deltas

    _, tok = vllm_side

    class LlamaVocab:
        def get_vocab(self) -> dict[str, int]:
            return {"<|python_tag|>": 128010}

    theirs_parser = ToolParserManager.get_tool_parser("llama3_json")(LlamaVocab())
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    )
    # <|python_tag|> is one token of Llama 3 (tiny-llama spells it in characters): one step
    tag = "<|python_tag|>" if text.startswith("<|python_tag|>") else ""
    ids = tok.encode(text[len(tag) :], add_special_tokens=False)
    steps, prev = [tag] if tag else [], ""
    for k in range(1, len(ids) + 1):  # the engine's detokenized steps (an unfinished character waits)
        cur = tok.decode(ids[:k])
        if cur.endswith("\ufffd"):
            continue
        steps.append(cur[len(prev) :])
        prev = cur
    assert "".join(steps) == text

    def collect(deltas_per_step):
        content, calls, named_at = "", {}, []
        for step, deltas in enumerate(deltas_per_step):
            for d in deltas:
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    f = tc.get("function") or {}
                    slot = calls.setdefault(tc["index"], ["", ""])
                    if f.get("name"):
                        slot[0] += f["name"]
                        named_at.append(step)
                    slot[1] += f.get("arguments") or ""
        return content, [slot for _, slot in sorted(calls.items())], named_at

    theirs_steps, prev = [], ""
    for piece in steps:
        cur = prev + piece
        d = theirs_parser.extract_tool_calls_streaming(prev, cur, piece, [], [], [], req)
        theirs_steps.append([d.model_dump(exclude_none=True)] if d is not None else [])
        prev = cur
    spec = tool_spec(msgspec.convert(TOOLS, list[ChatTool]), "auto")
    assert spec is not None
    spec.parser, spec.auto_enabled = "llama3_json", True
    mine = ChoiceToolStream(spec)
    mine_steps = [chat_deltas(mine.feed(p)) for p in steps]
    mine_steps[-1] += chat_deltas(mine.finish())
    t_content, t_calls, t_named = collect(theirs_steps)
    m_content, m_calls, m_named = collect(mine_steps)
    assert m_content == t_content and m_named == t_named
    assert [n for n, _ in m_calls] == [n for n, _ in t_calls]
    for (_, m_args), (_, t_args) in zip(m_calls, t_calls, strict=True):
        try:
            assert json.loads(m_args) == json.loads(t_args)
        except ValueError:  # a cut call: vLLM sends only the arguments' settled prefix
            assert m_args.replace(" ", "").startswith(t_args.replace(" ", ""))


LOOSE_TOOLS = [TOOLS[0], {"type": "function", "function": {"name": "now"}}]
STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}, LOOSE_TOOLS[1]]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize(
    "tools,parallel",
    [(LOOSE_TOOLS, None), (STRICT_TOOLS, None), (STRICT_TOOLS, False), (LOOSE_TOOLS, False), (LOOSE_TOOLS, True)],
)
def test_auto_constraint_is_vllms_structural_tag(vllm_side, parser, tools, parallel):
    """``auto`` is constrained exactly where vLLM 0.32's default (--tool-strict-level
    auto) constrains it, by the same structural tag (its parser's adjust_request),
    and the tag compiles and does what it says: free text, then a strict tool's
    arguments must follow its schema."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager
    from xgrammar.testing import _is_grammar_accept_string

    _, tok = vllm_side

    class Vocab:  # llama3_json insists on Llama 3's tag in the vocabulary, which tiny-llama lacks
        def get_vocab(self) -> dict[str, int]:
            return {"<|python_tag|>": 128010}

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    parser_cls = ParserManager.get_parser(tool_parser_name=parser, enable_auto_tools=True)
    assert parser_cls is not None
    theirs = parser_cls(Vocab() if parser == "llama3_json" else tok, None).adjust_request(
        ChatCompletionRequest.model_validate(body)
    )
    theirs_tag = theirs.structured_outputs.structural_tag if theirs.structured_outputs else None
    spec = tool_spec(msgspec.convert(tools, list[ChatTool]), None, parallel)
    assert spec is not None
    spec.parser, spec.auto_enabled = parser, True
    from router.api.tools import auto_constraint

    so = auto_constraint(spec)
    mine_tag = so.structural_tag if so is not None else None
    assert (mine_tag is None) == (theirs_tag is None)
    if mine_tag is None:
        return
    assert json.loads(mine_tag) == json.loads(theirs_tag)
    # the worker hands it to vLLM, whose own validation takes it
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    from engine_worker.vllm_engine import vllm_params
    from shared.protocol import SamplingParams

    params = vllm_params(SamplingParams(max_tokens=16, structured=so))
    assert params.structured_outputs is not None and params.structured_outputs.structural_tag == mine_tag
    validate_xgrammar_grammar(params)
    if parser == "hermes":
        good = 'I will. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        bad = '<tool_call>{"name": "get_weather", "arguments": {"town": 1}}</tool_call>'
        loose = '<tool_call>{"name": "now", "arguments": {"anything": [1]}}</tool_call>'
    else:
        good = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
        bad = '{"name": "get_weather", "parameters": {"town": 1}}'
        loose = '{"name": "now", "parameters": {"anything": [1]}}'
    import xgrammar as xgr

    compiled = str(xgr.Grammar.from_structural_tag(mine_tag))
    assert _is_grammar_accept_string(compiled, good)
    assert _is_grammar_accept_string(compiled, loose)  # not strict: any JSON arguments
    assert _is_grammar_accept_string(compiled, "just text") or not spec.parallel
    strict = any(t["function"].get("strict") for t in tools)
    assert _is_grammar_accept_string(compiled, bad) is not strict
