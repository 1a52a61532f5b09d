"""`weir bench` smoke runs against a real stack (sim worker): a few requests
per target; asserts the report's shape and that counts add up, not timings.
The workload specs, arrivals and argument checks: tests/unit/test_bench_workloads.py."""

from __future__ import annotations

import json
import os

import pytest
from stackutil import free_port

from bench import spec
from bench.cli import main as bench_main
from bench.prompts import PromptMaker
from bench.runner import plan
from weir.cli import main as weir_main

N = 8
LAT_KEYS = {"p50", "p90", "p99", "mean", "min", "max"}


def _run(tmp_path, *args: str, cli=bench_main) -> tuple[int, dict]:
    out = tmp_path / "out"
    argv = list(args) + ["--no-progress", "--out", str(out)]
    rc = cli(["bench", *argv]) if cli is weir_main else cli(argv)
    data = json.loads((out / "result.json").read_text())
    return rc, data


def _assert_counts_add_up(summary: dict) -> None:
    groups = [summary["overall"], *summary["classes"].values()]
    for s in groups:
        assert s["sent"] == s["ok"] + sum(s["http_errors"].values()) + s["errors"] + s["incomplete"]
        assert s["rate_limited_429"] == s["http_errors"].get("429", 0)
        assert s["unavailable_503"] == s["http_errors"].get("503", 0)
    for key in ("sent", "ok", "errors", "incomplete", "output_tokens"):
        assert summary["overall"][key] == sum(c[key] for c in summary["classes"].values())


def _url(stack, kind: str) -> str:
    return {"router": stack.router_url, "envoy": stack.envoy_url, "zmq": stack.zmq_frontend}[kind]


@pytest.mark.parametrize("kind,mode", [("router", ["-c", "4"]), ("envoy", ["--rate", "200"]), ("zmq", ["-c", "3"])])
def test_smoke_run_every_target(sim_stack, tmp_path, kind, mode):
    rc, data = _run(tmp_path, "-w", "smoke", "-t", kind, "--url", _url(sim_stack, kind), "-n", str(N), *mode)
    assert rc == 0
    assert set(data) == {"meta", "summary", "requests"}
    meta, summary, reqs = data["meta"], data["summary"], data["requests"]
    assert meta["target_kind"] == kind and meta["limits"]["num_requests"] == N
    o = summary["overall"]
    assert o["sent"] == o["ok"] == N, o.get("first_error")
    _assert_counts_add_up(summary)
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(o[m]) == LAT_KEYS
        assert o[m]["p50"] <= o[m]["p90"] <= o[m]["p99"] <= o[m]["max"]
    assert o["goodput_fraction"] is not None and 0 <= o["goodput_fraction"] <= 1
    assert o["throughput_rps"] > 0 and o["output_tok_per_s"] > 0

    # Every request got exactly the tokens it asked for (the sim never stops
    # early), and the engine's prompt count is the length the spec drew.
    planned = plan(spec.load("smoke"), N, PromptMaker())
    assert [r["cls"] for r in reqs] == [p.cls.name for p in planned]
    assert [r["output_tokens"] for r in reqs] == [p.max_tokens for p in planned]
    assert sum(r["output_tokens"] for r in reqs) == o["output_tokens"]
    assert [r["prompt_tokens"] for r in reqs] == [len(p.prompt) // 4 for p in planned]
    for r in reqs:
        assert r["status"] == 200 and r["finish_reason"] == "length"
        # the sim streams one event per engine step and token, but a worker that
        # falls a step behind on a loaded machine sends two steps' tokens in one
        assert r["output_tokens"] * 0.5 <= r["events"] <= r["output_tokens"]
        assert len(r["itl"]) == r["events"] - 1
        assert 0 < r["ttft"] <= r["end"] - r["start"]

    assert {p.cls.name for p in planned} == set(summary["classes"]) == {"short", "long"}
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| short |" in md and "| long |" in md and "| overall |" in md
    assert (tmp_path / "out" / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refusals_are_counted_by_status(sim_stack, tmp_path):
    # Unknown model: every request is refused with one 4xx status, none ok.
    rc, data = _run(
        tmp_path,
        "-w",
        "smoke",
        "-t",
        "router",
        "--url",
        sim_stack.router_url,
        "-n",
        "5",
        "-c",
        "2",
        "--model",
        "sim-no-such-model",
        "--no-plots",
    )
    assert rc == 1  # nothing succeeded
    o = data["summary"]["overall"]
    assert o["ok"] == 0 and o["errors"] == 0 and o["incomplete"] == 0
    assert len(o["http_errors"]) == 1 and sum(o["http_errors"].values()) == 5
    assert 400 <= int(next(iter(o["http_errors"]))) < 500
    assert "sim-no-such-model" in o["first_error"]
    assert o["ttft_ms"] is None and o["e2e_ms"] is None
    _assert_counts_add_up(data["summary"])


def test_unreachable_target_counts_transport_errors(tmp_path):
    rc, data = _run(
        tmp_path,
        "-w",
        "smoke",
        "-t",
        "openai",
        "--url",
        f"http://127.0.0.1:{free_port()}/v1",
        "-n",
        "3",
        "-c",
        "1",
        "--no-plots",
    )
    assert rc == 1
    o = data["summary"]["overall"]
    assert o["errors"] == o["sent"] == 3 and o["ok"] == 0
    _assert_counts_add_up(data["summary"])


def test_time_limit_bounds_the_run(sim_stack, tmp_path):
    # 40 requests at 20/s would take 2 s; the 0.5 s limit stops sending early.
    rc, data = _run(
        tmp_path,
        "-w",
        "smoke",
        "-t",
        "zmq",
        "--url",
        sim_stack.zmq_frontend,
        "-n",
        "40",
        "--rate",
        "20",
        "--duration",
        "0.5",
        "--no-plots",
        cli=weir_main,
    )
    assert rc == 0
    o = data["summary"]["overall"]
    assert 2 <= o["sent"] < 40
    assert all(r["scheduled"] <= 0.5 for r in data["requests"])
    _assert_counts_add_up(data["summary"])


def test_relay_floor_answers_through_its_worker_process(tmp_path):
    # The overhead scenario's relay floor: client -> relay process -> worker
    # process and back.  Every request is answered while the worker runs; with
    # the worker gone the relay answers nothing (it forwards, it never replies).
    import subprocess
    import sys
    import time

    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    relay = subprocess.Popen([sys.executable, "-m", "bench.echo", "--relay", f"{front},{back}"])
    worker = subprocess.Popen([sys.executable, "-m", "bench.echo", "--worker", back])
    try:
        deadline = time.monotonic() + 60  # both started and the worker's hello in (a loaded CI machine is slow)
        while (
            _run(
                tmp_path / "probe",
                "-w",
                "one-token",
                "-t",
                "zmq",
                "--url",
                front,
                "-n",
                "1",
                "--duration",
                "1",
                "--drain",
                "1",
                "--no-plots",
            )[1]["summary"]["overall"]["ok"]
            != 1
        ):
            assert time.monotonic() < deadline, "the relay floor never answered"
        rc, data = _run(
            tmp_path / "up", "-w", "one-token", "-t", "zmq", "--url", front, "-n", "20", "-c", "2", "--no-plots"
        )
        assert rc == 0
        o = data["summary"]["overall"]
        assert o["ok"] == o["sent"] == 20 and o["output_tokens"] == 20
        worker.terminate()
        worker.wait()
        rc, data = _run(
            tmp_path / "down",
            "-w",
            "one-token",
            "-t",
            "zmq",
            "--url",
            front,
            "-n",
            "2",
            "-c",
            "2",
            "--duration",
            "1",
            "--drain",
            "1",
            "--no-plots",
        )
        assert data["summary"]["overall"]["ok"] == 0
    finally:
        for p in (relay, worker):
            p.terminate()
            p.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning apart needs two CPUs")
def test_cpu_cost_pins_every_engine_thread_apart_from_the_rest(tmp_path):
    # cpu_cost --pin-engine: every thread of a process titled as vLLM's engine
    # goes onto the engine's CPUs, every thread of any other process of the
    # groups onto the others; a process outside the groups keeps its own.
    import subprocess
    import sys

    from bench.scenarios.cpu_cost import pin_engine

    child = (
        "import sys, threading, time\n"
        "if sys.argv[1]: open('/proc/self/comm', 'w').write(sys.argv[1])\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", child, title], stdout=subprocess.PIPE, text=True, start_new_session=own_group
        )
        for name, title, own_group in (("engine", "VLLM::EngineCor", True), ("front", "", True), ("other", "", False))
    }
    try:
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline() == "up\n"
        cpus = sorted(os.sched_getaffinity(0))
        before = os.sched_getaffinity(procs["other"].pid)
        pin_engine({"engine": procs["engine"].pid, "front": procs["front"].pid}, {cpus[-1]}, set(cpus[:-1]))

        def affinities(pid: int) -> list[set[int]]:
            return [os.sched_getaffinity(int(t)) for t in sorted(os.listdir(f"/proc/{pid}/task"))]

        assert affinities(procs["engine"].pid) == [{cpus[-1]}] * 2
        assert affinities(procs["front"].pid) == [set(cpus[:-1])] * 2
        assert os.sched_getaffinity(procs["other"].pid) == before
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_uploads_scenario_reports_memory_and_gaps(tmp_path):
    """bench.scenarios.uploads, small: every upload stored whole, the report's figures present."""
    from bench.scenarios import uploads

    out = tmp_path / "out"
    rc = uploads.main(
        [
            "--uploads",
            "2",
            "--mib",
            "2",
            "--seconds",
            "2",
            "--rate",
            "10",
            "--tokens",
            "16",
            "--after-s",
            "1",
            "--out",
            str(out),
        ]
    )
    r = json.loads((out / "uploads.json").read_text())
    assert rc == 0 and r["files_intact"] == 2
    b = r["with_uploads"]
    assert [u["status"] for u in b["uploads"]] == [200, 200]
    # each reading is of the live router (the peak is the highest sample during the uploads:
    # with 2 MiB uploads it can sit a few KiB under the reading before them, as memory is returned)
    assert all(b[k] > 0 for k in ("router_rss_before_mib", "router_rss_peak_mib", "router_rss_10s_after_mib"))
    assert r["alone"]["streams"] > 0 and r["alone"]["failed_streams"] == 0
    assert "router RSS" in (out / "README.md").read_text()
