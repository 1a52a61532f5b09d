"""A request's id and the ``ResponseContext`` its response is rendered with."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import msgspec

from router.api.sampling import SamplingFields
from shared.protocol import RequestKind


class ResponseContext(msgspec.Struct, gc=False):
    """What rendering a response needs to know about its request."""

    id: str
    kind: RequestKind
    model: str
    created: int
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # top-k per token (0: the token's own only); None: no logprobs
    echo: str = ""  # completions with echo: the prompt, prepended to each choice's text
    token_text: Any = None  # token id -> text (router.lifecycle.prompts.TokenText), set by the ingress
    request_id: str | None = None  # x-request-id, for an error event's body (set by the ingress)
    # Chat with tools (router.api.tools.ToolSpec): the output may become tool calls
    tools: Any = None
    # vLLM's return_token_ids: the prompt's ids (from the first Delta) and each choice's generated ids
    return_token_ids: bool = False
    # completions' echo with logprobs: each choice's logprobs start with its prompt's
    # (Delta.prompt_logprobs); the number of choices per prompt, 0 without
    echo_logprobs: int = 0

    @property
    def rich(self) -> bool:
        """Needs the general renderer (several choices, logprobs, echo, tools or token ids)."""
        return (
            self.n > 1
            or self.logprobs is not None
            or bool(self.echo)
            or self.tools is not None
            or self.return_token_ids
        )

    @property
    def fingerprint(self) -> str:
        return system_fingerprint(self.model)


_VERSION = "0.1.0"
_fingerprints: dict[str, str] = {}


def system_fingerprint(model: str) -> str:
    """OpenAI's ``system_fingerprint``: what served the request, as
    ``weir-<version>-<8 hex>`` (the hex: a hash of the weir version and the
    model's name); it changes when either does."""
    fp = _fingerprints.get(model)
    if fp is None:
        if len(_fingerprints) > 1024:  # model names come from requests: bounded
            _fingerprints.clear()
        digest = hashlib.blake2b(f"{_VERSION}\0{model}".encode(), digest_size=4).hexdigest()
        fp = _fingerprints[model] = f"weir-{_VERSION}-{digest}"
    return fp


_id_prefix = os.urandom(4).hex()
_id_counter = 0


def new_request_id() -> str:
    """Unique per process (random prefix + counter): cheap, and never collides
    with another router process's ids in logs."""
    global _id_counter
    _id_counter += 1
    return f"{_id_prefix}{_id_counter:x}"


def response_context(
    req: SamplingFields, kind: RequestKind, request_id: str, logprobs: int | None = None, echo: str = ""
) -> ResponseContext:
    prefix = "cmpl-" if kind == RequestKind.COMPLETION else "chatcmpl-"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ResponseContext(
        prefix + request_id,
        kind,
        req.model,
        int(time.time()),
        bool(req.stream),
        include_usage,
        req.n or 1,
        logprobs,
        echo,
    )
