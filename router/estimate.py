"""Token-cost estimates for admission: how many prompt tokens, and how much KV.

The router must price a request before any engine has seen it.  Prompt tokens
come from the model's own tokenizer (``tokenizer.json`` through the
``tokenizers`` library, exact for completions) when the model directory has
one; otherwise from UTF-8 bytes / 4 (a rough, usually pessimistic-for-English
guess).  Chat prompts are the sum of the message contents plus a small
per-message overhead for the chat template's role markers, so they are an
estimate either way.

Either way the estimate is provisional: the worker reports the engine's exact
prompt count on the request's first output, and the router then calls
``Policy.correct_prompt_tokens`` so that the KV reservation matches reality.
"""

from __future__ import annotations

import os
from typing import Optional

from shared.protocol import RequestKind, Submit

CHARS_PER_TOKEN = 4  # fallback: UTF-8 bytes per token
CHAT_TOKENS_PER_MESSAGE = 4  # role marker + separators around each message
CHAT_REPLY_PRIMER = 3  # the generation prompt ("<|assistant|>\n" and the like)


def kv_cost(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV tokens a request can occupy at most: prompt + every token it may
    generate, rounded up to whole KV blocks (engines allocate by block)."""
    tokens = max(1, prompt_tokens) + max(0, max_tokens)
    bs = max(1, block_size)
    return -(-tokens // bs) * bs


class PromptEstimator:
    """Counts prompt tokens for one model.  ``model_dir`` may be None (no
    tokenizer: bytes/4 is used)."""

    def __init__(self, model_dir: Optional[str] = None) -> None:
        self.tokenizer = None
        if model_dir:
            path = os.path.join(model_dir, "tokenizer.json")
            if os.path.isfile(path):
                from tokenizers import Tokenizer  # imported lazily: only models with a tokenizer need it

                self.tokenizer = Tokenizer.from_file(path)

    @property
    def exact(self) -> bool:
        """True when completions are counted by the model's tokenizer."""
        return self.tokenizer is not None

    def count_text(self, text: str, add_special_tokens: bool = True) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        return -(-len(text.encode("utf-8", "surrogatepass")) // CHARS_PER_TOKEN)

    def count_chat(self, messages) -> int:
        """Estimate for a chat prompt: contents + per-message template overhead."""
        n = CHAT_REPLY_PRIMER
        for m in messages:
            n += CHAT_TOKENS_PER_MESSAGE + self.count_text(m.content, add_special_tokens=False)
        return n

    def count(self, sub: Submit) -> int:
        """Prompt tokens of a Submit (at least 1: engines reject empty prompts)."""
        if sub.kind == RequestKind.CHAT:
            n = self.count_chat(sub.messages)
        else:
            n = self.count_text(sub.prompt)
        return max(1, n)
