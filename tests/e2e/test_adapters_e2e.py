"""LoRA adapters end to end: real Envoy, router and vLLM (CPU build) workers.

One stack for the module (an admin listener and an admin token, for the
run-time routes): ``tiny-llama`` with three tiny adapters
(deploy/make_adapter.py, seeds 1, 2 and 5) on a LoRA worker that holds one
adapter in its engine at a time (``max_loras`` 1, so they take turns), and
``tiny-plain``: the same weights without LoRA and without a worker (a base
that refuses adapters).  The session ``stack``'s tiny-llama (LoRA off) is
the reference for the base model's output, and ``vllm serve --enable-lora
--lora-modules ...`` with the same engine settings and adapters the
reference for each adapter's greedy output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import requests
import stackutil

from deploy.make_adapter import build as build_adapter
from router.lifecycle.adapters import lora_id
from shared.client import Client

BASE = stackutil.VLLM_MODEL
PLAIN = "tiny-plain"
LORA_A, LORA_B, LORA_E = "tiny-lora-a", "tiny-lora-b", "tiny-lora-e"
LORA_BOUNDS = {"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 2}
PROMPT = "The quick brown fox"
ADMIN_TOKEN = "weir-admin-test-token"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """The three adapters (lora-a, lora-b, lora-e) and the stack's files."""
    d = tmp_path_factory.mktemp("lora_stack")
    for sub, seed in (("lora-a", 1), ("lora-b", 2), ("lora-e", 5)):
        build_adapter(str(d / sub), str(stackutil.TINY_MODEL_DIR), seed=seed)
    return d


@pytest.fixture(scope="module")
def lora_stack(lora_dir, vllm_serve_started, request):
    # (vllm serve, the reference of test_adapters_answer_as_vllm_serve_does, starts meanwhile,
    # and the session ``stack`` (the base model's reference) too when a selected test needs it
    # and it is not up yet: vLLM starts side by side take seconds longer than one, not twice as long)
    d = lora_dir
    models = stackutil.localconfig.models()
    models[0]["lora"] = LORA_BOUNDS
    models.append({"name": PLAIN, "engine": "vllm", "path": str(stackutil.TINY_MODEL_DIR), "max_model_len": 512})
    (d / "admin.token").write_text(ADMIN_TOKEN + "\n")
    admin_port = stackutil.free_port()
    cfg = stackutil.write_config(
        d,
        router={"admin_http": f"127.0.0.1:{admin_port}", "admin_token_file": str(d / "admin.token")},
        models=models,
        adapters=[
            {"name": n, "base": BASE, "path": str(d / sub)}
            for n, sub in ((LORA_A, "lora-a"), (LORA_B, "lora-b"), (LORA_E, "lora-e"))
        ],
        workers=[stackutil.vllm_worker("vllm-lora")],
    )
    with stackutil.start_stack_beside(cfg, d / "run", lambda: stackutil.start_if_selected(request, "stack")) as s:
        s.lora_admin = f"http://127.0.0.1:{admin_port}"  # (the router's admin listener)
        s.lora_dir = d
        yield s


def _complete(stack, model: str, prompt: str = PROMPT) -> requests.Response:
    return requests.post(
        stack.envoy_url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )


def _text(stack, model: str, prompt: str = PROMPT) -> str:
    r = _complete(stack, model, prompt)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model  # the answer names what was asked for: the adapter, not its base
    return body["choices"][0]["text"]


def test_adapters_listed_with_their_base_as_parent(lora_stack):
    data = {m["id"]: m for m in requests.get(lora_stack.envoy_url + "/v1/models", timeout=5).json()["data"]}
    assert data[LORA_A]["parent"] == BASE and data[LORA_B]["parent"] == BASE
    assert data[BASE]["parent"] is None
    one = requests.get(lora_stack.envoy_url + f"/v1/models/{LORA_B}", timeout=5).json()
    assert one["id"] == LORA_B and one["parent"] == BASE


def test_adapter_output_differs_from_the_base_and_is_deterministic(lora_stack, stack):
    base = _text(lora_stack, BASE)
    r = requests.post(
        stack.envoy_url + "/v1/completions",  # the session stack's tiny-llama: the same weights, LoRA off
        json={"model": BASE, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
        headers={"authorization": f"Bearer {stackutil.KEY_ALPHA}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    plain = r.json()["choices"][0]["text"]
    a1 = _text(lora_stack, LORA_A)
    b1 = _text(lora_stack, LORA_B)  # (max_loras 1: b takes a's engine slot)
    a2 = _text(lora_stack, LORA_A)  # ... and a comes back from the CPU cache
    base2 = _text(lora_stack, BASE)
    assert base == plain  # LoRA on the worker leaves the base model's output as it was
    assert a1 != base and b1 != base and a1 != b1
    assert a1 == a2 and base2 == base  # greedy under an adapter is deterministic; the base stays untouched

    # the worker's heartbeats tell the router what its engine holds: a in its one slot, b in its cache
    ids = {n: lora_id(n, str((lora_stack.lora_dir / d).resolve())) for n, d in ((LORA_A, "lora-a"), (LORA_B, "lora-b"))}
    want = {"slot": [ids[LORA_A]], "cache": [ids[LORA_B]], "loading": []}
    deadline = time.monotonic() + 10  # (until a heartbeat sent after the last request came)
    while True:
        workers = requests.get(lora_stack.router_url + "/admin/workers", timeout=5).json()
        w = next(x for x in workers if x["id"] == "vllm-lora")
        if w.get("adapters") == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert w["adapters"] == want


def test_adapter_in_chat_and_over_zeromq(lora_stack):
    r = requests.post(
        lora_stack.envoy_url + "/v1/chat/completions",
        json={"model": LORA_A, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == LORA_A
    http_text = _text(lora_stack, LORA_B)
    with Client(lora_stack.zmq_frontend, api_key=None) as c:
        zmq = c.complete(LORA_B, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert zmq.text == http_text  # the same adapter over the direct ZeroMQ client


def test_unknown_adapter_is_model_not_found(lora_stack):
    r = _complete(lora_stack, "tiny-lora-nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def _weir(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weir.cli", *args], cwd=stackutil.REPO, capture_output=True, text=True, timeout=120
    )


def test_adapter_added_and_removed_at_run_time_while_a_stream_runs(lora_stack):
    s = lora_stack
    path = build_adapter(str(s.lora_dir / "lora-c"), str(stackutil.TINY_MODEL_DIR), seed=3)
    big = build_adapter(str(s.lora_dir / "lora-big"), str(stackutil.TINY_MODEL_DIR), seed=3, rank=16)
    cfg = str(s.cfg_path)
    # refused at add time, with the reason: a rank over the workers' max_lora_rank, a base without LoRA
    out = _weir("models", "add-adapter", "tiny-lora-big", "--base", BASE, "--path", str(big), "--config", cfg)
    assert out.returncode == 1 and "exceeds" in out.stderr and "max_lora_rank 8" in out.stderr
    out = _weir("models", "add-adapter", "tiny-lora-p", "--base", PLAIN, "--path", str(path), "--config", cfg)
    assert out.returncode == 1 and "without LoRA" in out.stderr
    assert _complete(s, "tiny-lora-c").status_code == 404

    t0 = time.monotonic()
    out = _weir("models", "add-adapter", "tiny-lora-c", "--base", BASE, "--path", str(path), "--config", cfg)
    assert out.returncode == 0, out.stdout + out.stderr
    c = _text(s, "tiny-lora-c")
    print(f"\nadd-adapter to first served request: {time.monotonic() - t0:.2f} s")
    assert c not in (_text(s, BASE), _text(s, LORA_A))
    listed = _weir("models", "list", "--config", cfg)
    assert "tiny-lora-c" in listed.stdout and f"adapter of {BASE}" in listed.stdout
    out = _weir("models", "remove-adapter", "tiny-lora-nope", "--config", cfg)
    assert out.returncode == 1 and "no adapter" in out.stderr

    # a long stream under the adapter, removed meanwhile: it finishes whole; new requests get 404
    got: dict[str, object] = {"lines": []}
    started = threading.Event()

    def stream() -> None:
        r = requests.post(
            s.envoy_url + "/v1/completions",
            json={"model": "tiny-lora-c", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True},
            stream=True,
            timeout=120,
        )
        got["status"] = r.status_code
        for x in r.iter_lines():
            if x:
                got["lines"].append(x)  # type: ignore[attr-defined]
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    r = requests.post(s.lora_admin + "/admin/adapters/tiny-lora-c/remove", json={}, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "removed"
    assert t.is_alive()  # removed while its stream runs
    r = _complete(s, "tiny-lora-c")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    t.join(120)
    lines = got["lines"]
    assert got["status"] == 200 and lines[-1] == b"data: [DONE]"
    assert b'"finish_reason":"length"' in lines[-2] or b'"finish_reason":"length"' in lines[-3]
    assert not any(b'"error"' in x for x in lines)


def test_vllm_lora_routes_on_the_admin_listener_and_through_envoy_with_the_token(lora_stack):
    s = lora_stack
    path = build_adapter(str(s.lora_dir / "lora-d"), str(stackutil.TINY_MODEL_DIR), seed=4)
    body = {"lora_name": "tiny-lora-d", "lora_path": str(path)}
    # through Envoy (or the API listener): the admin token or nothing
    r = requests.post(s.envoy_url + "/v1/load_lora_adapter", json=body, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    # the admin listener, from loopback: as vLLM (the one model running LoRA is the base)
    r = requests.post(s.lora_admin + "/v1/load_lora_adapter", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'tiny-lora-d' added successfully."
    d = _text(s, "tiny-lora-d")
    assert d != _text(s, BASE)
    again = requests.post(s.lora_admin + "/v1/load_lora_adapter", json=body, timeout=10)
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    r = requests.post(
        s.envoy_url + "/v1/unload_lora_adapter",
        json={"lora_name": "tiny-lora-d"},
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tiny-lora-d' removed successfully."
    assert _complete(s, "tiny-lora-d").status_code == 404
    r = requests.post(s.lora_admin + "/v1/unload_lora_adapter", json={"lora_name": "tiny-lora-d"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_prompt_logprobs_on_a_cpu_lora_worker_are_refused_and_the_engine_lives(lora_stack):
    # vLLM's CPU LoRA kernels cannot compute prompt logprobs for two sequences of a step: the
    # step raises and the engine dies (each time it is resumed), for the base model's requests
    # too; the worker refuses every prompt-logprobs request instead (one alone would be batched
    # with others under load)
    for model, prompt in ((BASE, ["The river", "A mountain"]), (LORA_A, "The river runs")):
        r = requests.post(
            lora_stack.envoy_url + "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 8, "echo": True, "logprobs": 2, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "echo" and "prompt logprobs" in err["message"], err
    text = _text(lora_stack, LORA_A)  # the engine still serves, the adapter still applied
    assert text != _text(lora_stack, BASE)
    workers = requests.get(lora_stack.router_url + "/admin/workers", timeout=5).json()
    assert [w["id"] for w in workers if w["id"] == "vllm-lora"] == ["vllm-lora"]


@pytest.fixture(scope="module")
def vllm_serve_started(lora_dir):
    """vLLM's own server with the LoRA worker's engine settings and the three adapters, started
    (not yet healthy: ``vllm_serve_lora`` waits for it): (process, url, log)."""
    port = stackutil.free_port()
    log_path = lora_dir / "vllm-serve.log"
    adapters = [f"{n}={lora_dir / d}" for n, d in ((LORA_A, "lora-a"), (LORA_B, "lora-b"), (LORA_E, "lora-e"))]
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(stackutil.TINY_MODEL_DIR),
        "--served-model-name", BASE,
        "--max-model-len", "512",
        "--max-num-seqs", "16",
        "--dtype", "bfloat16",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(stackutil.TEST_KV_CACHE_BYTES),
        "--enable-lora",
        "--max-loras", str(LORA_BOUNDS["max_loras"]),
        "--max-lora-rank", str(LORA_BOUNDS["max_lora_rank"]),
        "--max-cpu-loras", str(LORA_BOUNDS["max_cpu_loras"]),
        "--lora-modules", *adapters,
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, **stackutil.localconfig.CPU_ENGINE_ENV, "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
    try:
        yield proc, f"http://127.0.0.1:{port}", log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def vllm_serve_lora(vllm_serve_started):
    """``vllm_serve_started``'s URL, once it answers /health."""
    proc, url, log_path = vllm_serve_started
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited ({proc.returncode}); log: {log_path.read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return url
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vllm serve did not become healthy; log: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def _greedy(base_url: str, path: str, model: str, stream: bool) -> tuple[str, Any]:
    """The model an answer names and what a greedy answer must agree on: texts, finish reasons, token counts."""
    prompt: dict[str, Any] = (
        {"prompt": "Once upon a time"}
        if path == "/v1/completions"
        else {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]}
    )
    body = {"model": model, **prompt, "max_tokens": 16, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = requests.post(base_url + path, json=body, timeout=60, stream=stream)
    assert r.status_code == 200, f"{base_url} {model}: {r.status_code} {r.text[:300]}"
    if not stream:
        c = r.json()["choices"][0]
        text = c["text"] if "text" in c else c["message"]["content"]
        u = r.json()["usage"]
        return r.json()["model"], (text, c["finish_reason"], u["prompt_tokens"], u["completion_tokens"])
    text, finish, usage, named = "", None, None, set()
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            e = json.loads(line[6:])
            named.add(e["model"])
            for c in e["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
            if e.get("usage"):
                usage = (e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"])
    (name,) = named
    return name, (text, finish, usage)


def test_adapters_answer_as_vllm_serve_does(lora_stack, vllm_serve_lora):
    """Greedy output through weir (Envoy, router, a LoRA worker taking the three adapters in
    turns through its one slot) equals `vllm serve --enable-lora --lora-modules ...`'s, token
    for token, for each adapter and the base: completions, chat, chat streamed."""
    models = [BASE, LORA_A, LORA_B, LORA_E]
    cases = [("/v1/completions", False), ("/v1/chat/completions", False), ("/v1/chat/completions", True)]
    problems, ours = [], {}
    for model in models:
        for path, stream in cases:
            theirs_named, theirs = _greedy(vllm_serve_lora, path, model, stream)
            ours_named, ours[model, path, stream] = _greedy(lora_stack.envoy_url, path, model, stream)
            if (theirs_named, ours_named) != (model, model) or theirs != ours[model, path, stream]:
                problems.append(
                    f"{model} {path} stream={stream}:\n  vllm {theirs_named} {theirs}\n  weir {ours_named} {ours[model, path, stream]}"
                )
    print(f"\nadapters vs vllm serve: {len(ours) - len(problems)}/{len(ours)} greedy answers agree")
    assert not problems, "\n".join(problems)
    for path, stream in cases:  # the adapters are applied: each answers unlike the base and the others
        assert len({ours[m, path, stream] for m in models}) == len(models), (path, stream)


def test_the_supervisor_tells_a_restarted_router_of_the_adapters_added_at_run_time(tmp_path):
    # (tiny-llama runs LoRA but no worker: adapters are checked and listed, none served; a sim worker)
    a = build_adapter(str(tmp_path / "lora-a"), str(stackutil.TINY_MODEL_DIR), seed=1)
    b = build_adapter(str(tmp_path / "lora-b"), str(stackutil.TINY_MODEL_DIR), seed=2)
    models = stackutil.localconfig.models()
    models[0]["lora"] = LORA_BOUNDS
    cfg = stackutil.write_config(tmp_path, models=models, workers=[stackutil.sim_worker("sim-0")])
    with stackutil.start_stack(cfg, tmp_path / "run", supervise=True) as s:

        def listed() -> set[str]:
            return {x["name"] for x in requests.get(s.router_url + "/admin/adapters", timeout=5).json()}

        for name, path in ((LORA_A, a), (LORA_B, b)):
            body = {"adapter": {"name": name, "base": BASE, "path": str(path)}}
            assert requests.post(s.router_url + "/admin/adapters", json=body, timeout=10).status_code == 200
        assert requests.post(s.router_url + f"/admin/adapters/{LORA_B}/remove", json={}, timeout=10).ok
        assert listed() == {LORA_A}
        time.sleep(3.0)  # (the supervisor's passes, every 0.5 s, see them: a added, b removed)
        router = s.components["router"]
        old_pid = router.pid
        router.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + 30
        got: set[str] = set()
        while time.monotonic() < deadline:
            try:
                if router.pid != old_pid and (got := listed()) == {LORA_A}:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        assert s.restarts == {"router": 1}
        assert got == {LORA_A}  # told again of a; b, removed before, stays removed
        time.sleep(1.0)
        assert listed() == {LORA_A}
