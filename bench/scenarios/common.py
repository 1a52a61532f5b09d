"""What every scenario needs: a generated config on free ports, a started
stack, a results directory, and a synchronous way to run one benchmark."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from bench.arrivals import Arrivals
from bench.runner import Limits, RunResult, machine, run_bench
from bench.spec import Workload
from bench.targets import make_target

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
TINY_MODEL_DIR = REPO / "models" / "tiny-llama"
SIM_MODEL = "sim-tiny"
VLLM_MODEL = "tiny-llama"
CLASSES = ("critical", "high", "normal", "low", "batch")  # the scheduler's default classes
# Envoy's local rate limits would shape the offered load; benchmarks of the
# dataplane lift them far out of the way.
NO_RATE_LIMIT = {"route_rps": 10_000_000, "route_burst": 10_000_000,
                 "per_key_rps": 10_000_000, "per_key_burst": 10_000_000}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sim_worker(worker_id: str = "sim-0", max_num_seqs: int = 64, **sim: Any) -> dict:
    return {"id": worker_id, "model": SIM_MODEL, "max_num_seqs": max_num_seqs, "sim": sim}


def vllm_worker(worker_id: str = "vllm-0", max_num_seqs: int = 16, kv_cache_bytes: int = 64 << 20, **kw: Any) -> dict:
    return {"id": worker_id, "model": VLLM_MODEL, "max_num_seqs": max_num_seqs, "kv_cache_bytes": kv_cache_bytes, **kw}


def write_config(directory: Path, *, workers: list[dict], scheduler: Optional[dict] = None,
                 api_keys: Optional[list[dict]] = None, envoy: Optional[dict] = None,
                 router: Optional[dict] = None, rate_limit: Optional[dict] = None) -> Path:
    """A weir config with every listener on a free loopback port."""
    from shared.config import load

    cfg: dict[str, Any] = {
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}",
                  "concurrency": 1, "health_check_interval_s": 0.5, **(envoy or {})},
        "router": {"http": f"127.0.0.1:{free_port()}", "frontend": f"tcp://127.0.0.1:{free_port()}",
                   "backend": f"tcp://127.0.0.1:{free_port()}", "heartbeat_interval_s": 0.5,
                   "log_level": "warning", **(router or {})},
        "rate_limit": {**NO_RATE_LIMIT, **(rate_limit or {})},
        "scheduler": scheduler or {},
        "api_keys": api_keys or [],
        "models": [
            {"name": VLLM_MODEL, "engine": "vllm", "path": str(TINY_MODEL_DIR), "max_model_len": 512},
            {"name": SIM_MODEL, "engine": "sim", "max_model_len": 4096},
        ],
        "workers": workers,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "weir.toml"
    path.write_text(to_toml(cfg))
    load(path)  # fail here with the config's own message
    return path


@contextlib.contextmanager
def stack(cfg_path: Path, run_dir: Path) -> Iterator[Any]:
    from deploy.stack import Stack

    s = Stack(cfg_path, run_dir, progress=lambda m: print(f"[stack] {m}", file=sys.stderr))
    with s:
        yield s


def results_dir(name: str) -> Path:
    d = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def bench(workload: Workload, kind: str, url: str, arrivals: Arrivals, limits: Limits, *,
          label: str, progress: bool = True, connections: Optional[int] = None,
          tokenizer: Optional[str] = None, api_key: Optional[str] = None,
          model: Optional[str] = None, on_phase=None) -> RunResult:
    """One run, synchronously (each on a fresh uvloop event loop)."""
    import uvloop

    async def go() -> RunResult:
        target = make_target(kind, url, api_key)
        try:
            return await run_bench(workload, target, arrivals, limits, progress=progress,
                                   connections=connections, tokenizer=tokenizer, label=label, model=model,
                                   on_phase=on_phase)
        finally:
            await target.close()

    return uvloop.run(go())


def header(title: str, argv: list[str]) -> str:
    m = machine()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return (f"# {title}\n\n`{' '.join(['python', '-m'] + argv)}`  \n"
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, "
            f"git {rev or '?'} (plus uncommitted changes, if any)\n")


def save(directory: Path, name: str, data: Any) -> Path:
    p = directory / name
    p.write_text(json.dumps(data, indent=1, default=str))
    return p


def pid_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of one process and its reaped children."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / tick


# ---------------------------------------------------------------- tiny TOML writer
# (tomllib reads TOML; nothing in the standard library writes it)

def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(cfg: dict) -> str:
    """Top-level tables and arrays of tables; anything nested is inline."""
    out: list[str] = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.append(f"[{k}]")
            out += [f"{kk} = {_value(vv)}" for kk, vv in v.items()]
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                out.append(f"[[{k}]]")
                out += [f"{kk} = {_value(vv)}" for kk, vv in item.items()]
        else:
            out.insert(0, f"{k} = {_value(v)}")
    return "\n".join(out) + "\n"
