"""``/v1/completions``: the request body, its parsing into a ``Submit``, and
the response's JSON shapes."""

from __future__ import annotations

from typing import Any

import msgspec

from router.openai_api.context import ResponseContext, response_context
from router.openai_api.errors import invalid
from router.openai_api.request import RequestMeta, check_submit_shape, decode_body
from router.openai_api.sampling import SamplingFields, common_fields
from router.openai_api.usage import Usage
from shared.errors import Code
from shared.protocol import RequestKind, Submit, TopLogprobs

# OpenAI's documented default for the legacy completions endpoint (vLLM uses
# it too); chat leaves max_tokens unset = the rest of the model's context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # list: validated below (one string only)
    logprobs: TopLogprobs | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool | None = None  # vLLM's: prompt_token_ids and token_ids on each choice


_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def parse_completion(body: bytes, meta: RequestMeta, request_id: str) -> tuple[Submit, ResponseContext]:
    req = decode_body(_completion_decoder, body)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif prompt and all(isinstance(p, str) for p in prompt):
            raise invalid("Only one prompt per request is supported", param="prompt", code=Code.UNSUPPORTED_VALUE)
        else:
            raise invalid(
                "prompt must be a string (token-id prompts are not supported)",
                param="prompt",
                code=Code.UNSUPPORTED_VALUE,
            )
    if req.echo and req.logprobs is not None:
        # OpenAI then also returns the prompt's logprobs; weir does not compute those
        raise invalid(
            "echo together with logprobs is not supported (prompt logprobs)", param="echo", code=Code.UNSUPPORTED_VALUE
        )
    if req.best_of not in (None, 1):
        raise invalid("best_of is not supported", param="best_of", code=Code.UNSUPPORTED_VALUE)
    if req.suffix:
        raise invalid("suffix is not supported", param="suffix", code=Code.UNSUPPORTED_VALUE)
    params, task_type, priority = common_fields(req, meta, req.logprobs)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sub = Submit(
        request_id=request_id,
        model=req.model,
        kind=RequestKind.COMPLETION,
        prompt=prompt,
        params=params,
        max_tokens=max_tokens,
        priority=priority,
        task_type=task_type,
        api_key=meta.api_key,
        user=req.user,
        allow_fallback=bool(req.fallback) or meta.allow_fallback,
        return_token_ids=bool(req.return_token_ids),
    )
    check_submit_shape(sub)
    # (as vLLM: with return_token_ids, echo leaves the prompt's text out -- its ids are there)
    echo = prompt if req.echo and not sub.return_token_ids else ""
    ctx = response_context(req, RequestKind.COMPLETION, request_id, req.logprobs, echo)
    ctx.return_token_ids = sub.return_token_ids
    return sub, ctx


# ------------------------------------------------------------ response shapes


class CompletionLogprobs(msgspec.Struct, gc=False):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, gc=False):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM puts the prompt's on each choice)
    token_ids: list[int] | None = None


class Completion(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
