"""Helpers for end-to-end tests: free ports, test configs, stacks.

    cfg_path = write_config(tmp_path, workers=[sim_worker()])
    with start_stack(cfg_path) as stack:
        requests.get(stack.envoy_url + "/v1/models")
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path
from typing import Any, Iterator

from deploy.stack import Stack, group_members
from shared.config import load

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = REPO / "models" / "tiny-llama"
VLLM_MODEL = "tiny-llama"
SIM_MODEL = "sim-tiny"

# API keys of the shared `stack` fixture (tests/conftest.py).
KEY_ALPHA = "sk-alpha"  # tenant alpha, tier high
KEY_BETA = "sk-beta"  # tenant beta, tier normal
KEY_LIMITED = "sk-limited"  # tenant gamma: own Envoy bucket, LIMITED_BURST then LIMITED_RPS/s
LIMITED_RPS = 1
LIMITED_BURST = 5
PER_KEY_RPS = 50  # every other key; a test may send ~100 quick requests per key
PER_KEY_BURST = 100
STACK_MAX_REQUEST_BYTES = 256 << 10  # the shared stack's Envoy body limit
API_KEYS = [
    {"key": KEY_ALPHA, "tenant": "alpha", "tier": "high"},
    {"key": KEY_BETA, "tenant": "beta", "tier": "normal"},
    {
        "key": KEY_LIMITED,
        "tenant": "gamma",
        "tier": "normal",
        "rate_limit_rps": LIMITED_RPS,
        "rate_limit_burst": LIMITED_BURST,
    },
]


def free_port() -> int:
    """A loopback port free right now (the OS picks it; tiny race accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_worker(worker_id: str = "vllm-0", **overrides: Any) -> dict:
    """A real vLLM worker on the tiny model, with a small KV budget (16 MiB =
    32k tokens of this model) so admission limits are reachable in tests."""
    w = {
        "id": worker_id,
        "model": VLLM_MODEL,
        "max_num_seqs": 16,
        "kv_cache_bytes": 16 << 20,
        "dtype": "bfloat16",
    }
    w.update(overrides)
    return w


def sim_worker(worker_id: str = "sim-0", model: str = SIM_MODEL, **overrides: Any) -> dict:
    """A simulated-engine worker; ``sim={...}`` sets SimEngineConfig fields."""
    w = {"id": worker_id, "model": model, "max_num_seqs": 64}
    w.update(overrides)
    return w


def _models() -> list[dict]:
    return [
        {"name": VLLM_MODEL, "engine": "vllm", "path": str(TINY_MODEL_DIR), "max_model_len": 512},
        {"name": SIM_MODEL, "engine": "sim", "max_model_len": 4096},
    ]


def base_config() -> dict:
    """Everything on free loopback ports; no workers, no keys."""
    return {
        "envoy": {
            "listen": f"127.0.0.1:{free_port()}",
            "admin": f"127.0.0.1:{free_port()}",
            "concurrency": 1,
            "health_check_interval_s": 0.5,
        },
        "router": {
            "http": f"127.0.0.1:{free_port()}",
            "frontend": f"tcp://127.0.0.1:{free_port()}",
            "backend": f"tcp://127.0.0.1:{free_port()}",
            "heartbeat_interval_s": 0.5,
        },
        "rate_limit": {"per_key_rps": PER_KEY_RPS, "per_key_burst": PER_KEY_BURST},
        "models": _models(),
        "workers": [sim_worker()],
    }


def write_config(tmp_path: os.PathLike, name: str = "weir.toml", **overrides: Any) -> Path:
    """Write a test config and return its path (validated by loading it).

    Table sections (``envoy``, ``router``, ``rate_limit``, ``scheduler``) are
    merged key by key into the defaults of ``base_config()``; anything else
    (``workers``, ``api_keys``, ``models``...) replaces the default.
    """
    cfg = base_config()
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path = Path(tmp_path) / name
    path.write_text(to_toml(cfg))
    load(path)  # fail here, with the config's own error, not in a child process
    return path


@contextlib.contextmanager
def start_stack(cfg_path: os.PathLike, run_dir: os.PathLike | None = None, **kw: Any) -> Iterator[Stack]:
    """A started Stack (progress lines on stderr, for `pytest -s`); always stopped."""
    stack = Stack(cfg_path, run_dir, progress=lambda m: print(f"[stack] {m}", file=sys.stderr), **kw)
    with stack:
        yield stack


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    return children


def stack_processes(stack: Stack) -> set[int]:
    """Every live process of the stack: each component, all its descendants
    (even one that left its process group) and its process group's members."""
    children = _children_map()
    pids: set[int] = set()
    todo = list(stack.process_groups())
    for pgid in stack.process_groups():
        todo += group_members(pgid)
    while todo:
        pid = todo.pop()
        if pid not in pids:
            pids.add(pid)
            todo += children.get(pid, [])
    return alive(pids)


def alive(pids: set[int]) -> set[int]:
    """The pids that are still running (zombies count as gone)."""
    left = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] not in "ZX":
            left.add(pid)
    return left


# ---------------------------------------------------------------- tiny TOML writer
# (the venv has tomllib to read TOML but nothing to write it)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(name: str, d: dict, out: list[str], header: str) -> None:
    out.append(header)
    subtables = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            subtables.append((k, v))
        elif _is_table_list(v):
            subtables.append((k, v))
        elif isinstance(v, dict):
            out.append(f"{k} = {{}}")
        else:
            out.append(f"{k} = {_toml_value(v)}")
    for k, v in subtables:
        if isinstance(v, dict):
            _table(f"{name}.{k}", v, out, f"[{name}.{k}]")
        else:
            for item in v:
                _table(f"{name}.{k}", item, out, f"[[{name}.{k}]]")


def to_toml(cfg: dict) -> str:
    out: list[str] = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            _table(k, v, out, f"[{k}]")
        elif _is_table_list(v):
            for item in v:
                _table(k, item, out, f"[[{k}]]")
        elif isinstance(v, list):  # empty list of tables
            out.insert(0, f"{k} = []")
        else:
            out.insert(0, f"{k} = {_toml_value(v)}")
    return "\n".join(out) + "\n"
