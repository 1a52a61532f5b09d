"""Token costs for admission: prompt estimates (models without a tokenizer) and KV cost.

A model with a tokenizer is counted exactly (``router.prompts``).  Without
one -- the simulated engine -- a prompt is UTF-8 bytes / 4 (a rough, usually
pessimistic-for-English guess), and a chat the sum of its contents plus a
small per-message overhead for the template's role markers.  The router's
count is what the worker is told, so the simulated engine prices a prompt
exactly as admission did: no correction round trip.
"""

from __future__ import annotations

CHARS_PER_TOKEN = 4  # fallback: UTF-8 bytes per token
CHAT_TOKENS_PER_MESSAGE = 4  # role marker + separators around each message
CHAT_REPLY_PRIMER = 3  # the generation prompt ("<|assistant|>\n" and the like)


def kv_cost(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV tokens a request can occupy at most: prompt + every token it may
    generate, rounded up to whole KV blocks (engines allocate by block)."""
    tokens = max(1, prompt_tokens) + max(0, max_tokens)
    bs = max(1, block_size)
    return -(-tokens // bs) * bs


def estimate_text(text: str) -> int:
    return -(-len(text.encode("utf-8", "surrogatepass")) // CHARS_PER_TOKEN)


def estimate_chat(messages) -> int:
    n = CHAT_REPLY_PRIMER
    for m in messages:
        n += CHAT_TOKENS_PER_MESSAGE + estimate_text(m.content)
    return n
