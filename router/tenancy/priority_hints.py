"""Gateway priorities (shared.protocol.PriorityHint, an objective's name) to
a scheduler class rank.  Pure; router.tenancy.identity applies the result,
which can only lower the key's class: the least urgent of them all wins."""

from __future__ import annotations

from collections.abc import Mapping

from shared.protocol import Routing

TOP, DEFAULT, BOTTOM = 0, 1, 2  # (router.api.agent_headers' anchors)


def hinted_rank(routing: Routing, rank: Mapping[str, int], default_rank: int) -> int:
    """The least urgent class rank ``routing`` asks for (-1: none).  An
    objective that names no class is not a priority here (llm-d's objectives
    are objects of its own) and is left alone."""
    last = len(rank) - 1
    worst = -1
    for h in routing.hints:
        base = 0 if h.anchor == TOP else (default_rank if h.anchor == DEFAULT else last)
        r = min(last, max(0, base + h.offset))
        if r > worst:
            worst = r
    named = rank.get(routing.objective) if routing.objective else None
    if named is not None and named > worst:
        worst = named
    return worst
