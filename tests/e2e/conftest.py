"""The end-to-end tier's fixtures: real processes on free loopback ports.

``stack`` (session): ONE whole stack for most end-to-end tests -- Envoy, the
router, a real vLLM worker on the tiny model and a sim worker -- with API
keys configured (see stackutil.API_KEYS).  It is a ``deploy.stack.Stack``:
``envoy_url``, ``router_url``, ``zmq_frontend``, ``admin_url``,
``metrics_url``, ``cfg``, ``cfg_path``, ``run_dir``, ``components``.
Tests must leave it as they found it (no stopping components, no using
up ``KEY_ALPHA``/``KEY_BETA`` rate limits).

``sim_stack`` (session): the same without vLLM and without API keys (only
``sim-tiny``, ~1 s to start) for dataplane tests that need no real model.

Tests that break their stack on purpose start their own with
``stackutil.write_config`` + ``stackutil.start_stack``.

``embed_stack`` (session): Envoy, the router, a real vLLM pooling worker on
``models/tiny-embed`` and a sim generation model, with one API key
(``stackutil.EMBED_KEY``, a token budget): the embeddings tests and the
differential test against ``vllm serve`` share it.

``redis_url`` (module): a real redis-server for the Redis quota, lease and
response stores.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import stackutil
from stackutil import free_port

from shared.keys import digest


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    if not (stackutil.TINY_MODEL_DIR / "config.json").exists():
        pytest.fail(f"tiny model missing: run `weir make-model {stackutil.TINY_MODEL_DIR}`")
    d = tmp_path_factory.mktemp("stack")
    cfg_path = stackutil.write_config(
        d,
        envoy={"max_request_bytes": stackutil.STACK_MAX_REQUEST_BYTES},
        models=stackutil.localconfig.models(vllm_max_model_len=stackutil.STACK_VLLM_MAX_LEN),
        workers=[stackutil.vllm_worker("vllm-0"), stackutil.sim_worker("sim-0")],
        api_keys=stackutil.API_KEYS,
    )
    yield from _run(cfg_path, d / "run")


@pytest.fixture(scope="session")
def sim_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("sim_stack")
    cfg_path = stackutil.write_config(d, workers=[stackutil.sim_worker("sim-0")])
    yield from _run(cfg_path, d / "run")


@pytest.fixture(scope="session")
def embed_stack(tmp_path_factory):
    if not (stackutil.EMBED_DIR / "config.json").exists():
        pytest.fail(f"embedding model missing: run `weir make-model --embed {stackutil.EMBED_DIR}`")
    d = tmp_path_factory.mktemp("embed_stack")
    model = {
        "name": stackutil.EMBED_MODEL,
        "engine": "vllm",
        "task": "embed",
        "path": str(stackutil.EMBED_DIR),
        "max_model_len": stackutil.EMBED_MAX_LEN,
    }
    cfg_path = stackutil.write_config(
        d,
        models=[model, {"name": stackutil.SIM_MODEL, "engine": "sim", "max_model_len": 4096}],
        workers=[
            {
                "id": "embed-0",
                "model": stackutil.EMBED_MODEL,
                "max_num_seqs": stackutil.EMBED_MAX_NUM_SEQS,
                "kv_cache_bytes": stackutil.EMBED_KV_CACHE_BYTES,
                "env": dict(stackutil.localconfig.CPU_ENGINE_ENV),
            },
            stackutil.sim_worker("sim-0"),
        ],
        api_keys=[{"key_sha256": digest(stackutil.EMBED_KEY), "tenant": "emb", "tokens_per_minute": 100000}],
    )
    yield from _run(cfg_path, d / "run")


def _run(cfg_path, run_dir):
    with stackutil.start_stack(cfg_path, run_dir) as s:
        yield s
        procs = stackutil.stack_processes(s)  # vLLM's EngineCore & co. included
    left = stackutil.alive(procs)
    assert not left, f"processes left after Stack.stop(): {sorted(left)}"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port, one per test module that asks for it."""
    exe = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if exe is None:
        pytest.fail("redis-server not found: `make setup` installs it (Debian's redis-server)")
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)]
    with open(d / "redis.log", "wb") as log:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (d / "redis.log").read_text()
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
