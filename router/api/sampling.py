"""The body fields every generation endpoint shares, and their mapping to the
wire's ``SamplingParams``, task type and priority.

Ranges are the wire protocol's own types (shared.protocol): declared once.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from router.api.agent_headers import vllm_priority, with_hint
from router.api.errors import invalid
from router.api.request import TASK_TYPES, RequestMeta
from shared.errors import Code
from shared.protocol import (
    LogitBias,
    MinP,
    N,
    NonNegativeInt,
    Penalty,
    PositiveInt,
    RepetitionPenalty,
    SamplingParams,
    Seed,
    StopList,
    StopTokenIds,
    StructuredOutput,
    TaskType,
    Temperature,
    TopK,
    TopP,
    User,
)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: msgspec.Raw = msgspec.Raw()  # kept as the client's JSON text (msgspec: Raw is never Optional)
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` field (its other options are ignored;
    ``disable_any_whitespace`` is honoured for json and json_object)."""

    json: msgspec.Raw = msgspec.Raw()
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints.  Unknown fields are ignored (as
    OpenAI does); known ones weir cannot honour are refused, not dropped."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: N | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | StopList | None = None
    seed: Seed | None = None
    user: User | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool | None = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's sampling extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegativeInt | None = None
    stop_token_ids: StopTokenIds | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: msgspec.Raw = msgspec.Raw()  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # weir extensions
    # a scheduler class, or vLLM's/LiteLLM's integer (lower first: the class at
    # that rank, router.api.agent_headers.vllm_priority); may only lower the key's
    priority: str | int | None = None
    task_type: Literal["short", "long"] | None = None
    fallback: bool | None = None  # another configured model may answer (or header x-weir-allow-fallback)


def _given(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


def _raw_text(raw: msgspec.Raw) -> str:
    """A JSON schema as text: an object as the client wrote it, a string's content."""
    data = bytes(raw)
    if data[:1] == b'"':
        return msgspec.json.decode(data, type=str)
    return data.decode()


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    """response_format, vLLM's structured_outputs or its guided_* fields -> one
    StructuredOutput (exactly one constraint; router.lifecycle.prompts compiles it)."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutput(json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or not _given(rf.json_schema.schema):
                raise invalid(
                    "response_format of type json_schema needs json_schema.schema", param="response_format.json_schema"
                )
            found.append(("response_format", StructuredOutput(json=_raw_text(rf.json_schema.schema))))
        else:
            raise invalid(
                f"response_format type {rf.type!r} is not supported (text, json_object, json_schema)",
                param="response_format.type",
                code=Code.UNSUPPORTED_VALUE,
            )
    so = req.structured_outputs
    if so is not None:
        found.append(
            (
                "structured_outputs",
                StructuredOutput(
                    json=_raw_text(so.json) if _given(so.json) else None,
                    json_object=bool(so.json_object),
                    regex=so.regex,
                    choice=so.choice or [],
                    grammar=so.grammar,
                    disable_any_whitespace=so.disable_any_whitespace,
                ),
            )
        )
    if _given(req.guided_json):
        found.append(("guided_json", StructuredOutput(json=_raw_text(req.guided_json))))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput(regex=req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput(choice=req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput(grammar=req.guided_grammar)))
    if not found:
        return None
    if len(found) > 1:
        raise invalid(
            f"Only one structured-output constraint per request; got {', '.join(n for n, _ in found)}",
            param=found[1][0],
        )
    return found[0][1]


def common_fields(
    req: SamplingFields, meta: RequestMeta, logprobs: int | None = None
) -> tuple[SamplingParams | None, TaskType, str | None]:
    """The shared fields as the wire has them: sampling params (None when all
    are defaults), the task type and the requested priority class."""
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    if req.stop is None:
        stop: list[str] = []
    elif isinstance(req.stop, str):
        stop = [req.stop]
    else:
        stop = req.stop
    # Only fields the client set: an unset one keeps the wire default (omitted on the wire).
    kw: dict[str, Any] = {}
    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        kw["top_p"] = req.top_p
    if req.seed is not None:
        kw["seed"] = req.seed
    if stop:
        kw["stop"] = stop
    if req.ignore_eos:
        kw["ignore_eos"] = True
    if req.presence_penalty:
        kw["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        kw["frequency_penalty"] = req.frequency_penalty
    if req.n is not None and req.n != 1:
        kw["n"] = req.n
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if req.top_k is not None and req.top_k not in (0, -1):
        kw["top_k"] = req.top_k
    if req.min_p:
        kw["min_p"] = req.min_p
    if req.repetition_penalty is not None and req.repetition_penalty != 1.0:
        kw["repetition_penalty"] = req.repetition_penalty
    if req.min_tokens:
        kw["min_tokens"] = req.min_tokens
    if req.stop_token_ids:
        kw["stop_token_ids"] = req.stop_token_ids
    if req.logit_bias:
        kw["logit_bias"] = req.logit_bias
    structured = structured_output(req)
    if structured is not None:
        kw["structured"] = structured
    params = SamplingParams(**kw) if kw else None  # max_tokens: the router sets it
    task_type: TaskType | None
    if req.task_type is not None:
        task_type = TASK_TYPES[req.task_type]
    elif meta.task_type is not None:
        task_type = TASK_TYPES.get(meta.task_type.strip().lower())
        if task_type is None:
            raise invalid("x-weir-task-type must be 'short' or 'long'", param="x-weir-task-type")
    else:
        task_type = TaskType.AUTO
    priority = req.priority
    if isinstance(priority, int):
        meta.routing = with_hint(meta.routing, vllm_priority(priority))
        priority = None
    return params, task_type, priority or meta.priority
