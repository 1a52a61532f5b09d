"""Tool calling as vLLM's chat endpoint does it (pure, no I/O).

The steps, one function each, shared by every endpoint that takes tools
(chat completions; the Responses API builds a ``ToolSpec`` from its own
flat tool shape with ``function_tools``):

- ``tool_spec``: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` from a
  body -> a ``ToolSpec``, with vLLM's 400s (empty tools, a choice without
  tools, an unknown named tool);
- ``template_tools``: the tool dicts the chat template gets (vLLM's
  ``tool.model_dump()`` shape), as JSON text for ``ChatOptions.tools``;
- ``tool_constraint``: for ``required`` and a named tool, the JSON schema the
  output is constrained by (structured output), so the arguments always
  validate against the tool's schema -- vLLM's ``get_json_schema_from_tools``;
- ``auto_constraint``: for ``auto``, where vLLM 0.32 constrains it (a
  ``strict`` tool, or one call only), vLLM's structural tag of the parser's
  call format (``constrain_auto`` sets it once the model's parser is known);
- ``ChoiceToolStream``: one choice's generated text read as content and
  tool calls while it is generated (required: a JSON array of
  ``{name, parameters}``; named: the arguments themselves; auto: the model's
  own format), as ``ToolPiece``s; ``chat_deltas`` makes them OpenAI's
  ``delta.tool_calls``;
- ``extract_calls``: the same reading of a whole text, so streamed and whole
  responses agree;
- ``tool_finish_reason``: OpenAI's ``tool_calls`` finish reason where it applies.

What the model itself decides -- whether its config names a tool-call parser
-- is checked where the request meets its model (router.lifecycle.prompts), before
anything is reserved.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from router.api.errors import invalid, nesting_bounded
from router.api.tool_parsers import LLAMA_BOT as _LLAMA_BOT
from router.api.tool_parsers import tag_overlap
from router.api.tool_scan import CallScan
from shared.protocol import SamplingParams, StructuredOutput, Submit

ToolChoiceKind = Literal["none", "auto", "required", "named"]


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    """A tool in chat completions' shape: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = str | NamedToolChoice


class ToolSpec(msgspec.Struct, gc=False):
    """A request's tools as resolved: what the template shows, what the
    output is constrained to, how the text is parsed."""

    functions: list[FunctionDefinition]
    choice: ToolChoiceKind
    named: str | None = None  # choice "named": the function
    parallel: bool = True  # parallel_tool_calls is not false
    parser: str | None = None  # the model's tool_call_parser (set where the model is known)
    auto_enabled: bool = False  # the model's enable_auto_tool_choice

    @property
    def parses(self) -> bool:
        """Does the output become tool calls (else it is plain content)?"""
        if self.choice in ("required", "named"):
            return True
        return self.choice == "auto" and self.parser is not None and self.auto_enabled


def function_tools(
    functions: list[FunctionDefinition],
    tool_choice: str | None,
    named: str | None = None,
    parallel_tool_calls: bool | None = None,
    choice_param: str = "tool_choice",
) -> ToolSpec:
    """A ``ToolSpec`` from function definitions (any endpoint's tool shape).
    ``tool_choice``: "none" / "auto" / "required", or None with ``named`` set."""
    if named is not None:
        if not any(f.name == named for f in functions):
            raise invalid(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                param=choice_param,
            )
        return ToolSpec(functions, "named", named, parallel_tool_calls is not False)
    choice = tool_choice if tool_choice is not None else "auto"
    if choice not in ("none", "auto", "required"):
        raise invalid(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
            param=choice_param,
        )
    return ToolSpec(functions, choice, None, parallel_tool_calls is not False)  # type: ignore[arg-type]


def tool_spec(
    tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None = None
) -> ToolSpec | None:
    """Chat completions' tool fields -> a ``ToolSpec`` (None: no tools)."""
    if tools is not None and not tools:
        raise invalid(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    if tools is None:
        if tool_choice is not None and tool_choice != "none":
            raise invalid("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return None
    functions = [t.function for t in tools]
    if isinstance(tool_choice, NamedToolChoice):
        if not tool_choice.function.name:
            raise invalid("Invalid `name` in `function` in `tool_choice`", param="tool_choice.function.name")
        return function_tools(functions, None, tool_choice.function.name, parallel_tool_calls)
    return function_tools(functions, tool_choice, None, parallel_tool_calls)


def template_tools(spec: ToolSpec) -> str:
    """The tools as the chat template sees them (vLLM: ``tool.model_dump()``:
    ``strict`` only when set), as JSON text."""
    out = []
    for f in spec.functions:
        fn: dict[str, Any] = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict is not None:
            fn["strict"] = f.strict
        out.append({"type": "function", "function": fn})
    return json.dumps(out, ensure_ascii=False)


def _params_or_empty_object(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}


def tool_schema(spec: ToolSpec) -> dict[str, Any] | None:
    """The JSON schema ``required`` / named output must satisfy (None for
    none / auto): vLLM's ``get_json_schema_from_tools``."""
    if spec.choice == "named":
        f = next(f for f in spec.functions if f.name == spec.named)
        return _params_or_empty_object(f.parameters)
    if spec.choice != "required":
        return None
    defs: dict[str, Any] = {}
    items = []
    for f in spec.functions:
        params = f.parameters
        if params is not None and "$defs" in params:
            params = dict(params)
            found = params.pop("$defs")
            if not isinstance(found, dict):
                raise invalid(f"`$defs` in the parameters of tool '{f.name}' must be an object", param="tools")
            for k, v in found.items():
                if k in defs and defs[k] != v:
                    raise invalid(f"Tool definition '{k}' has multiple schemas, which is not supported.", param="tools")
                defs[k] = v
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [f.name]},
                    "parameters": _params_or_empty_object(params),
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not spec.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_constraint(spec: ToolSpec) -> StructuredOutput | None:
    schema = tool_schema(spec)
    if schema is None:
        return None
    # compact: free whitespace between JSON tokens would spend the call's
    # tokens on nothing (a random model may never close it)
    return StructuredOutput(json=json.dumps(schema, ensure_ascii=False), disable_any_whitespace=True)


# vLLM 0.32's structural tag of each parser's call format (vllm/tool_parsers/
# structural_tag_registry.py: hermes, xgrammar's builtin llama): the text
# that triggers a call, and each call's (begin, end) around its arguments.
_TAG_STYLES: dict[str, tuple[list[str], list[tuple[str, str]], list[str]]] = {
    "hermes": (
        ["<tool_call>"],
        [
            ('<tool_call>\n{"name": "%s", "arguments": ', "}\n</tool_call>"),
            ('<tool_call>{"name": "%s", "arguments": ', "}</tool_call>"),
        ],
        [],
    ),
    "llama3_json": (['{"name": '], [('{"name": "%s", "parameters": ', "}")], ["<think>", "</think>"]),
}


def constrains_auto(spec: ToolSpec) -> bool:
    """Is this ``auto`` request's output constrained, as vLLM 0.32 decides by
    default (``--tool-strict-level auto``, ``resolve_tool_strictness``)?  When
    a tool says ``strict: true``, or ``parallel_tool_calls`` is false (a single
    call needs the call's envelope in the grammar) -- and the model's parser
    has a structural tag."""
    if spec.choice != "auto" or not spec.parses or spec.parser not in _TAG_STYLES:
        return False
    return not spec.parallel or any(f.strict is True for f in spec.functions)


def auto_constraint(spec: ToolSpec) -> StructuredOutput | None:
    """For ``auto`` where ``constrains_auto``: vLLM's structural tag -- text is
    free, but once the model starts a call (the parser's trigger) the call must
    follow the format, name one of the tools, and a ``strict: true`` tool's
    arguments its schema (other tools' arguments: any JSON); with
    ``parallel_tool_calls: false`` the output ends after the first call."""
    if not constrains_auto(spec):
        return None
    triggers, shapes, excludes = _TAG_STYLES[spec.parser or ""]
    tags = [
        {
            "type": "tag",
            "begin": begin % f.name,
            "content": {
                "type": "json_schema",
                "json_schema": (f.parameters if f.parameters is not None else True) if f.strict is True else True,
                "style": "json",
                "any_order": False,
                "max_whitespace_cnt": None,
                "excludes": [],
            },
            "end": end,
        }
        for f in spec.functions
        for begin, end in shapes
    ]
    fmt = {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "at_least_one": False,
        "stop_after_first": not spec.parallel,
        "excludes": excludes,
    }
    return StructuredOutput(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False))


@nesting_bounded
def constrain_auto(sub: Submit, spec: ToolSpec) -> None:
    """Once the model's parser is known (``spec.parser``): an ``auto`` request
    that vLLM would constrain gets its structural tag, unless it carries its
    own structured output (``response_format``: that constraint applies)."""
    so = auto_constraint(spec)
    if so is None or (sub.params is not None and sub.params.structured is not None):
        return
    sub.params = msgspec.structs.replace(sub.params or SamplingParams(), structured=so)


def read_with_model(sub: Submit, spec: ToolSpec, tool_parser: Callable[[str], tuple[str | None, bool]]) -> None:
    """Once the request's model is known (``tool_parser``: its configured tool-call
    parser and whether ``auto`` parses calls): set them on ``spec`` and constrain
    ``auto`` as vLLM would (``constrain_auto``); the live ingress and a batch line
    alike.  RequestError: tools nested too deeply to write the tag."""
    spec.parser, spec.auto_enabled = tool_parser(sub.model)
    constrain_auto(sub, spec)


# ------------------------------------------------------------ output


class FunctionCall(msgspec.Struct, gc=False):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, gc=False):
    id: str
    type: str
    function: FunctionCall


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's make_tool_call_id


class ToolPiece(msgspec.Struct, gc=False):
    """A piece of one choice's output as it is read: content (``index`` -1)
    or a call's argument text; a call's first piece carries ``head`` (its
    id and name)."""

    index: int
    text: str
    head: ToolCall | None = None


_TAG = "<tool_call>"


class ChoiceToolStream:
    """One choice's output read as tool calls while it is generated.

    ``feed`` takes new text and returns the pieces it completes; ``finish``
    the rest.  A call is announced (id, name) the moment its name is complete
    and its arguments follow verbatim as they are generated:

    - named: the whole output is the call's arguments (announced with the
      first text that is not only whitespace);
    - required: the JSON array ``[{"name", "parameters"}, ...]``, read by
      ``CallScan``;
    - auto, hermes: content until ``<tool_call>`` (a partial tag held back),
      then each tag's ``{"name", "arguments"}`` object, as vLLM's hermes
      parser streams it;
    - auto, llama3_json: an output that begins with a call (``{`` or
      ``<|python_tag|>``) is read as ``;``-separated ``{"name", "arguments" |
      "parameters"}`` objects, each streamed as it forms (as vLLM's
      llama3_json parser streams them); any other output is content.

    Nothing is dropped: a call cut short (``max_tokens``) is the call as far
    as it was generated, and text in which no call could be read is content.
    ``calls`` and ``content`` are what was sent, so a whole response read
    through the same class (``extract_calls``) equals the streamed one.
    """

    __slots__ = ("spec", "text", "calls", "content", "sent", "scans", "seek", "tagged", "llama", "called")

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.text = ""
        self.calls: list[ToolCall] = []  # announced, with the arguments sent so far
        self.content: list[str] = []  # content sent
        self.sent = 0  # chars of text sent as content (auto)
        self.scans: list[CallScan] = []
        if spec.choice == "required":
            self.scans.append(CallScan(0, True, ("parameters",)))
        self.seek = 0  # hermes: where the next <tool_call> is looked for; llama3_json: the next call
        self.tagged = False  # hermes: a tag was seen (no more content)
        # llama3_json: None until the output shows whether it begins with a call, then "calls" or "content"
        self.llama: str | None = None
        self.called = False

    @property
    def _hermes(self) -> bool:
        return self.spec.choice == "auto" and self.spec.parser == "hermes"

    @property
    def _llama3_json(self) -> bool:
        return self.spec.choice == "auto" and self.spec.parser == "llama3_json"

    def feed(self, delta: str) -> list[ToolPiece]:
        """The pieces ``delta`` (new text) completes."""
        self.text += delta
        spec = self.spec
        out: list[ToolPiece] = []
        if spec.choice == "named":
            if not self.calls:
                if not self.text.strip():
                    return out  # leading whitespace: held until the call starts
                assert spec.named is not None
                self._announce(out, spec.named, self.text)
            else:
                self._args(out, 0, delta)
            return out
        if self._llama3_json:
            self._llama3_json_calls(out)
            if self.llama != "calls":
                return out
        elif self._hermes:
            self._hermes_regions(out)
        else:
            self.scans[0].scan(self.text)  # required
        self._read_spans(out)
        return out

    def finish(self) -> list[ToolPiece]:
        """The pieces still to send when the choice ends."""
        out: list[ToolPiece] = []
        if self.spec.choice != "named":
            self._read_spans(out)
            if not self.calls:  # no call could be read: the text is content (nothing dropped)
                self._content(out, self.text[self.sent :])
        self.called = bool(self.calls)
        return out

    # ---------------------------------------------------------------- parts

    def _content(self, out: list[ToolPiece], text: str) -> None:
        if text:
            self.content.append(text)
            out.append(ToolPiece(-1, text))
        self.sent += len(text)

    def _announce(self, out: list[ToolPiece], name: str, arguments: str) -> None:
        call = ToolCall(new_tool_call_id(), "function", FunctionCall(name, arguments))
        out.append(ToolPiece(len(self.calls), arguments, call))
        self.calls.append(call)

    def _args(self, out: list[ToolPiece], index: int, text: str) -> None:
        if text:
            f = self.calls[index].function
            f.arguments += text
            out.append(ToolPiece(index, text))

    def _hermes_regions(self, out: list[ToolPiece]) -> None:
        """Content before the first tag; a ``CallScan`` per tag."""
        text = self.text
        while True:
            scan = self.scans[-1] if self.scans and self.scans[-1].end is None else None
            if scan is None:
                at = text.find(_TAG, self.seek)
                if at < 0:
                    hold = tag_overlap(text, _TAG)
                    if not self.tagged:
                        self._content(out, text[self.sent : len(text) - hold])
                    self.seek = max(self.seek, len(text) - hold)
                    return
                if not self.tagged:
                    self._content(out, text[self.sent : at])
                    self.tagged = True
                scan = CallScan(at + len(_TAG), False, ("arguments",))
                self.scans.append(scan)
            scan.scan(text)
            if scan.end is None:
                return
            self.seek = scan.end

    def _llama3_json_calls(self, out: list[ToolPiece]) -> None:
        """llama3_json: content, or (output beginning with a call) a ``CallScan`` per object."""
        text = self.text
        if self.llama is None:
            stripped = text.lstrip()
            if not stripped or (_LLAMA_BOT.startswith(stripped) and len(stripped) < len(_LLAMA_BOT)):
                return  # leading whitespace, or maybe the tag: held until it is known
            if stripped.startswith(_LLAMA_BOT) or stripped.startswith("{"):
                self.llama = "calls"
                self.seek = len(text) - len(stripped) + (len(_LLAMA_BOT) if stripped[0] == "<" else 0)
            else:
                self.llama = "content"
        if self.llama == "content":
            self._content(out, text[self.sent :])
            return
        while True:
            scan = self.scans[-1] if self.scans and self.scans[-1].end is None else None
            if scan is None:
                i = self.seek
                while i < len(text) and (text[i].isspace() or text[i] == ";"):
                    i += 1  # between calls
                self.seek = i
                if i == len(text) or text[i] != "{" or (self.scans and self.scans[-1].cur is not None):
                    return  # more to come, or text after the calls (not sent, as vLLM), or a broken call
                scan = CallScan(i, False, ("arguments", "parameters"))
                self.scans.append(scan)
            scan.scan(text)
            if scan.end is None:
                return
            self.seek = scan.end

    def _read_spans(self, out: list[ToolPiece]) -> None:
        """Announce calls whose names are complete; send their new arguments."""
        text = self.text
        limit = None if self.spec.parallel else 1
        for k, span in enumerate(s for scan in self.scans for s in scan.spans):
            if limit is not None and k >= limit:
                break
            if k == len(self.calls):
                if span.name is None:
                    break  # calls come in order: none after this one is ready either
                self._announce(out, span.name, span.arguments(text))
            else:
                args = span.arguments(text)
                self._args(out, k, args[len(self.calls[k].function.arguments) :])


def extract_calls(spec: ToolSpec, text: str) -> tuple[str | None, list[ToolCall]]:
    """One choice's whole text -> (content, tool calls): the stream's reading
    of it (``ChoiceToolStream``), so streamed and whole responses agree."""
    if not spec.parses:
        return text, []
    s = ChoiceToolStream(spec)
    s.feed(text)
    s.finish()
    content = "".join(s.content)
    if s.calls and not content.strip():
        content = ""  # vLLM: no content beside calls when it is blank
    return content or None, s.calls


def tool_finish_reason(spec: ToolSpec, called: bool, finish: str | None) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when auto called a tool or
    required finished; a named call keeps the engine's; a call cut short
    keeps ``length``."""
    if finish != "stop":
        return finish
    if spec.choice in ("required", "auto") and called:
        return "tool_calls"
    return finish


def chat_deltas(pieces: list[ToolPiece]) -> list[dict[str, Any]]:
    """Pieces as chat ``delta`` bodies: the content, then one delta with every
    call entry (a call's first entry: index, id, type, name and arguments)."""
    out: list[dict[str, Any]] = []
    content = "".join(p.text for p in pieces if p.index < 0)
    if content:
        out.append({"content": content})
    entries: list[dict[str, Any]] = []
    for p in pieces:
        if p.index < 0:
            continue
        if p.head is not None:
            fn = {"name": p.head.function.name, "arguments": p.text}
            entries.append({"index": p.index, "id": p.head.id, "type": "function", "function": fn})
        elif entries and entries[-1]["index"] == p.index:
            entries[-1]["function"]["arguments"] += p.text
        else:
            entries.append({"index": p.index, "function": {"arguments": p.text}})
    if entries:
        out.append({"tool_calls": entries})
    return out


def unsupported_tool_choice(choice: str, parser: str | None, auto_enabled: bool) -> str | None:
    """Why a model cannot serve this tool choice (vLLM's 400s), or None.
    ``choice``: "none" / "auto" / "required" / "named"."""
    if parser is not None or choice == "none":
        return None
    if choice == "auto":
        return (
            '"auto" tool choice requires the model\'s tool_call_parser and enable_auto_tool_choice '
            "to be set (vLLM: --enable-auto-tool-choice and --tool-call-parser)"
        )
    what = "a named function" if choice == "named" else f'"{choice}"'
    return f"tool_choice={what} requires the model's tool_call_parser to be set (vLLM: --tool-call-parser)"
