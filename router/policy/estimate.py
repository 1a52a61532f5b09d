"""Token costs for admission: prompt estimates (models without a tokenizer) and KV cost.

A model with a tokenizer is counted exactly (``router.lifecycle.prompts``).  Without
one -- the simulated engine -- a prompt is UTF-8 bytes / 4 (a rough, usually
pessimistic-for-English guess), and a chat the sum of its contents plus a
small per-message overhead for the template's role markers.  The router's
count is what the worker is told, so the simulated engine prices a prompt
exactly as admission did: no correction round trip.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.protocol import ChatMessage

CHARS_PER_TOKEN = 4  # fallback: UTF-8 bytes per token
CHAT_TOKENS_PER_MESSAGE = 4  # role marker + separators around each message
CHAT_REPLY_PRIMER = 3  # the generation prompt ("<|assistant|>\n" and the like)


def kv_cost(prompt_tokens: int, max_tokens: int, block_size: int, n: int = 1, shared_prompt: bool = False) -> int:
    """KV tokens a request can occupy at most: prompt + every token it may
    generate, rounded up to whole KV blocks (engines allocate by block), for
    each of its ``n`` sequences.

    ``shared_prompt`` (the engine caches prefixes, as vLLM does by default):
    the n sequences share the prompt's full blocks -- all but the block of
    its last token, which vLLM always computes anew (a cache hit stops one
    token short of the prompt) -- so those are counted once.  Measured on
    vLLM 0.32 (CPU, block 128): a 130-token prompt, max_tokens 30, n=4 peaked
    at 5 blocks (1 shared + 4), n=1 at 2; without sharing it would be 8."""
    # (conditionals, not max(): this runs at every admission and placement)
    prompt = prompt_tokens if prompt_tokens > 1 else 1
    mt = max_tokens if max_tokens > 0 else 0
    bs = block_size if block_size > 1 else 1
    if n <= 1:
        return -(-(prompt + mt) // bs) * bs
    shared = ((prompt - 1) // bs) * bs if shared_prompt else 0
    return shared + n * (-(-(prompt - shared + mt) // bs) * bs)


def estimate_text(text: str) -> int:
    return -(-len(text.encode("utf-8", "surrogatepass")) // CHARS_PER_TOKEN)


def estimate_chat(messages: Iterable[ChatMessage]) -> int:
    n = CHAT_REPLY_PRIMER
    for m in messages:
        n += CHAT_TOKENS_PER_MESSAGE + estimate_text(m.content)
    return n
