"""The long fuzz run: N hostile cases per entrance of a sim stack (bench/fuzz.py).

    python -m bench.scenarios.fuzz [-n 10000] [--seed 1]

Targets: OpenAI bodies through Envoy and straight at the router, malformed
HTTP on raw sockets to both, random frames at the ZeroMQ frontend and
backend.  Reports answers by status, every problem found (a 500, an answer
without an OpenAI error body, a 429/503 without Retry-After, an undecodable
ZeroMQ reply), and after each target that the router still serves and
holds no reservation.  Exit status 1 if anything was found.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import random
import time
from pathlib import Path

import requests
import zmq

from bench import fuzz
from bench.scenarios import common


def _settled(stack) -> str:
    with requests.Session() as s:
        ok = (
            s.post(
                stack.router_url + "/v1/completions",
                timeout=30,
                json={"model": common.SIM_MODEL, "prompt": "still there?", "max_tokens": 2},
            ).status_code
            == 200
        )
        deadline = time.monotonic() + 10
        while True:
            workers = s.get(stack.router_url + "/admin/workers", timeout=5).json()
            clean = all(w["reserved_tokens"] == 0 and w["running"] == 0 for w in workers)
            if clean or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    return f"serving {'yes' if ok else 'NO'}, reservations {'0' if clean else 'LEFT'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10_000, help="cases per target")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    out = args.out or common.results_dir("fuzz")
    cfg = common.write_config(out / "stack", workers=[common.sim_worker("sim-0", zero_cost=True)])
    rows, problems = [], []
    with common.stack(cfg, out / "stack" / "run") as st:
        rng = random.Random(args.seed)
        hosts = {"envoy": st.envoy_url, "router": st.router_url}
        for name, base in hosts.items():
            seen: collections.Counter = collections.Counter()
            t0 = time.monotonic()
            with requests.Session() as s:
                for _ in range(args.n):
                    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
                    body = fuzz.http_body(rng, rng.choice([common.SIM_MODEL, common.SIM_MODEL, "nope"]))
                    r = s.post(base + path, data=body, headers={"content-type": "application/json"}, timeout=30)
                    seen[r.status_code] += 1
                    bad = fuzz.check_http(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)
                    if bad:
                        problems.append((f"http:{name}", body[:300], bad))
            rows.append(
                (f"OpenAI bodies via {name}", args.n, dict(sorted(seen.items())), time.monotonic() - t0, _settled(st))
            )
        for name, base in hosts.items():
            host, port = base.removeprefix("http://").split(":")
            seen = collections.Counter()
            t0 = time.monotonic()
            cases = [
                fuzz.raw_http(rng, rng.choice(["/v1/completions", "/v1/chat/completions", "/health"]))
                for _ in range(args.n)
            ]

            def one(data: bytes, host=host, port=int(port), half=name == "router") -> tuple[bytes, bytes]:
                return data, fuzz.send_raw(host, port, data, timeout=1.0, half_close=half)

            # 16 connections at a time: a request cut off waits out its 1 s timeout
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                for data, answer in pool.map(one, cases):
                    seen[answer[9:12].decode("latin-1") if answer.startswith(b"HTTP/1.") else "closed"] += 1
                    bad = fuzz.check_raw(answer)
                    if bad:
                        problems.append((f"raw:{name}", data[:300], bad))
            rows.append(
                (f"malformed HTTP to {name}", args.n, dict(sorted(seen.items())), time.monotonic() - t0, _settled(st))
            )
        ctx = zmq.Context.instance()
        for side, addr in (("frontend", st.zmq_frontend), ("backend", st.cfg.router.backend)):
            socks = []
            for i in range(8):
                z = ctx.socket(zmq.DEALER)
                z.setsockopt(zmq.LINGER, 0)
                z.setsockopt(zmq.IDENTITY, f"fuzz-{side}-{i}".encode())
                z.connect(addr)
                socks.append(z)
            t0 = time.monotonic()
            replies = 0
            for i in range(args.n):
                z = socks[i % len(socks)]
                z.send(fuzz.zmq_frame(rng, side))
                while side == "frontend" and z.poll(0):
                    replies += 1
                    bad = fuzz.decode_outputs(z.recv())
                    if bad:
                        problems.append((side, b"", bad))
            time.sleep(1)
            for z in socks:
                while z.poll(0):
                    z.recv()
                    replies += 1
                z.close()
            rows.append(
                (f"random frames at the {side}", args.n, {"replies": replies}, time.monotonic() - t0, _settled(st))
            )
        workers = requests.get(st.router_url + "/admin/workers", timeout=5).json()
    lines = [
        common.header("Fuzz", ["bench.scenarios.fuzz", "-n", str(args.n)]),
        "| target | cases | answers | s | after |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {t} | {n} | {a} | {s:.1f} | {after} |" for t, n, a, s, after in rows]
    lines.append(
        f"\nWorkers registered at the end: {sorted(w['id'] for w in workers)} (no ghost).  "
        f"Problems found: {len(problems)}."
    )
    for where, case, bad in problems[:20]:
        lines.append(f"- {where}: {bad} -- case {case!r}")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "summary.md").write_text(text)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
