"""The router's request lifecycle alone, in process: µs per request.

submit -> policy pass -> dispatch -> one final Delta, with fake workers
(fakes) and no sockets: what router.lifecycle.core, router.lifecycle.intake and the
policy cost per 1-token request, apart from the transport and the loop.

    python -m bench.lifecycle_cost [-n 3000] [--rounds 5] [--tracing RATIO]

``--tracing RATIO``: [tracing] on at that sampling ratio, each traced
request's spans encoded as OTLP on the same thread (what the router's export
thread does), so the figure is the router's CPU per request with tracing;
the loop runs its callbacks after each request (spans are built there), so
compare ``--tracing 0`` with ``--tracing 1``, not with no flag.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec

from router.lifecycle.core import RouterCore
from router.observe.tracing import RouterTracer
from shared import protocol as p
from shared.config import Config, TracingConfig
from shared.otlp import Span, encode_spans, export_request
from tests.fakes import FakeWorkers  # (the lifecycle's port fakes live beside the tests that use them)

PROMPT = "hello there"

_CFG = msgspec.convert(
    {"router": {"heartbeat_interval_s": 0.5}, "models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}]},
    Config,
)


class _Sink:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def on_deltas(self, deltas: list[p.Delta]) -> None:
        self.n += 1


class _Encoder:
    """The export thread's work, inline: spans -> OTLP bytes (not sent)."""

    def __init__(self) -> None:
        self.spans = 0

    def add(self, spans: list[Span]) -> None:
        self.spans += len(spans)
        export_request(encode_spans(spans), {"service.name": "weir-router"})


def once(n: int, tracing: float | None = None) -> float:
    """µs per request over ``n`` requests, one at a time, on one worker."""
    loop = asyncio.new_event_loop()
    workers = FakeWorkers()
    workers.linked.add("w0")
    cfg = _CFG
    if tracing is not None:
        cfg = msgspec.structs.replace(_CFG, tracing=TracingConfig(endpoint="127.0.0.1:9", sampling_ratio=tracing))
    core = RouterCore(cfg, loop, workers)
    if core.tracer is not None:
        core.tracer.close()
        core.tracer = RouterTracer(cfg.tracing, _Encoder())
    core.worker_joined(
        p.Register(
            worker_id="w0",
            model="sim-m",
            pool=p.Pool.ANY,
            max_model_len=4096,
            kv_capacity_tokens=1 << 20,
            block_size=16,
            max_num_seqs=256,
            engine="sim",
        )
    )
    core.run_policy()
    served = core.served_model("sim-m")
    assert served is not None
    # the engine reports the prompt as the router counted it (as the sim worker does)
    prompt_tokens = served.prompts.tokenize(p.Submit("c", "sim-m", prompt=PROMPT)).count
    sink = _Sink()
    subs = [p.Submit(f"c{i}", "sim-m", prompt=PROMPT, max_tokens=1) for i in range(n)]
    t0 = time.perf_counter()
    for sub in subs:
        handle = core.submit(sub, sink)
        assert isinstance(handle, int), handle
        core.run_policy()
        core.on_outputs(
            "w0",
            [
                p.Delta(
                    "%x" % handle, " tok", 1, "length", completion_tokens=1, prompt_tokens=prompt_tokens, token_ids=[0]
                )
            ],
        )
        if tracing is not None:  # the spans are built in a callback after the turn
            loop.stop()
            loop.run_forever()
    dt = time.perf_counter() - t0
    assert sink.n == n and not core.jobs
    core.close()
    loop.close()
    return dt / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tracing", type=float, metavar="RATIO", help="[tracing] on at this sampling ratio")
    args = ap.parse_args()
    once(500, args.tracing)  # warm-up
    runs = [once(args.n, args.tracing) for _ in range(args.rounds)]
    print(
        f"lifecycle: {min(runs):.1f} µs per request (best of {args.rounds} x {args.n}; all: "
        + ", ".join(f"{r:.1f}" for r in runs)
        + ")"
    )


if __name__ == "__main__":
    main()
