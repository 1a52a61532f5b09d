"""What one long prompt costs the router, step by step, in one process.

A 220 KB prompt (``--kb``) of the long-prompts burst, tiny-llama's
tokenizer: tokenizing, block hashes (vLLM's sha256 and the simulated
engine's scheme, 16 tokens a block), the prefix index's match (a miss, a
full hit) and speculation, msgpack-encoding its ids for the worker (on the
loop, and as the tokenizer thread does it), the worker decoding them, and
freeing the ids.  And in a burst (``--burst``, 150): the index's speculation,
match and expiry of one prompt while that many other distinct prompts are
speculative within the TTL (their block hashes random 64-bit ints).
Medians of a few runs, in ms; which of them run on the event loop is in
docs/scheduling.md (Long prompts).

    python -m bench.scenarios.long_prompt_costs [--kb 220] [--burst 150]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bench.scenarios import common
from bench.scenarios.long_prompts_burst import prompts


def _median_ms(fn: Callable[[Any], object], setup: Callable[[], Any] = lambda: None, n: int = 7) -> float:
    xs = []
    for _ in range(n):
        arg = setup()
        t0 = time.perf_counter()
        fn(arg)
        xs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(xs)


def _in_burst(hashes: list[int], others: int, n: int = 5) -> list[tuple[str, float]]:
    """Speculating, matching (a full hit) and expiring one prompt of ``hashes``' length while
    ``others`` distinct prompts are speculative: speculated 10 ms apart, so that a match just
    past the first's expiry expires that one only."""
    from router.fleet.prefix_index import PrefixIndex

    rng = random.Random(1)
    burst = [[rng.getrandbits(64) for _ in hashes] for _ in range(others)]
    sp, hit, ex = [], [], []
    for _ in range(n):
        ix = PrefixIndex(speculative_ttl_s=2.0)
        for w in ("w0", "w1", "w2"):
            ix.add_worker(w, "m", "sim", 16)
            ix.snapshot(w, 0, [])
        for i, hs in enumerate(burst):
            ix.speculate(f"w{i % 2}", hs, 1.0 + i * 0.01)
        now = 1.0 + others * 0.01
        t0 = time.perf_counter()
        ix.speculate("w2", hashes, now)
        t1 = time.perf_counter()
        ix.match("m", hashes, now)
        t2 = time.perf_counter()
        ix.match("m", hashes[:1], 3.0)  # past the first prompt's expiry (3.0): it goes
        t3 = time.perf_counter()
        sp.append(t1 - t0)
        hit.append(t2 - t1)
        ex.append(t3 - t2)
    k = len(hashes)
    return [
        (f"  speculate ({k} blocks), {others} others live", statistics.median(sp) * 1e3),
        (f"  match, a full hit ({k} blocks), {others} live", statistics.median(hit) * 1e3),
        (f"  expire one prompt ({k} blocks), {others} live", statistics.median(ex) * 1e3),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.scenarios.long_prompt_costs", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--kb", type=int, default=220)
    ap.add_argument("--burst", type=int, default=150, help="prompts speculative at once, for the in-burst rows")
    args = ap.parse_args(argv)
    from router.fleet.block_hash import BlockHasher
    from router.fleet.prefix_index import PrefixIndex
    from router.lifecycle.prompts import ModelPrompts
    from shared import protocol as p

    text = prompts(1, args.kb)[0]
    mp = ModelPrompts(str(common.TINY_MODEL_DIR))
    ids = mp.encode(text, True)
    sha, sim = BlockHasher("sha256", 16), BlockHasher("sim", 16)
    hashes, sim_hashes = sha.hashes(ids), sim.text_hashes(text, len(ids))

    def index(trusted_hit: bool) -> PrefixIndex:
        ix = PrefixIndex()
        for w in ("w0", "w1"):
            ix.add_worker(w, "m", "sha256", 16)
            ix.snapshot(w, 0, hashes if trusted_hit and w == "w1" else [])
        return ix

    req = p.GenerateRequest("job", ids, len(ids), p.SamplingParams(max_tokens=4))
    wire = msgspec.Raw(msgspec.msgpack.encode(ids))
    req_raw = p.GenerateRequest("job", wire, len(ids), p.SamplingParams(max_tokens=4))  # type: ignore[arg-type]
    payload = p.encoder.encode(p.Dispatch(requests=[req], epoch=1))
    rows = [
        ("tokenize (encode_batch, GIL released)", _median_ms(lambda _: mp.encode(text, True), n=5)),
        (f"block hashes, sha256 ({len(hashes)} blocks)", _median_ms(lambda _: sha.hashes(ids), n=3)),
        (f"block hashes, sim ({len(sim_hashes)} blocks)", _median_ms(lambda _: sim.text_hashes(text, len(ids)))),
        ("prefix match, a miss", _median_ms(lambda ix: ix.match("m", hashes, 1.0), lambda: index(False))),
        ("prefix match, a full hit", _median_ms(lambda ix: ix.match("m", hashes, 1.0), lambda: index(True))),
        (
            f"prefix speculate ({len(hashes)} blocks)",
            _median_ms(lambda ix: ix.speculate("w0", hashes, 1.0), lambda: index(False)),
        ),
        (
            f"prefix speculate ({len(sim_hashes)} blocks)",
            _median_ms(lambda ix: ix.speculate("w0", sim_hashes, 1.0), lambda: index(False)),
        ),
        (
            "encode the dispatch, ids as a list",
            _median_ms(lambda _: p.encoder.encode(p.Dispatch(requests=[req], epoch=1))),
        ),
        (
            "encode the dispatch, ids encoded before",
            _median_ms(lambda _: p.encoder.encode(p.Dispatch(requests=[req_raw], epoch=1))),
        ),
        ("encode the ids (the tokenizer thread)", _median_ms(lambda _: msgspec.msgpack.encode(ids))),
        ("the worker decodes the dispatch", _median_ms(lambda _: p.to_worker_decoder.decode(payload))),
        ("free the ids (job end)", _median_ms(lambda xs: xs.clear(), lambda: msgspec.msgpack.decode(bytes(wire)))),
    ]
    burst = _in_burst(sim_hashes, args.burst) + _in_burst(hashes, args.burst) if args.burst else []
    print(f"a {len(text) // 1000} KB prompt: {len(ids)} tokens of tiny-llama")
    for name, ms in rows:
        print(f"{name:48s} {ms:8.2f} ms")
    if burst:
        print(f"in a burst of {args.burst} prompts, the prefix index:")
    for name, ms in burst:
        print(f"{name:48s} {ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
