"""Prompt text of a wanted length in tokens.

With a tokenizer (``tokenizer.json`` of the served model) the length is exact
up to BPE merges at the cut; without one, 4 characters per token -- the
estimate the router (for models without a tokenizer) and the sim engine both
use, so sim prompt lengths are exact too.  Every prompt is different so that
prefix caching cannot make later requests cheaper than the first.
"""

from __future__ import annotations

import random
from pathlib import Path

_WORDS = (
    "the of and to in is was for on that with as by at from his an were are which "
    "this be or had not but one first new has also they all their more who its "
    "after two other been time when there into would can over most she many some "
    "then only about year people out up may these such city later during under "
    "world three part while both well made since used known between before high "
    "through each long state where music north film river south team area set"
).split()


class PromptMaker:
    def __init__(self, tokenizer: str | None = None):
        self._tok = None
        if tokenizer:
            from tokenizers import Tokenizer

            p = Path(tokenizer)
            self._tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))

    def make(self, n_tokens: int, rng: random.Random) -> str:
        if self._tok is None:
            return " ".join(rng.choices(_WORDS, k=n_tokens))[: 4 * n_tokens].ljust(4 * n_tokens, ".")
        # Words tokenize to >= 1 token each: n words always give enough ids.
        ids = self._tok.encode(" ".join(rng.choices(_WORDS, k=n_tokens)), add_special_tokens=False).ids
        return self._tok.decode(ids[:n_tokens])
