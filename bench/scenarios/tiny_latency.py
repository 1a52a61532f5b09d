"""One request's end-to-end latency on the real tiny model: through Envoy vs direct ZeroMQ.

A stack with one vLLM worker on tiny-llama; the same greedy 8-token completion
over a keep-alive HTTP connection through Envoy and over the direct ZeroMQ
client, alternating, after a warm-up.  Prints median and p90 of each.

    python -m bench.scenarios.tiny_latency [-n 100]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from pathlib import Path

from bench.scenarios import common
from shared.client import Client

PROMPT = "Hello there, how are you?"
MAX_TOKENS = 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.tiny_latency", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--num-requests", type=int, default=100, help="per path (default 100)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    out = args.out or common.results_dir("tiny-latency")
    cfg = common.write_config(out / "stack", workers=[common.vllm_worker(kv_cache_bytes=16 << 20)])
    body = json.dumps(
        {"model": common.VLLM_MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    ).encode()
    with common.stack(cfg, out / "stack" / "run") as st:
        host, port = st.envoy_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port))
        zmq_client = Client(st.zmq_frontend)

        def via_envoy() -> None:
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            assert r.status == 200, data

        def via_zmq() -> None:
            r = zmq_client.complete(
                common.VLLM_MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0
            )
            assert r.completion_tokens == MAX_TOKENS

        paths = {"envoy": via_envoy, "zmq": via_zmq}
        for _ in range(args.warmup):
            for fn in paths.values():
                fn()
        lat: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.num_requests):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn()
                lat[name].append((time.perf_counter() - t) * 1e3)
        zmq_client.close()
    lines = []
    for name, xs in lat.items():
        xs.sort()
        lines.append(
            f"{name}: median {statistics.median(xs):.2f} ms, p90 {xs[int(len(xs) * 0.9) - 1]:.2f} ms "
            f"(n={len(xs)}, {MAX_TOKENS} output tokens)"
        )
    print("\n".join(lines))
    common.save(out, "tiny_latency.json", lat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
