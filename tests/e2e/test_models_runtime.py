"""Models at run time: ``weir models add`` then ``remove`` on a running,
supervised stack (real Envoy, router, sim workers) while other traffic runs.

Requests for the other model all succeed; requests for the removed one
finish, or get a clear 503 model_unloading (Retry-After) while it drains and
a 404 once it is gone -- none hangs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import requests
import stackutil

EXTRA = "sim-extra"


def _weir(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weir.cli", *args], cwd=stackutil.REPO, capture_output=True, text=True, timeout=120
    )


def _models(stack) -> dict[str, dict]:
    return {m["id"]: m for m in requests.get(stack.envoy_url + "/v1/models", timeout=5).json()["data"]}


def test_add_then_remove_a_model_under_load(tmp_path):
    cfg = stackutil.write_config(tmp_path, workers=[stackutil.sim_worker("sim-0")])
    with stackutil.start_stack(cfg, tmp_path / "run", supervise=True) as s:
        results: dict[str, list] = {stackutil.SIM_MODEL: [], EXTRA: []}
        stop = {stackutil.SIM_MODEL: threading.Event(), EXTRA: threading.Event()}

        def load(model: str, max_tokens: int) -> None:
            with requests.Session() as http:
                while not stop[model].is_set():
                    t0 = time.monotonic()
                    try:
                        r = http.post(
                            s.envoy_url + "/v1/completions",
                            timeout=30,
                            json={"model": model, "prompt": "a b c", "max_tokens": max_tokens, "ignore_eos": True},
                        )
                        body = r.json()
                        results[model].append(
                            (
                                r.status_code,
                                body.get("error", {}).get("code"),
                                r.headers.get("retry-after"),
                                time.monotonic() - t0,
                                body.get("usage", {}).get("completion_tokens"),
                            )
                        )
                    except requests.RequestException as e:  # a hang or a reset: the test fails on it
                        results[model].append(("exception", repr(e), None, time.monotonic() - t0, None))

        others = [threading.Thread(target=load, args=(stackutil.SIM_MODEL, 32)) for _ in range(2)]
        for t in others:
            t.start()

        t0 = time.monotonic()
        out = _weir(
            "models",
            "add",
            EXTRA,
            "--engine",
            "sim",
            "--max-model-len",
            "4096",
            "--workers",
            "1",
            "--wait",
            "--config",
            str(cfg),
        )
        assert out.returncode == 0, out.stdout + out.stderr
        while (
            requests.post(
                s.envoy_url + "/v1/completions", timeout=10, json={"model": EXTRA, "prompt": "x", "max_tokens": 2}
            ).status_code
            != 200
        ):
            assert time.monotonic() - t0 < 60
            time.sleep(0.05)
        added_s = time.monotonic() - t0
        assert _models(s)[EXTRA]["state"] == "ready" and _models(s)[EXTRA]["ready_workers"] == 1

        extra = [threading.Thread(target=load, args=(EXTRA, 200)) for _ in range(3)]  # ~0.5 s each: in flight
        for t in extra:
            t.start()
        time.sleep(1.5)
        t1 = time.monotonic()
        out = _weir("models", "remove", EXTRA, "--wait", "--config", str(cfg))
        removed_s = time.monotonic() - t1
        assert out.returncode == 0, out.stdout + out.stderr
        time.sleep(0.5)  # requests for it now: 404
        stop[EXTRA].set()
        for t in extra:
            t.join(60)
        stop[stackutil.SIM_MODEL].set()
        for t in others:
            t.join(60)

        assert EXTRA not in _models(s) and stackutil.SIM_MODEL in _models(s)
        worker = s.components[f"worker:{EXTRA}-0"]
        # (remove --wait returns on the worker's Goodbye: the process may still be exiting)
        assert (
            worker.proc.wait(timeout=15) == 0 and s.restarts.get(f"worker:{EXTRA}-0") is None
        )  # drained, not restarted
        assert f"{EXTRA}-0" not in {w["id"] for w in requests.get(s.router_url + "/admin/workers", timeout=5).json()}

        other = results[stackutil.SIM_MODEL]
        assert other and all(r[0] == 200 and r[4] == 32 for r in other), [r for r in other if r[0] != 200]
        mine = results[EXTRA]
        kinds = {(r[0], r[1]) for r in mine}
        assert kinds <= {(200, None), (503, "model_unloading"), (404, "model_not_found")}, kinds
        assert (200, None) in kinds and (404, "model_not_found") in kinds
        assert all(r[4] == 200 for r in mine if r[0] == 200)  # in flight at the removal: finished whole
        assert all(r[2] is not None for r in mine if r[0] == 503)  # Retry-After
        assert max(r[3] for r in mine) < 15  # none hung
        print(
            f"\nadd to first served request {added_s:.2f} s; remove under load {removed_s:.2f} s; "
            f"{len(other)} requests for {stackutil.SIM_MODEL} all ok; {EXTRA}: "
            f"{sum(r[0] == 200 for r in mine)} ok, {sum(r[0] == 503 for r in mine)} unloading, "
            f"{sum(r[0] == 404 for r in mine)} not found"
        )
