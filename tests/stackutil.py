"""Helpers for end-to-end tests: free ports, test configs, stacks.

cfg_path = write_config(tmp_path, workers=[sim_worker()])
with start_stack(cfg_path) as stack:
    requests.get(stack.envoy_url + "/v1/models")
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from bench import localconfig
from bench.localconfig import REPO, SIM_MODEL, TINY_MODEL_DIR, VLLM_MODEL, free_port, sim_worker  # noqa: F401
from deploy.stack import Stack, group_members

# API keys of the shared `stack` fixture (tests/e2e/conftest.py).
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
# 16 MiB = 32k tokens of the tiny model: admission limits are reachable in tests.
TEST_KV_CACHE_BYTES = 16 << 20
# The shared stack's vLLM context: long enough that a stream a test walks away
# from runs for seconds (~2.5 ms a token), so its cancel cannot lose a race
# with the stream finishing on a slow or stalled CI machine.
STACK_VLLM_MAX_LEN = 2048
LONG_STREAM_TOKENS = STACK_VLLM_MAX_LEN - 64
TOO_LONG_PROMPT = "word " * (STACK_VLLM_MAX_LEN + 500)
# The embedding stack (tests/e2e/conftest.py's ``embed_stack``): models/tiny-embed on a real vLLM pooling worker.
EMBED_DIR = REPO / "models" / "tiny-embed"
EMBED_MODEL = "tiny-embed"
EMBED_KEY = "sk-test-embed-51c0ffee"
EMBED_MAX_LEN = 256
EMBED_MAX_NUM_SEQS = 16
EMBED_KV_CACHE_BYTES = 8 << 20


def vllm_worker(worker_id: str = "vllm-0", **overrides: Any) -> dict:
    """A real vLLM worker on the tiny model with the tests' small KV budget."""
    return localconfig.vllm_worker(worker_id, **{"kv_cache_bytes": TEST_KV_CACHE_BYTES, **overrides})


def write_config(tmp_path: os.PathLike, name: str = "weir.toml", **overrides: Any) -> Path:
    """Write a test config (free loopback ports, one sim worker, the tests'
    per-key rate limit) and return its path; see bench.localconfig.merge
    for how ``overrides`` apply."""
    defaults = {"rate_limit": {"per_key_rps": PER_KEY_RPS, "per_key_burst": PER_KEY_BURST}}
    return localconfig.write_config(tmp_path, name, defaults=defaults, **overrides)


@contextlib.contextmanager
def start_stack(cfg_path: os.PathLike, run_dir: os.PathLike | None = None, **kw: Any) -> Iterator[Stack]:
    """A started Stack (progress lines on stderr, for `pytest -s`); always stopped."""
    stack = Stack(cfg_path, run_dir, progress=lambda m: print(f"[stack] {m}", file=sys.stderr), **kw)
    with stack:
        yield stack


@contextlib.contextmanager
def start_stack_beside(
    cfg_path: os.PathLike, run_dir: os.PathLike | None, meanwhile: Callable[[], object], **kw: Any
) -> Iterator[Stack]:
    """``start_stack`` that runs ``meanwhile()`` (another fixture's start, say) in
    this thread while the stack starts in another: two vLLM starts side by side
    take a few seconds longer than one, not twice as long.  That thread holds
    the stack until it is stopped: each component dies with the thread that
    spawned it (PR_SET_PDEATHSIG is per thread).  Always stopped, also when
    ``meanwhile()`` raises."""
    stack = Stack(cfg_path, run_dir, progress=lambda m: print(f"[stack] {m}", file=sys.stderr), **kw)
    started, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def hold() -> None:
        try:
            stack.start()  # (stops what it started before it raises)
        except BaseException as e:
            failed.append(e)
            return
        finally:
            started.set()
        try:
            done.wait()
        finally:
            stack.stop()

    holder = threading.Thread(target=hold, name="stack-holder", daemon=True)
    holder.start()
    try:
        meanwhile()
        started.wait()
        if failed:
            raise failed[0]
        yield stack
    finally:
        done.set()
        holder.join()


def start_if_selected(request: pytest.FixtureRequest, name: str) -> None:
    """Set up the fixture ``name`` now if a selected test asks for it: a
    ``start_stack_beside`` ``meanwhile``.  Its error is kept (pytest caches
    it) for the tests that ask for it; the caller's tests run on."""
    if any(name in item.fixturenames for item in request.session.items):
        try:
            request.getfixturevalue(name)
        except (Exception, pytest.fail.Exception):
            pass


class VllmServe:
    """vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
    on ``model_dir`` served as ``name`` with ``args`` (engine settings), CPU
    engine env, in its own process group.  ``start`` returns at once (so two
    servers start side by side), ``wait`` until healthy (its URL), ``stop``
    always stops the group."""

    def __init__(self, model_dir: os.PathLike, name: str, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = localconfig.vllm_serve_argv(model_dir, name, self.port, *args)
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmServe:
        env = {**os.environ, **localconfig.CPU_ENGINE_ENV, "HF_HUB_OFFLINE": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
        return self

    def wait(self, timeout_s: float = 180) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); log: {self._log()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self.url
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not become healthy; log: {self._log()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def _log(self) -> str:
        return self.log_path.read_text()[-3000:]


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
