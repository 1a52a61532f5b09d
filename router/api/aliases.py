"""Model aliases (``[[aliases]]``): one public name over served models,
split by weight, with ordered fallbacks.  Pure: the lifecycle asks
``resolve`` which models to try, in order, for a request naming an alias.

The draw is by a stable hash of the request's session (so a session's turns
go to one target and find its cache there) or, without one, of its request
id: deterministic, so a split is reproducible in tests and replays."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from shared.config import AliasConfig


class AliasTable:
    __slots__ = ("by_name",)

    def __init__(self, aliases: Sequence[AliasConfig]) -> None:
        self.by_name = {a.name: a for a in aliases}

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.by_name)

    def configs(self) -> list[AliasConfig]:
        return list(self.by_name.values())

    def resolve(self, name: str, key: str, serves: Callable[[str], bool]) -> list[str] | None:
        """The models to try for alias ``name``, in order: the target drawn
        by ``key``'s hash, then the alias's fallbacks, each only if
        ``serves`` it now.  None: not an alias."""
        a = self.by_name.get(name)
        if a is None:
            return None
        chosen = pick(a, key)
        out = [chosen] if serves(chosen) else []
        for fb in a.fallbacks:
            if fb not in out and serves(fb):
                out.append(fb)
        return out


def pick(a: AliasConfig, key: str) -> str:
    """The target ``key`` draws: each target's share of keys is its weight's share."""
    total = sum(t.weight for t in a.targets)
    x = zlib.crc32(key.encode("utf-8", "surrogatepass")) / 2**32 * total  # [0, total)
    for t in a.targets:
        x -= t.weight
        if x < 0:
            return t.model
    return a.targets[-1].model
