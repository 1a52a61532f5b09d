"""Overload admission (issue 14): bursts through Envoy on a sim stack, the
cost of a large queue, and ``vllm bench serve`` against weir and ``vllm serve``.

Parts (``--parts``, default all but ``vllm``):

* ``micro``  -- in-process, the pure policy: memory per queued request and
  the cost of a submit and of a scheduling pass (one finish -> one dispatch)
  with 1,000 and 100,000 queued.
* ``absorb`` -- one sim worker (256 slots, plenty of KV), N concurrent
  64-token streams through Envoy, all at once: how many are served.
* ``burst``  -- one sim worker, a burst of ``--multiple`` x what it serves
  within the class deadline (``--deadline``), all at once through Envoy;
  every refusal is retried once after its Retry-After.  Reported: status
  counts, Retry-After given at once (refusal latency), the fraction served
  on the first retry, predicted vs actual queue wait (``/admin/queues``),
  router RSS before / at peak / after, reservations after.
* ``vllm``   -- ``vllm bench serve --dataset-name random --random-input-len 32
  --random-output-len 16 --num-prompts 1000 --request-rate inf`` through
  Envoy to weir's default single vLLM worker (16 slots) and against ``vllm
  serve`` with the same engine settings (needs the tiny model).

    python -m bench.scenarios.burst [--parts micro,absorb,burst,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import statistics
import sys
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

from bench.scenarios import common

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str):
    with OPENER.open(url, timeout=10) as r:
        return json.loads(r.read())


# ------------------------------------------------------------------ micro


def micro(n_big: int = 100_000, tenants: int = 1) -> dict:
    """Policy-only costs at 1,000 and ``n_big`` queued."""
    import msgspec

    from router.policy import Job, Policy, WorkerSpec
    from shared.config import ClassConfig, SchedulerConfig
    from shared.protocol import Pool, TaskType

    cfg = msgspec.structs.replace(
        SchedulerConfig(), classes=[ClassConfig(name=c, queue_deadline_s=1e9) for c in common.CLASSES]
    )
    out = {}
    for n in (1000, n_big):
        p = Policy(cfg)
        p.add_worker(WorkerSpec("w0", "m", Pool.ANY, 1 << 24, 16, 256, 4096), 0.0)
        k = 0

        def job(t: float) -> Job:
            nonlocal k
            k += 1
            return Job("%x" % k, "m", f"tenant-{k % tenants}", "normal", 32, 64, TaskType.AUTO, t)

        running = []
        for _ in range(256):  # fill the worker: everything after this waits
            p.submit(job(0.0), 0.0)
        running = [a.job_id for a in p.schedule(0.0)]
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        t = 1.0
        jobs = [job(t) for _ in range(n)]
        jobs_bytes = tracemalloc.get_traced_memory()[0] - base
        for j in jobs:
            assert p.submit(j, t) is None
        policy_bytes = tracemalloc.get_traced_memory()[0] - base - jobs_bytes
        tracemalloc.stop()
        del jobs
        # submit cost at this length: 1,000 more, timed one by one
        extra = [job(t) for _ in range(1000)]
        dt = []
        for j in extra:
            t0 = time.perf_counter_ns()
            p.submit(j, t)
            dt.append(time.perf_counter_ns() - t0)
        # pass cost: a running job ends, the pass dispatches the next one
        passes = []
        for _ in range(1000):
            t += 0.001
            p.finish(running.pop(0), t)
            t0 = time.perf_counter_ns()
            acts = p.schedule(t)
            passes.append(time.perf_counter_ns() - t0)
            running += [a.job_id for a in acts]
            assert len(acts) == 1
        out[n] = {
            "queued": n,
            "policy_bytes_per_queued": round(policy_bytes / n),
            "job_bytes_per_queued": round(jobs_bytes / n),
            "submit_us_p50": statistics.median(dt) / 1e3,
            "submit_us_p99": sorted(dt)[int(0.99 * len(dt))] / 1e3,
            "pass_us_p50": statistics.median(passes) / 1e3,
            "pass_us_p99": sorted(passes)[int(0.99 * len(passes))] / 1e3,
        }
    return out


# ------------------------------------------------------------------ stack helpers


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def _router_pid(st) -> int:
    return st.components["router"].pid


class _RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, _rss_kb(self.pid))
            except OSError:
                return
            time.sleep(0.05)


async def _fire(
    url: str, model: str, n: int, max_tokens: int, stream: bool, retry: bool, deadline_s: float
) -> list[dict]:
    """``n`` requests at once (one connection each); a refused one is sent
    again after its Retry-After when ``retry``.  One dict per request."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=deadline_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, trust_env=False) as s:

        async def one(i: int) -> dict:
            rec = {"attempts": []}
            body = {"model": model, "prompt": f"{i} " + "x" * 124, "max_tokens": max_tokens, "stream": stream}
            while True:
                t0 = time.monotonic()
                try:
                    async with s.post(url + "/v1/completions", json=body) as r:
                        status = r.status
                        ra = r.headers.get("retry-after")
                        code = None
                        if status == 200:
                            await r.read()
                        else:
                            try:
                                code = (await r.json(content_type=None))["error"].get("code")
                            except Exception:
                                code = None
                except Exception as e:  # transport error: count it, do not retry
                    status, ra, code = f"error:{type(e).__name__}", None, None
                rec["attempts"].append(
                    {"status": status, "code": code, "retry_after": ra, "latency_s": time.monotonic() - t0}
                )
                if status in (429, 503) and retry and ra is not None and len(rec["attempts"]) == 1:
                    await asyncio.sleep(int(ra))
                    continue
                return rec

        return await asyncio.gather(*(one(i) for i in range(n)))


def _drained(router_url: str, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        ws = _get(router_url + "/admin/workers")
        if all(w["reserved_tokens"] == 0 and w["running"] == 0 for w in ws) or time.monotonic() > deadline:
            return ws
        time.sleep(0.2)


def _summarise(recs: list[dict]) -> dict:
    from collections import Counter

    first = Counter(str(r["attempts"][0]["status"]) for r in recs)
    final = Counter(str(r["attempts"][-1]["status"]) for r in recs)
    refused = [r for r in recs if r["attempts"][0]["status"] in (429, 503)]
    retried = [r for r in refused if len(r["attempts"]) > 1]
    ok_retry = [r for r in retried if r["attempts"][1]["status"] == 200]
    lat = sorted(r["attempts"][0]["latency_s"] for r in refused)
    ra = sorted(int(r["attempts"][0]["retry_after"]) for r in refused if r["attempts"][0]["retry_after"])
    codes = Counter(r["attempts"][0]["code"] for r in refused)
    return {
        "sent": len(recs),
        "first_status": dict(first),
        "final_status": dict(final),
        "refusal_codes": dict(codes),
        "refusal_latency_ms_p50": round(1e3 * lat[len(lat) // 2], 1) if lat else None,
        "refusal_latency_ms_max": round(1e3 * lat[-1], 1) if lat else None,
        "retry_after_s": {"min": ra[0], "p50": ra[len(ra) // 2], "max": ra[-1]} if ra else None,
        "retried": len(retried),
        "served_on_first_retry": len(ok_retry),
        "first_retry_fraction": round(len(ok_retry) / len(retried), 3) if retried else None,
    }


def stack_burst(
    out: Path,
    *,
    n: int,
    max_tokens: int,
    seqs: int,
    deadline: float,
    stream: bool,
    retry: bool,
    label: str,
    rounds: int = 2,
) -> list[dict]:
    """``rounds`` bursts on one stack (the first on a cold router: nothing
    measured yet), each summarised; router RSS before, at peak and after."""
    cfg = common.write_config(
        out / label,
        workers=[common.sim_worker("sim-0", max_num_seqs=seqs, kv_capacity_tokens=1 << 22)],
        scheduler={"classes": [{"name": c, "queue_deadline_s": deadline} for c in common.CLASSES]},
    )
    with common.stack(cfg, out / label / "run") as st:
        pid = _router_pid(st)
        # warm the path (first requests import and allocate)
        asyncio.run(_fire(st.envoy_url, common.SIM_MODEL, 20, 4, False, False, 30))
        time.sleep(0.5)
        rss_start = _rss_kb(pid)
        results = []
        for rnd in range(rounds):
            rss0 = _rss_kb(pid)
            sampler = _RssSampler(pid)
            sampler.start()
            t0 = time.monotonic()
            recs = asyncio.run(
                _fire(st.envoy_url, common.SIM_MODEL, n, max_tokens, stream, retry, deadline_s=4 * deadline + 3600)
            )
            elapsed = time.monotonic() - t0
            workers = _drained(st.router_url)
            queues = _get(st.router_url + "/admin/queues")
            time.sleep(2.0)
            rss1 = _rss_kb(pid)
            sampler.stop.set()
            res = _summarise(recs)
            served = sorted(a["latency_s"] for r in recs for a in r["attempts"][:1] if a["status"] == 200)
            normal = next(q for q in queues if q["class"] == "normal" and q["pool"] == "short")
            res.update(
                label=label,
                round=rnd + 1,
                n=n,
                max_tokens=max_tokens,
                max_num_seqs=seqs,
                deadline_s=deadline,
                elapsed_s=round(elapsed, 1),
                served_first_latency_s_p50=round(served[len(served) // 2], 2) if served else None,
                router_rss_mb={
                    "stack_start": round(rss_start / 1024, 1),
                    "before": round(rss0 / 1024, 1),
                    "peak": round(sampler.peak / 1024, 1),
                    "after": round(rss1 / 1024, 1),
                },
                reserved_after=[w["reserved_tokens"] for w in workers],
                running_after=[w["running"] for w in workers],
                preemptions=[w.get("preemptions") for w in workers],
                wait_error_s={
                    "p50": normal["wait_error_p50_s"],
                    "p90": normal["wait_error_p90_s"],
                    "samples": normal["wait_samples"],
                },
            )
            results.append(res)
            print(json.dumps(res, indent=1))
    return results


# ------------------------------------------------------------------ vllm bench serve


def _vllm_bench(base_url: str, out: Path, label: str, num: int) -> dict:
    data = common.vllm_bench_serve(
        base_url,
        out,
        f"vllm-bench-{label}",
        ["--random-input-len", "32", "--random-output-len", "16", "--num-prompts", str(num), "--request-rate", "inf"],
    )
    return {
        k: data.get(k)
        for k in ("completed", "num_prompts", "duration", "median_ttft_ms", "p99_ttft_ms", "request_throughput")
    } | {"failed": (data.get("num_prompts") or num) - (data.get("completed") or 0)}


def vllm_compare(out: Path, num: int = 1000) -> dict:
    from bench.scenarios import versus_vllm

    args = argparse.Namespace(max_num_seqs=16, kv_cache_bytes=64 << 20, engine_env=dict(common.CPU_ENGINE_ENV))
    res = {}
    cfg = common.write_config(
        out / "vllm-stack", workers=[common.vllm_worker(max_num_seqs=16, kv_cache_bytes=64 << 20, env=args.engine_env)]
    )
    with common.stack(cfg, out / "vllm-stack" / "run") as st:
        res["weir"] = _vllm_bench(st.envoy_url, out, "weir", num)
        res["weir"]["reserved_after"] = [w["reserved_tokens"] for w in _drained(st.router_url)]
    port = common.free_port()
    log = out / "vllm-server.log"
    proc = versus_vllm.start_vllm_server(port, args, log)
    try:
        versus_vllm.wait_ready(proc, f"http://127.0.0.1:{port}/v1", log)
        res["vllm"] = _vllm_bench(f"http://127.0.0.1:{port}", out, "vllm", num)
    finally:
        versus_vllm.stop_group(proc)
    return res


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.burst", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="micro,absorb,burst")
    ap.add_argument("--absorb-n", type=int, default=2000)
    ap.add_argument("--multiple", type=float, default=20.0, help="burst size over what fits the deadline")
    ap.add_argument("--deadline", type=float, default=1.0, help="class queue_deadline_s of the burst part")
    ap.add_argument("--rounds", type=int, default=2, help="bursts per stack")
    ap.add_argument("--burst-seqs", type=int, default=16)
    ap.add_argument("--big", type=int, default=100_000, help="queue length of the micro part")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    out = args.out or common.results_dir("burst")
    res: dict = {}
    if "micro" in parts:
        res["micro"] = micro(args.big)
        print(json.dumps(res["micro"], indent=1))
    if "absorb" in parts:
        res["absorb"] = stack_burst(
            out,
            n=args.absorb_n,
            max_tokens=64,
            seqs=256,
            deadline=60.0,
            stream=True,
            retry=False,
            label="absorb",
            rounds=args.rounds,
        )
    if "burst" in parts:
        # what one worker of --burst-seqs slots serves within the deadline, from the sim's
        # step model: 64-token jobs, one step ~ 2.3 ms + 60 us x slots
        step = 2.3e-3 + 60e-6 * args.burst_seqs
        within = int(args.burst_seqs * args.deadline / (65 * step))
        res["burst"] = stack_burst(
            out,
            n=int(args.multiple * within),
            max_tokens=64,
            seqs=args.burst_seqs,
            deadline=args.deadline,
            stream=False,
            retry=True,
            label="burst",
            rounds=args.rounds,
        )
        print(
            f"a burst of {int(args.multiple * within)} = {args.multiple:g} x {within} (what the "
            f"sim's step model serves within {args.deadline:g} s)"
        )
    if "vllm" in parts:
        res["vllm"] = vllm_compare(out)
        print(json.dumps(res["vllm"], indent=1))
    common.save(out, "burst.json", res)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
