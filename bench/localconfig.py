"""Weir configs for a stack on this machine: every listener on a free
loopback port, both local models, and the workers the caller asks for.
The tests and the benchmarks both build their stacks from here.

    path = write_config(tmp_dir, workers=[sim_worker("sim-0"), sim_worker("sim-1")],
                        scheduler={"policy": "fifo"})
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from shared.config import load

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = REPO / "models" / "tiny-llama"  # built by `weir make-model`
VLLM_MODEL = "tiny-llama"
SIM_MODEL = "sim-tiny"
SIM_EMBED_MODEL = "sim-embed"  # a simulated embedding model (task = "embed"): see sim_embed_model
# vLLM on a small CPU host shared with the dataplane (deploy/weir.toml has the
# same): one OpenMP thread the kernel may move, not one pinned to a core the
# router and Envoy also need.  bench/README.md has the measurements.
CPU_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def vllm_serve_argv(model_dir: str | os.PathLike[str], name: str, port: int, *engine_args: str) -> list[str]:
    """``vllm serve`` (vLLM's OpenAI server module, this interpreter) on ``model_dir`` served as ``name``,
    on loopback ``port``, with ``engine_args``: the one command the benchmarks and tests compare weir with."""
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    return [*server, "--served-model-name", name, *engine_args, "--host", "127.0.0.1", "--port", str(port)]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now (the OS picks them; the
    race until a child binds them is accepted). All are held at once so the
    OS cannot hand out the same port twice."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    """One loopback port free right now."""
    return free_ports(1)[0]


def sim_worker(worker_id: str = "sim-0", model: str = SIM_MODEL, max_num_seqs: int = 64, **fields: Any) -> dict:
    """A simulated-engine worker; ``sim={...}`` sets SimEngineConfig fields,
    other keywords set WorkerConfig fields."""
    return {"id": worker_id, "model": model, "max_num_seqs": max_num_seqs, **fields}


def routers(n: int, host: str = "127.0.0.1") -> list[dict]:
    """``[[routers]]`` entries for ``n`` routers on free ports (README: Scaling out)."""
    ports = free_ports(3 * n)
    return [
        {
            "http": f"{host}:{ports[3 * i]}",
            "frontend": f"tcp://{host}:{ports[3 * i + 1]}",
            "backend": f"tcp://{host}:{ports[3 * i + 2]}",
        }
        for i in range(n)
    ]


def vllm_worker(
    worker_id: str = "vllm-0", max_num_seqs: int = 16, kv_cache_bytes: int = 64 << 20, **fields: Any
) -> dict:
    """A real vLLM worker on the tiny model, with CPU_ENGINE_ENV; keywords set
    WorkerConfig fields."""
    return {
        "id": worker_id,
        "model": VLLM_MODEL,
        "max_num_seqs": max_num_seqs,
        "kv_cache_bytes": kv_cache_bytes,
        "env": dict(CPU_ENGINE_ENV),
        **fields,
    }


def models(vllm_max_model_len: int = 512) -> list[dict]:
    """The tiny real model (vLLM) and a simulated one."""
    return [
        {
            "name": VLLM_MODEL,
            "engine": "vllm",
            "path": str(TINY_MODEL_DIR),
            "max_model_len": vllm_max_model_len,
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
        },
        {"name": SIM_MODEL, "engine": "sim", "max_model_len": 4096},
    ]


def sim_embed_model(max_model_len: int = 512) -> dict:
    """A simulated embedding model (``/v1/embeddings`` only; serve it with
    ``sim_worker(..., model=SIM_EMBED_MODEL)``): add it to ``models()``."""
    return {"name": SIM_EMBED_MODEL, "engine": "sim", "task": "embed", "max_model_len": max_model_len}


def merge(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """``cfg`` with ``overrides`` applied: a table section (``envoy``,
    ``router``, ``rate_limit``, ``scheduler``...) is merged key by key into
    the one already there; anything else (``workers``, ``api_keys``,
    ``models``...) replaces it."""
    out = dict(cfg)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def base_config(**overrides: Any) -> dict:
    """Every listener on a free loopback port, short health/heartbeat
    intervals, both models and one sim worker; then ``overrides`` (see merge)."""
    listen, admin, http, frontend, backend = free_ports(5)
    cfg = {
        "envoy": {
            "listen": f"127.0.0.1:{listen}",
            "admin": f"127.0.0.1:{admin}",
            "concurrency": 1,
            "health_check_interval_s": 0.5,
        },
        "router": {
            "http": f"127.0.0.1:{http}",
            "frontend": f"tcp://127.0.0.1:{frontend}",
            "backend": f"tcp://127.0.0.1:{backend}",
            "heartbeat_interval_s": 0.5,
            # lost after 3 s of silence, as the default (1 s x 3): quick stats,
            # not a 1.5 s bound that a loaded 2-core machine's stalls can reach
            "heartbeat_liveness": 6,
        },
        "models": models(),
        "workers": [sim_worker()],
    }
    return merge(cfg, overrides)


def write_config(
    directory: os.PathLike, name: str = "weir.toml", *, defaults: Mapping[str, Any] | None = None, **overrides: Any
) -> Path:
    """Write ``base_config()`` with the caller's ``defaults`` and then its
    ``overrides`` merged in (see merge) to ``directory/name`` (created if
    needed) and return the path, validated by loading it."""
    cfg = merge(base_config(**(defaults or {})), overrides)
    # batch files and state beside the config, not in the user's home
    cfg["batch"] = {"directory": str(Path(directory).resolve() / "batches"), **cfg.get("batch", {})}
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        tomli_w.dump(cfg, f)
    load(path)  # fail here, with the config's own error, not later in a child process
    return path
