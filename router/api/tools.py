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
- ``extract_calls``: the generated text of one choice -> content and
  ``ToolCall``s (required: a JSON array of ``{name, parameters}``; named: the
  arguments themselves; auto: the model's own format, router.api.tool_parsers);
- ``ChoiceToolStream``: the same while streaming, as OpenAI's tool-call deltas;
- ``tool_finish_reason``: OpenAI's ``tool_calls`` finish reason where it applies.

What the model itself decides -- whether its config names a tool-call parser
-- is checked where the request meets its model (router.lifecycle.prompts), before
anything is reserved.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from router.api.errors import invalid
from router.api.tool_parsers import AutoStream, ParsedCall, extract
from shared.protocol import StructuredOutput

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
    return None if schema is None else StructuredOutput(json=json.dumps(schema, ensure_ascii=False))


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


def _to_tool_calls(calls: list[ParsedCall], parallel: bool) -> list[ToolCall]:
    if not parallel:
        calls = calls[:1]
    return [ToolCall(new_tool_call_id(), "function", FunctionCall(c.name, c.arguments)) for c in calls]


def _required_calls(text: str) -> list[ParsedCall]:
    """``required`` output: a JSON array of ``{"name", "parameters"}`` (vLLM
    validates it as ``list[FunctionDefinition]``; anything else: no calls)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return []
        params = it.get("parameters")
        if params is not None and not isinstance(params, dict):
            return []
        calls.append(ParsedCall(it["name"], json.dumps(params, ensure_ascii=False)))
    return calls


def extract_calls(spec: ToolSpec, text: str) -> tuple[str | None, list[ToolCall]]:
    """One choice's whole text -> (content, tool calls), as vLLM's chat endpoint."""
    if spec.choice == "named":
        if not text.strip():
            return None, []
        assert spec.named is not None
        return None, _to_tool_calls([ParsedCall(spec.named, text)], True)
    if spec.choice == "required":
        return None, _to_tool_calls(_required_calls(text), spec.parallel)
    if spec.parses:
        assert spec.parser is not None
        calls, content = extract(spec.parser, text)
        if content is not None and not content.strip() and calls:
            content = None
        return content, _to_tool_calls(calls, spec.parallel)
    return text, []


def tool_finish_reason(spec: ToolSpec, called: bool, finish: str | None) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when auto called a tool or
    required finished; a named call keeps the engine's."""
    if finish is None or finish == "abort":
        return finish
    if spec.choice == "required" and finish == "stop":
        return "tool_calls"
    if spec.choice == "auto" and called:
        return "tool_calls"
    return finish


class ChoiceToolStream:
    """One streamed choice's tool calls, as OpenAI's ``delta.tool_calls``.

    Named: the call's header at once, then the arguments as they are made.
    Auto: content streams until a call may start (router.api.tool_parsers);
    required and auto calls are sent whole, each as one delta, at the end.
    """

    __slots__ = ("spec", "text", "auto", "named_id", "called")

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.text = ""
        self.auto = AutoStream(spec.parser) if spec.choice == "auto" and spec.parses and spec.parser else None
        self.named_id: str | None = None
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Delta bodies (``{"content": ...}`` / ``{"tool_calls": [...]}``) for new text."""
        spec = self.spec
        if spec.choice == "named":
            out: list[dict[str, Any]] = []
            if self.named_id is None and (self.text + text).strip():
                self.named_id = new_tool_call_id()
                self.called = True
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": self.named_id,
                                "type": "function",
                                "function": {"name": spec.named, "arguments": ""},
                            }
                        ]
                    }
                )
                text = self.text + text  # leading whitespace held until now
                self.text = ""
            elif self.named_id is None:
                self.text += text
                return out
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self.auto is not None:
            content = self.auto.feed(text)
            return [{"content": content}] if content else []
        self.text += text  # required: parsed whole at the end
        return []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still to send when the choice ends."""
        spec = self.spec
        if spec.choice == "named":
            return []
        out: list[dict[str, Any]] = []
        if self.auto is not None:
            parsed, rest = self.auto.finish()
            if rest and (not parsed or rest.strip()):
                out.append({"content": rest})
            calls = _to_tool_calls(parsed, spec.parallel)
        else:
            calls = _to_tool_calls(_required_calls(self.text), spec.parallel)
        for i, c in enumerate(calls):
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments},
                        }
                    ]
                }
            )
        self.called = bool(calls)
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
