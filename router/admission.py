"""What a request must satisfy before it may queue: shape, key, priority, length.

Pure functions, the same for HTTP and direct ZeroMQ clients: the HTTP
decoder (router.openai_api) only turns JSON into a ``Submit``; ranges are
enforced by the wire types themselves (shared.protocol) and everything else
here, once.
"""

from __future__ import annotations

from typing import NamedTuple

from shared import protocol as p
from shared.config import ApiKey, Config
from shared.errors import Code, context_length, error
from shared.keys import config_digest, digest, key_id, well_formed

ANONYMOUS_TENANT = "anonymous"
DEFAULT_TIER = "normal"


# vLLM's threshold below which sampling is greedy (vllm.sampling_params._SAMPLING_EPS)
GREEDY_TEMPERATURE = 1e-5


def check_shape(sub: p.Submit) -> p.ErrorInfo | None:
    """What the wire types cannot say: the prompt a kind needs, fields that
    conflict.  (What depends on the model -- token ids, grammars -- is
    router.prompts' ``check``; min_tokens against max_tokens is
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


def malformed_key() -> p.ErrorInfo:
    return error(
        Code.INVALID_API_KEY,
        "Malformed API key: a key is printable ASCII without spaces (surrounding spaces and tabs are ignored).",
    )


class Identity(NamedTuple):
    tenant: str
    klass: str  # the scheduler class the request runs in
    weight: float  # its tenant's fair-share weight
    key_id: str = ""  # the API key's public name (shared.keys.key_id); "" without keys


class Keys:
    """API keys -> tenant and tier; a client may lower its priority, never raise it.
    Keys are looked up by their SHA-256 (the config holds only that, or a
    plain key that is hashed here): no key text is kept."""

    def __init__(self, cfg: Config) -> None:
        self.by_key: dict[str, ApiKey] = {config_digest(k): k for k in cfg.api_keys}
        self.rank = {c.name: i for i, c in enumerate(cfg.scheduler.classes)}
        self.default_tier = DEFAULT_TIER if DEFAULT_TIER in self.rank else cfg.scheduler.classes[0].name

    def identify(self, sub: p.Submit) -> Identity | p.ErrorInfo:
        kid = ""
        if sub.api_key and not well_formed(sub.api_key):  # keys or not: the rule Envoy applies (shared.keys)
            return malformed_key()
        if self.by_key:
            h = digest(sub.api_key) if sub.api_key else ""
            key = self.by_key.get(h)
            if key is None:
                return error(Code.INVALID_API_KEY, "Incorrect API key provided.")
            tenant, tier, weight, kid = key.tenant, key.tier, key.weight, key_id(h)
        else:
            tenant, tier, weight = ANONYMOUS_TENANT, self.default_tier, 1.0
        klass = tier
        if sub.priority is not None:
            rank = self.rank.get(sub.priority)
            if rank is None:
                return error(
                    Code.BAD_REQUEST,
                    f"Unknown priority {sub.priority!r}; one of {', '.join(self.rank)}.",
                    param="priority",
                )
            if rank > self.rank[tier]:
                klass = sub.priority
        return Identity(tenant, klass, weight, kid)


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
