"""Constrained tool calls: weir versus ``vllm serve``, the tiny model, greedy.

Both serve ``tiny-llama`` with the hermes parser and auto tool choice
(``--tool-call-parser hermes --enable-auto-tool-choice``; weir's default
config), the same engine settings.  For ``tool_choice`` ``required`` and a
named tool, with the tool non-strict and ``strict: true``, at each
``max_tokens``, each server gets one request not streamed and ``--repeat``
streamed ones, sequentially.  Reported per cell: the finish reason, the
tokens per call (``completion_tokens``), the share of requests whose calls
all parse and validate against the schema (a request without a call counts
as not valid), and streamed: the ``tool_calls`` deltas per call and the time
from sending the request to the first ``tool_calls`` delta (median, min-max).
Greedy output is deterministic, so only the times vary between repeats.

    python -m bench.scenarios.tool_calls [--budgets 16,32,64] [--repeat 5] [--md PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from bench.scenarios import common
from bench.scenarios.versus_vllm import stop_group, wait_ready

SERVERS = ("vllm", "weir")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Oslo?"}]
CHOICES: dict[str, Any] = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def tools(strict: bool) -> list[dict]:
    fn: dict[str, Any] = {"name": "get_weather", "description": "Weather", "parameters": WEATHER}
    if strict:
        fn["strict"] = True
    return [{"type": "function", "function": fn}]


def start_vllm_server(port: int, args, log: Path) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(common.TINY_MODEL_DIR),
        "--served-model-name", common.VLLM_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "512",
        "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
        "--dtype", "bfloat16",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--tool-call-parser", "hermes",  # as weir's config serves tiny-llama (bench/localconfig.py)
        "--enable-auto-tool-choice",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **common.CPU_ENGINE_ENV}
    with open(log, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=common.REPO, process_group=0)


def valid(arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), WEATHER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def one(client: httpx.Client, url: str, body: dict) -> dict:
    """A request not streamed: its calls, finish reason and tokens."""
    r = client.post(url + "/chat/completions", json=body)
    r.raise_for_status()
    out = r.json()
    ch = out["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"].get("tool_calls") or []]
    return {"calls": calls, "finish": ch["finish_reason"], "tokens": out["usage"]["completion_tokens"]}


def streamed(client: httpx.Client, url: str, body: dict) -> dict:
    """A streamed request: its calls, the chunks that carried call deltas, and
    the time from sending it to the first of them."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    calls: dict[int, list[str]] = {}
    deltas, first, finish, tokens = 0, None, None, None
    t0 = time.perf_counter()
    with client.stream("POST", url + "/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            e = json.loads(line[6:])
            if e.get("usage"):
                tokens = e["usage"]["completion_tokens"]
            for c in e.get("choices") or []:
                tcs = (c.get("delta") or {}).get("tool_calls") or []
                if tcs:
                    deltas += 1
                    if first is None:
                        first = time.perf_counter() - t0
                for tc in tcs:
                    slot = calls.setdefault(tc["index"], ["", ""])
                    slot[0] += (tc.get("function") or {}).get("name") or ""
                    slot[1] += (tc.get("function") or {}).get("arguments") or ""
                finish = c.get("finish_reason") or finish
    return {
        "calls": [tuple(v) for _, v in sorted(calls.items())],
        "finish": finish,
        "tokens": tokens,
        "deltas": deltas,
        "first_s": first,
    }


def measure(urls: dict[str, str], budgets: list[int], repeat: int) -> list[dict]:
    rows = []
    with httpx.Client(timeout=120) as client:
        for s in SERVERS:  # warm-up: the first structured request compiles its grammar
            for choice in CHOICES.values():
                one(client, urls[s], _body(choice, True, 8))
        for strict in (False, True):
            for cname, choice in CHOICES.items():
                for budget in budgets:
                    for s in SERVERS:
                        body = _body(choice, strict, budget)
                        whole = one(client, urls[s], body)
                        streams = [streamed(client, urls[s], body) for _ in range(repeat)]
                        rows.append(_row(s, strict, cname, budget, whole, streams))
                        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _body(choice: Any, strict: bool, budget: int) -> dict:
    return {
        "model": common.VLLM_MODEL,
        "messages": MESSAGES,
        "tools": tools(strict),
        "tool_choice": choice,
        "max_tokens": budget,
        "temperature": 0,
    }


def _row(server: str, strict: bool, choice: str, budget: int, whole: dict, streams: list[dict]) -> dict:
    answers = [whole, *streams]
    ok = [bool(a["calls"]) and all(valid(args) for _, args in a["calls"]) for a in answers]
    firsts = [a["first_s"] for a in streams if a["first_s"] is not None]
    ncalls = [len(a["calls"]) for a in streams]
    return {
        "server": server,
        "strict": strict,
        "choice": choice,
        "max_tokens": budget,
        "finish": whole["finish"],
        "tokens": whole["tokens"],
        "calls": len(whole["calls"]),
        "valid_share": sum(ok) / len(ok),
        "stream_tokens": [a["tokens"] for a in streams],
        "deltas_per_call": [a["deltas"] / n if n else None for a, n in zip(streams, ncalls, strict=True)],
        "first_ms": [round(f * 1000, 1) for f in firsts],
        "stream_equal": all((a["calls"], a["finish"]) == (streams[0]["calls"], streams[0]["finish"]) for a in streams),
    }


def report(rows: list[dict], argv: list[str]) -> str:
    lines = [
        common.header("Tool calls: weir vs vllm serve (tiny-llama, greedy)", ["bench.scenarios.tool_calls", *argv]),
        "",
        "| tool | choice | max_tokens | server | finish | tokens | calls | valid "
        "| deltas per call | first delta, ms median (min-max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        firsts = r["first_ms"]
        first = f"{statistics.median(firsts):.0f} ({min(firsts):.0f}-{max(firsts):.0f})" if firsts else "-"
        dpc = [d for d in r["deltas_per_call"] if d is not None]
        per_call = f"{statistics.median(dpc):.0f}" if dpc else "-"
        lines.append(
            f"| {'strict' if r['strict'] else 'non-strict'} | {r['choice']} | {r['max_tokens']} | {r['server']} "
            f"| {r['finish']} | {r['tokens']} | {r['calls']} | {r['valid_share']:.0%} | {per_call} | {first} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.tool_calls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="16,32,64", help="max_tokens values")
    ap.add_argument("--repeat", type=int, default=5, help="streamed requests per cell (times vary, tokens do not)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=16 << 20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    out = args.out or common.results_dir("tool-calls")
    cfg = common.write_config(
        out / "stack",
        workers=[common.vllm_worker(max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes)],
    )
    port = common.free_port()
    vllm_url = f"http://127.0.0.1:{port}/v1"
    log = out / "vllm-server.log"
    proc = start_vllm_server(port, args, log)
    try:
        with common.stack(cfg, out / "stack" / "run") as st:
            wait_ready(proc, vllm_url, log)
            rows = measure({"vllm": vllm_url, "weir": st.envoy_url + "/v1"}, budgets, args.repeat)
    finally:
        stop_group(proc)
    common.save(out, "summary.json", rows)
    text = report(rows, argv if argv is not None else sys.argv[1:])
    (out / "report.md").write_text(text)
    if args.md:
        args.md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
