"""``/v1/completions``: the request body, its parsing into a ``Submit``, and
the response's JSON shapes."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from router.api.context import ResponseContext, response_context
from router.api.errors import invalid, nesting_bounded
from router.api.prompt_forms import DEFAULT_MAX_PROMPTS, split_prompt
from router.api.request import RequestMeta, check_submit_shape, decode_body
from router.api.sampling import SamplingFields, common_fields
from router.api.usage import Usage
from shared.errors import Code
from shared.protocol import ErrorInfo, RequestKind, SamplingParams, Submit, TopLogprobs

# OpenAI's documented default for the legacy completions endpoint (vLLM uses
# it too); chat leaves max_tokens unset = the rest of the model's context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionRequest(SamplingFields, kw_only=True):
    # a string, or a list: of strings, of token ids, of token-id lists (router.api.prompt_forms)
    prompt: str | list[Any]
    logprobs: TopLogprobs | None = None
    echo: bool | None = False
    best_of: int | None = None  # accepted and ignored, as vLLM 0.32 does (docs/api.md)
    suffix: str | None = None
    return_token_ids: bool | None = None  # vLLM's: prompt_token_ids and token_ids on each choice
    prompt_logprobs: int | None = None  # vLLM's raw per-choice field: refused (echo + logprobs carries them)


_completion_decoder = msgspec.json.Decoder(CompletionRequest)


class CompletionJobs(NamedTuple):
    """A completion request as jobs: one ``Submit`` per prompt, each with
    ``n`` choices; the response numbers prompt ``i``'s choice ``j`` as
    ``i * n + j`` (vLLM's numbering).  ``ctx.n`` is the total."""

    subs: list[Submit]
    ctx: ResponseContext
    n: int
    # echo: each prompt's text, None for token ids (the ingress decodes them); [] without echo
    echoes: list[str | None]


@nesting_bounded
def parse_completions(
    body: bytes, meta: RequestMeta, request_id: str, max_prompts: int = DEFAULT_MAX_PROMPTS
) -> CompletionJobs:
    req = decode_body(_completion_decoder, body)
    prompts = split_prompt(req.prompt, max_prompts)
    if req.prompt_logprobs is not None:
        raise invalid(
            "prompt_logprobs is not supported by this server; use echo with logprobs",
            param="prompt_logprobs",
            code=Code.UNSUPPORTED_VALUE,
        )
    if req.suffix:
        raise invalid("suffix is not supported", param="suffix", code=Code.UNSUPPORTED_VALUE)
    params, task_type, priority = common_fields(req, meta, req.logprobs)
    echo_logprobs = bool(req.echo) and req.logprobs is not None
    if echo_logprobs:  # the prompt's tokens' logprobs too, as vLLM (the engine computes them)
        params = msgspec.structs.replace(params or SamplingParams(), prompt_logprobs=req.logprobs)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return_token_ids = bool(req.return_token_ids)
    # (as vLLM: with return_token_ids, echo leaves the prompt's text out -- its ids are there)
    echo = req.echo and not return_token_ids
    subs = []
    for i, prompt in enumerate(prompts):
        sub = Submit(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
            model=req.model,
            kind=RequestKind.COMPLETION,
            prompt=prompt if isinstance(prompt, str) else "",
            params=params,
            max_tokens=max_tokens,
            priority=priority,
            task_type=task_type,
            routing=meta.routing,
            api_key=meta.api_key,
            user=req.user,
            allow_fallback=bool(req.fallback) or meta.allow_fallback,
            prompt_token_ids=[] if isinstance(prompt, str) else prompt,
            return_token_ids=return_token_ids,
        )
        check_submit_shape(sub)
        subs.append(sub)
    echoes: list[str | None] = [p if isinstance(p, str) else None for p in prompts] if echo else []
    first = prompts[0]
    one_text = first if echo and len(prompts) == 1 and isinstance(first, str) else ""
    ctx = response_context(req, RequestKind.COMPLETION, request_id, req.logprobs, one_text)
    ctx.return_token_ids = return_token_ids
    n = ctx.n
    ctx.n = n * len(prompts)
    if echo_logprobs:
        ctx.echo_logprobs = n
    return CompletionJobs(subs, ctx, n, echoes)


def parse_completion(body: bytes, meta: RequestMeta, request_id: str) -> tuple[Submit, ResponseContext]:
    """A one-prompt completion (``parse_completions`` for any number)."""
    jobs = parse_completions(body, meta, request_id)
    if len(jobs.subs) != 1:
        raise invalid("expected one prompt", param="prompt")
    return jobs.subs[0], jobs.ctx


def echo_param(ctx: ResponseContext, err: ErrorInfo) -> ErrorInfo:
    """A job's error as its HTTP completion's client sees it: a worker refusing prompt logprobs
    names ``prompt_logprobs`` (SamplingParams'), which an HTTP client cannot send (refused above);
    with echo and logprobs, ``echo`` asked for them (logprobs alone are served)."""
    if ctx.echo_logprobs and err.param == "prompt_logprobs":
        return msgspec.structs.replace(err, param="echo")
    return err


# ------------------------------------------------------------ response shapes


class CompletionLogprobs(msgspec.Struct, gc=False):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, gc=False):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM puts the prompt's on each choice)
    token_ids: list[int] | None = None


class TextCompletion(msgspec.Struct, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
