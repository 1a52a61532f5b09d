"""``metadata`` on Responses and batches: OpenAI's limits, so a tenant
cannot make every stored object carry an unbounded map.

At most 16 pairs; keys at most 64 characters, values at most 512, both
strings (the decoders' types already refuse anything else).
"""

from __future__ import annotations

MAX_PAIRS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512


def metadata_problem(metadata: dict[str, str] | None) -> str | None:
    """Why ``metadata`` is refused (the message of a 400 with ``param: metadata``), or None."""
    if metadata is None:
        return None
    if len(metadata) > MAX_PAIRS:
        return f"metadata may have at most {MAX_PAIRS} key-value pairs; got {len(metadata)}"
    for k, v in metadata.items():
        if len(k) > MAX_KEY_CHARS:
            return f"metadata keys may be at most {MAX_KEY_CHARS} characters; {k[:MAX_KEY_CHARS]!r}... is {len(k)}"
        if len(v) > MAX_VALUE_CHARS:
            return f"metadata values may be at most {MAX_VALUE_CHARS} characters; the value of {k!r} is {len(v)}"
    return None
