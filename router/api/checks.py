"""What a request must satisfy that its wire types cannot say: its shape, and how many tokens it may generate.

Pure functions, the same for HTTP and direct ZeroMQ clients: the HTTP decoder
only turns JSON into a ``Submit``; ranges are enforced by the wire types
themselves (shared.protocol) and everything else here, once.
"""

from __future__ import annotations

from shared import protocol as p
from shared.errors import Code, context_length, error

# vLLM's threshold below which sampling is greedy (vllm.sampling_params._SAMPLING_EPS)
GREEDY_TEMPERATURE = 1e-5


def check_shape(sub: p.Submit) -> p.ErrorInfo | None:
    """What the wire types cannot say: the prompt a kind needs, fields that
    conflict.  (What depends on the model -- token ids, grammars -- is
    router.lifecycle.prompts' ``check``; min_tokens against max_tokens is
    ``resolve_max_tokens``'.)"""
    if sub.kind == p.RequestKind.CHAT and not sub.messages:
        return error(Code.BAD_REQUEST, "messages must be a non-empty list", param="messages")
    if sub.kind == p.RequestKind.COMPLETION and not sub.prompt and not sub.prompt_token_ids:
        return error(Code.BAD_REQUEST, "prompt must be a non-empty string", param="prompt")
    if sub.kind == p.RequestKind.EMBEDDING:
        if not sub.prompt and not sub.prompt_token_ids:
            return error(Code.BAD_REQUEST, "input must not be empty", param="input")
        if sub.prompt and sub.prompt_token_ids:
            return error(Code.BAD_REQUEST, "input is either text or token ids, not both", param="input")
    else:
        if sub.dimensions is not None:
            return error(Code.BAD_REQUEST, "dimensions is for embedding requests", param="dimensions")
        if sub.prompt_token_ids and (sub.prompt or sub.kind != p.RequestKind.COMPLETION):
            return error(
                Code.BAD_REQUEST, "prompt_token_ids is for a completion without prompt", param="prompt_token_ids"
            )
    params = sub.params
    if params is not None and params.n > 1 and params.temperature < GREEDY_TEMPERATURE:
        # vLLM refuses it too ("n must be 1 when using greedy sampling"): n copies of one answer
        return error(
            Code.BAD_REQUEST, f"n must be 1 when using greedy sampling (temperature 0); got n={params.n}", param="n"
        )
    return None


def resolve_max_tokens(sub: p.Submit, prompt_tokens: int, max_model_len: int) -> int | p.ErrorInfo:
    """The one resolution of how many tokens a request may generate:
    ``Submit.max_tokens``, else the rest of the context.  The prompt plus
    that must fit the context (the error names the numbers)."""
    if sub.kind == p.RequestKind.EMBEDDING:  # prefill only: nothing is generated
        if prompt_tokens > max_model_len:
            return error(
                Code.CONTEXT_LENGTH,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens} tokens in the input for embedding generation. Please reduce the length "
                f"of the input.",
                param="input",
            )
        return 0
    max_tokens = sub.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - prompt_tokens
    if max_tokens < 1 or prompt_tokens + max_tokens > max_model_len:
        return context_length(max_model_len, prompt_tokens, max(max_tokens, 1))
    if sub.params is not None and sub.params.min_tokens > max_tokens:
        return error(
            Code.BAD_REQUEST,
            f"min_tokens ({sub.params.min_tokens}) must be at most max_tokens ({max_tokens})",
            param="min_tokens",
        )
    return max_tokens
