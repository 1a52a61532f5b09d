"""What logprobs cost the router's streaming path, per token (no processes).

For each setting (no logprobs, logprobs 0, 5, 20) it builds the Outputs
message a worker sends for 256 streams x one token, then times what the
router does with it: decode the message (as router.fleet.worker_link) and render
each stream's SSE event (router.api.StreamRenderer), and reports
wire bytes per token and router microseconds per token.

    python -m bench.logprobs_cost
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from router import api
from router.lifecycle.prompts import ModelPrompts
from shared import protocol as p

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"
STREAMS = 256


def _message(k, rnd):
    deltas = []
    for s in range(STREAMS):
        tid = rnd.randrange(400)
        d = p.Delta(f"j{s:x}", "tok", 1, completion_tokens=5, token_ids=[tid])
        if k is not None:
            d.logprobs = p.pack_logprobs([-rnd.random() * 5 for _ in range(1 + k)])
            d.top_ids = [rnd.randrange(400) for _ in range(k)]
        deltas.append(d)
    return p.encoder.encode(p.Outputs(deltas))


def measure(k, text, rounds=200, kind=p.RequestKind.COMPLETION):
    rnd = random.Random(1)
    msg = _message(k, rnd)
    renderers = []
    for s in range(STREAMS):
        ctx = api.ResponseContext(f"cmpl-{s}", kind, "tiny-llama", 1, True, False, 1, k, "", text)
        renderers.append(api.StreamRenderer(ctx))
    t0 = time.perf_counter()
    nbytes = 0
    for _ in range(rounds):
        out = p.worker_decoder.decode(msg)
        for r, d in zip(renderers, out.deltas):
            nbytes += len(r.render([d]))
    dt = time.perf_counter() - t0
    tokens = rounds * STREAMS
    return len(msg) / STREAMS, dt / tokens * 1e6, nbytes / tokens


def main() -> None:
    text = ModelPrompts(str(TINY)).token_text() if (TINY / "tokenizer.json").exists() else api.token_id_text
    print(
        f"{'logprobs':>9} {'kind':>11} {'wire B/token':>13} {'router us/token':>16} "
        f"{'SSE B/token':>12} {'tokens/s/core':>14}"
    )
    for kind in (p.RequestKind.COMPLETION, p.RequestKind.CHAT):
        for k in (None, 0, 5, 20):
            wire, us, sse = measure(k, text, kind=kind)
            print(f"{str(k):>9} {kind.name.lower():>11} {wire:13.1f} {us:16.2f} {sse:12.0f} {1e6 / us:14,.0f}")


if __name__ == "__main__":
    main()
