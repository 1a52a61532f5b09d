"""Token usage: counted from a request's Deltas, rendered as OpenAI's ``usage``."""

from __future__ import annotations

import msgspec

from shared.protocol import Delta


class PromptTokensDetails(msgspec.Struct, frozen=True, gc=False):
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (vLLM's num_cached_tokens)


_NO_DETAILS = PromptTokensDetails()


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = _NO_DETAILS


def usage_of(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached) if cached else _NO_DETAILS)


class TokenCounts:
    """Usage from Deltas: the engine's prompt count (first/last Delta) and the
    cumulative completion count, falling back to summing ``num_tokens``."""

    __slots__ = ("prompt", "completion", "summed", "cached")

    def __init__(self) -> None:
        self.prompt = self.completion = self.summed = self.cached = 0

    def add(self, d: Delta) -> None:
        if d.prompt_tokens:
            self.prompt = d.prompt_tokens
            self.cached = d.cached_tokens
        if d.completion_tokens > self.completion:
            self.completion = d.completion_tokens
        self.summed += d.num_tokens

    @property
    def completion_total(self) -> int:
        return max(self.completion, self.summed)

    def usage(self) -> Usage:
        return usage_of(self.prompt, self.completion_total, self.cached)
