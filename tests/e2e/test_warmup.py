"""Warm-up (engine_worker/warmup.py): a short generation through the engine
(on vLLM a sampled one with logprobs beside it) before the worker registers; on by default, ``warmup = false`` skips it, a
failed warm-up keeps the worker from registering.  The first request's
latency with and without is a benchmark (bench/scenarios/warmup.py)."""

from __future__ import annotations

import subprocess
import sys

import requests
import stackutil


def _log(stack, worker_id: str) -> str:
    return stack.components[f"worker:{worker_id}"].log_path.read_text(errors="replace")


def _before(text: str, first: str, then: str) -> bool:
    return first in text and then in text and text.index(first) < text.index(then)


def test_worker_warms_up_before_it_registers(sim_stack):
    text = _log(sim_stack, "sim-0")
    assert _before(text, "worker sim-0 warmed up: generated through the engine", "worker sim-0 registered")


def test_real_vllm_worker_warms_up_before_it_registers(stack):
    text = _log(stack, "vllm-0")
    assert _before(text, "worker vllm-0 warmed up: generated through the engine", "worker vllm-0 registered")


def test_warmup_off_and_a_failed_warmup(tmp_path):
    cfg = stackutil.write_config(
        tmp_path,
        workers=[
            stackutil.sim_worker("sim-cold", warmup=False),
            stackutil.sim_worker("sim-bad", warmup_timeout_s=1e-6),
        ],
    )
    with stackutil.start_stack(cfg, tmp_path / "run", workers=["sim-cold"]) as s:
        text = _log(s, "sim-cold")
        assert "registered" in text and "warmed up" not in text
        # A worker whose warm-up cannot finish (1 us for a whole generation) never registers: exit 1.
        out = subprocess.run(
            [sys.executable, "-m", "engine_worker", "--config", str(cfg), "--worker-id", "sim-bad"],
            cwd=stackutil.REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1
        assert "warm-up generation failed (no result in 1e-06 s): not registering" in out.stderr
        workers = requests.get(s.router_url + "/admin/workers", timeout=5).json()
        assert "sim-bad" not in {w["id"] for w in workers}
