"""The engine's prefix-cache block hashes, computed in the router -- bit for bit.

vLLM (0.32, ``vllm/v1/core/kv_cache_utils.py``) names each full block of a
prompt by a hash chained over the blocks before it::

    h_0 = H(seed)                                   # NONE_HASH
    h_i = H((h_{i-1}, tuple(block_i_token_ids), extra_keys_i))
    published = int.from_bytes(h_i, "big") & (2**64 - 1)

with ``H`` = sha256 of the pickled tuple ("sha256", vLLM's default) or of its
canonical CBOR ("sha256_cbor"), and the seed PYTHONHASHSEED or the fixed
"vllm-none-hash".  The same few lines here (no vLLM import: the router stays
light) give the hashes its KV events carry, which a test checks against the
real engine (tests/e2e/test_engine_vllm.py::
test_router_block_hashes_equal_the_engines_kv_events).  ``extra_keys`` are
None unless a request has a LoRA, multimodal input, prompt embeddings or a ``cache_salt``;
weir sends none of these, so every block's extra keys are None -- the
hasher takes a first-block key anyway (vLLM puts ``("cache_salt", salt)``
there), tested against vLLM's own function.

xxhash variants are not reproduced: vLLM seeds them with per-process random
bytes unless PYTHONHASHSEED is set, so no other process can match them; a
worker using one is routed cache-blind.

"sim": the simulated engine has no token ids (the router counts its prompts
as UTF-8 bytes / 4), so its blocks are named by a chained 64-bit BLAKE2b over
``4 x block_size`` bytes of the prompt text -- the same cost model, not vLLM's
function.

Cost (measured here): ~6 us per 128-token block with sha256 (pickle + digest),
so a 32k-token prompt's 256 blocks take ~1.5 ms -- done on the tokenizing
thread with the tokenizing, never on the loop for long prompts.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED
SIM = "sim"
_MASK64 = (1 << 64) - 1
_PROTO = pickle.HIGHEST_PROTOCOL


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTO)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # (vLLM's dependency; only needed for this algorithm)

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}
SUPPORTED = frozenset((*_FUNCTIONS, SIM))


class BlockHasher:
    """One engine's scheme: hash function, seed, block size.  Immutable, so
    the tokenizing thread may use it."""

    __slots__ = ("algo", "seed", "block_size", "_fn", "_none")

    def __init__(self, algo: str, block_size: int, seed: str = "") -> None:
        if algo not in SUPPORTED:
            raise ValueError(f"unsupported prefix hash {algo!r} (supported: {sorted(SUPPORTED)})")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.algo = algo
        self.seed = seed or DEFAULT_SEED
        self.block_size = block_size
        if algo == SIM:
            self._fn = None
            self._none = hashlib.blake2b(self.seed.encode(), digest_size=8).digest()
        else:
            self._fn = _FUNCTIONS[algo]
            self._none = self._fn(self.seed)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.algo, self.seed, self.block_size

    def hashes(
        self,
        token_ids: Sequence[int],
        first_extra: tuple[object, ...] | None = None,
        every_extra: tuple[object, ...] | None = None,
    ) -> list[int]:
        """The published 64-bit hash of each full block of ``token_ids``.
        ``every_extra``: extra keys of every block (vLLM's LoRA key, ``lora_extra``),
        ahead of ``first_extra`` on the first block (its cache salt), as vLLM orders them."""
        fn = self._fn
        if fn is None:
            raise ValueError("the sim scheme hashes text (text_hashes)")
        bs = self.block_size
        parent = self._none
        out = []
        extra = (every_extra or ()) + (first_extra or ()) or None
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = fn((parent, tuple(token_ids[start : start + bs]), extra))
            extra = every_extra
            out.append(int.from_bytes(parent, "big") & _MASK64)
        return out

    def text_hashes(self, text: str, count: int) -> list[int]:
        """The sim scheme: blocks of ``count`` estimated tokens (UTF-8 bytes / 4)."""
        data = text.encode()
        span = 4 * self.block_size
        parent = self._none
        out = []
        for i in range(min(count // self.block_size, len(data) // span)):  # (only blocks of real text)
            parent = hashlib.blake2b(parent + data[i * span : (i + 1) * span], digest_size=8).digest()
            out.append(int.from_bytes(parent, "big"))
        return out


def lora_extra(name: str, path: str) -> tuple[tuple[str, str, str]]:
    """vLLM's extra key of every block computed under a LoRA adapter (its
    ``_gen_lora_extra_hash_keys``: name and path): blocks of one adapter never
    match another's or the base model's."""
    return (("lora", name, path),)
