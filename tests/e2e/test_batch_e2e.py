"""The Batch API end to end: the openai SDK through Envoy, sim workers, real processes.

One stack per test that breaks it (SIGKILL, two routers); the API walk, the
bad lines, cancel and expiry share one supervised stack.
"""

from __future__ import annotations

import json
import signal
import time

import openai
import pytest
from stackutil import SIM_MODEL, localconfig, sim_worker, start_stack, write_config

# A sim line of 64 tokens takes ~0.2 s on 8 slots: a few hundred lines take seconds.
SLOW_SIM = {"step_fixed_ms": 3.0, "decode_token_us": 60.0}


def _lines(n: int, max_tokens: int = 16, url: str = "/v1/completions", start: int = 0) -> list[dict]:
    return [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": url,
            "body": {"model": SIM_MODEL, "prompt": f"line {i}", "max_tokens": max_tokens},
        }
        for i in range(start, start + n)
    ]


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.envoy_url + "/v1", api_key="none", max_retries=5, timeout=30)


def _wait(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch stuck in {b.status}: {b.request_counts}"
        time.sleep(0.2)


def _results(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]


def _config(tmp_path, **over):
    batch = {"directory": str(tmp_path / "batches"), "completion_windows": ["24h", "3s"], "scan_interval_s": 0.2}
    return write_config(tmp_path, batch={**batch, **over.pop("batch", {})}, **over)


@pytest.fixture(scope="module")
def batch_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch_stack")
    cfg = _config(
        d,
        models=[*localconfig.models(), localconfig.sim_embed_model()],
        workers=[
            sim_worker("sim-0", max_num_seqs=8, sim=SLOW_SIM),
            sim_worker("sim-e", model=localconfig.SIM_EMBED_MODEL, max_num_seqs=8),
        ],
    )
    with start_stack(cfg, d / "run") as s:
        yield s


def test_upload_create_poll_download_with_bad_lines_through_envoy(batch_stack):
    client = _client(batch_stack)
    good = _lines(30)
    bad = [
        {"custom_id": "other-endpoint", "method": "POST", "url": "/v1/chat/completions", "body": {"model": SIM_MODEL}},
        {
            "custom_id": "unknown-model",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "no-such-model", "prompt": "x", "max_tokens": 2},
        },
        {
            "custom_id": "bad-field",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": SIM_MODEL, "prompt": "x", "max_tokens": -1},
        },
    ]
    f = client.files.create(file=("in.jsonl", _jsonl(good + bad)), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).id == f.id
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"job": "e2e"}
    )
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "e2e"}
    done = _wait(client, b.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (33, 30, 3)
    assert done.usage.output_tokens == 30 * 16
    out = _results(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(x["custom_id"] for x in good)
    assert all(
        r["response"]["status_code"] == 200 and r["response"]["body"]["usage"]["completion_tokens"] == 16 for r in out
    )
    errs = {r["custom_id"]: r["response"] for r in _results(client, done.error_file_id)}
    assert errs["other-endpoint"]["status_code"] == 400 and errs["other-endpoint"]["body"]["error"]["param"] == "url"
    assert errs["unknown-model"]["status_code"] == 404
    assert errs["bad-field"]["status_code"] == 400 and errs["bad-field"]["body"]["error"]["param"] == "max_tokens"
    assert b.id in [x.id for x in client.batches.list()]
    import requests

    tenants = requests.get(batch_stack.router_url + "/admin/tenants", timeout=5).json()["batch"]
    assert tenants["anonymous"]["completed"] >= 30 and tenants["anonymous"]["tokens"] >= 30 * 16


def test_embeddings_and_prompt_list_lines_run_as_several_jobs_with_one_result_each(batch_stack):
    """An embeddings batch (lines of one or several inputs, one for a generation
    model), then a completions batch whose lines hold prompt lists and token ids."""
    client = _client(batch_stack)
    emb = localconfig.SIM_EMBED_MODEL
    inputs = {f"e-{i}": [f"text {i}.{k}" for k in range(1 + i % 3)] for i in range(12)}
    inputs["e-tokens"] = [[1, 2, 3], [4, 5]]
    rows = [
        {"custom_id": c, "method": "POST", "url": "/v1/embeddings", "body": {"model": emb, "input": x}}
        for c, x in inputs.items()
    ]
    rows.append(
        {
            "custom_id": "wrong-task",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": SIM_MODEL, "input": ["a", "b"]},
        }
    )
    rows.append(
        {
            "custom_id": "one-too-long",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": emb, "input": ["short", "word " * 3000]},
        }
    )
    f = client.files.create(file=("emb.jsonl", _jsonl(rows)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    done = _wait(client, b.id, {"completed", "failed"})
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (13, 2)
    out = _results(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(inputs)
    for r in out:
        body = r["response"]["body"]
        assert body["object"] == "list" and body["model"] == emb
        assert [d["index"] for d in body["data"]] == list(range(len(inputs[r["custom_id"]])))
        assert all(len(d["embedding"]) > 0 and isinstance(d["embedding"][0], float) for d in body["data"])
        assert body["usage"]["prompt_tokens"] > 0
    assert done.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out) > 0
    errs = {r["custom_id"]: r for r in _results(client, done.error_file_id)}
    assert errs["one-too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    err = errs["wrong-task"]
    live = openai.OpenAI(base_url=batch_stack.envoy_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        live.embeddings.create(model=SIM_MODEL, input=["a", "b"])
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["message"] == refused.value.body["message"]

    prompts = {"one": "alone", "list": ["a", "b", "c"], "ids": [7, 8, 9], "id-lists": [[7, 8], [9]]}
    rows = [
        {
            "custom_id": c,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": SIM_MODEL, "prompt": x, "max_tokens": 4},
        }
        for c, x in prompts.items()
    ]
    f = client.files.create(file=("multi.jsonl", _jsonl(rows)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    done = _wait(client, b.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == 4, done
    bodies = {r["custom_id"]: r["response"]["body"] for r in _results(client, done.output_file_id)}
    for c, x in prompts.items():
        jobs = len(x) if isinstance(x, list) and not isinstance(x[0], int) else 1
        assert [ch["index"] for ch in bodies[c]["choices"]] == list(range(jobs)), bodies[c]  # (the sim has no n > 1)
        assert bodies[c]["usage"]["completion_tokens"] == jobs * 4 and bodies[c]["choices"][0]["text"]


def test_a_file_that_is_not_jsonl_fails_validation_and_duplicates_are_named(batch_stack):
    client = _client(batch_stack)
    f = client.files.create(file=("bad.jsonl", b'{"custom_id": "a"}\nnot json\n'), purpose="batch")
    b = _wait(
        client,
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id,
        {"failed"},
    )
    assert b.errors.data[0].code == "invalid_json_line" and b.errors.data[0].line == 2
    dup = _jsonl(_lines(2) + _lines(1))
    f = client.files.create(file=("dup.jsonl", dup), purpose="batch")
    b = _wait(
        client,
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id,
        {"failed"},
    )
    assert [(e.code, e.line) for e in b.errors.data] == [("duplicate_custom_id", 3)]
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="7d")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 24)


def test_cancel_stops_feeding_and_keeps_what_finished(batch_stack):
    client = _client(batch_stack)
    f = client.files.create(file=("big.jsonl", _jsonl(_lines(400, max_tokens=64))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    _wait(client, b.id, {"in_progress"})
    time.sleep(0.5)
    c = client.batches.cancel(b.id)
    assert c.status == "cancelling"
    done = _wait(client, b.id, {"cancelled"})
    counts = done.request_counts
    assert counts.completed + counts.failed < 400, counts
    out = _results(client, done.output_file_id)
    assert len(out) == counts.completed and len({r["custom_id"] for r in out}) == len(out)


def test_expiry_writes_what_finished_and_marks_the_rest_expired(batch_stack):
    client = _client(batch_stack)
    f = client.files.create(file=("slow.jsonl", _jsonl(_lines(600, max_tokens=64))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="3s")
    done = _wait(client, b.id, {"expired", "completed"}, timeout=30)
    assert done.status == "expired", done.request_counts
    out = _results(client, done.output_file_id)
    errs = _results(client, done.error_file_id)
    assert len(out) + len(errs) == 600 and len(errs) > 0
    assert {e["error"]["code"] for e in errs} == {"batch_expired"}
    assert len({r["custom_id"] for r in out + errs}) == 600


def test_router_sigkill_mid_batch_every_custom_id_exactly_once(tmp_path):
    cfg = _config(
        tmp_path, workers=[sim_worker("sim-0", max_num_seqs=8, sim=SLOW_SIM)], router={"heartbeat_interval_s": 0.25}
    )
    n = 500
    with start_stack(cfg, tmp_path / "run", supervise=True) as stack:
        client = _client(stack)
        f = client.files.create(file=("in.jsonl", _jsonl(_lines(n, max_tokens=32))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 30
        while client.batches.retrieve(b.id).request_counts.completed < 100:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        stack.components["router"].signal_group(signal.SIGKILL)
        t_kill = time.monotonic()
        done = _wait(client, b.id, {"completed", "failed"}, timeout=60)
        assert done.status == "completed", done
        out = _results(client, done.output_file_id)
        ids = [r["custom_id"] for r in out]
        assert len(ids) == n and len(set(ids)) == n, (len(ids), len(set(ids)))
        assert done.request_counts.completed == n and stack.restarts == {"router": 1}
        print(f"SIGKILL mid-batch: {n} lines, 0 lost, 0 duplicated; done {time.monotonic() - t_kill:.1f} s after")


def test_two_routers_and_a_redis_lease_kill_the_one_running_the_batch_the_other_finishes_it(tmp_path, redis_url):
    cfg = _config(
        tmp_path,
        routers=localconfig.routers(2),
        workers=[sim_worker("sim-0", max_num_seqs=8, sim=SLOW_SIM)],
        router={"heartbeat_interval_s": 0.25},
        quota={"store": "redis", "redis_url": redis_url},
        batch={"lease_ttl_s": 2.0},
    )
    n = 400
    with start_stack(cfg, tmp_path / "run") as stack:
        client = _client(stack)
        f = client.files.create(file=("in.jsonl", _jsonl(_lines(n, max_tokens=32))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 30
        while client.batches.retrieve(b.id).request_counts.completed < 80:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        holder = _holder(stack, b.id)
        stack.components[holder].signal_group(signal.SIGKILL)
        done = _wait(client, b.id, {"completed", "failed"}, timeout=60)
        assert done.status == "completed", done
        ids = [r["custom_id"] for r in _results(client, done.output_file_id)]
        assert len(ids) == n and len(set(ids)) == n


def _holder(stack, batch_id: str) -> str:
    """The router component whose /metrics shows the batch running."""
    import requests

    for name in stack.components:
        if not name.startswith("router"):
            continue
        idx = 0 if name == "router" else int(name.split(":")[-1].split("-")[-1])
        url = "http://" + stack.cfg.router_endpoints()[idx].http + "/metrics"
        text = requests.get(url, timeout=5).text
        if f'weir_batch_window_left_seconds{{batch="{batch_id}"}}' in text:
            # what the dashboard and the missed-window alert read, while it runs
            assert f'weir_batch_eta_seconds{{batch="{batch_id}"}}' in text
            assert f'weir_batch_lines{{batch="{batch_id}",state="done"}}' in text
            assert 'weir_batch_model_lines{model="sim-tiny"' in text and "weir_batch_lines_done_total{" in text
            return name
    raise AssertionError("no router runs the batch")


def test_weir_batches_cli_submits_watches_and_downloads(batch_stack, tmp_path, capsys):
    from weir.cli import main

    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(_lines(20)))
    cfg = str(batch_stack.cfg_path)
    assert main(["batches", "submit", str(src), "--endpoint", "/v1/completions", "--config", cfg, "--watch"]) == 0
    batch_id = next(w for w in capsys.readouterr().out.split() if w.startswith("batch_"))
    assert main(["batches", "list", "--config", cfg]) == 0
    assert batch_id in capsys.readouterr().out
    assert main(["batches", "download", batch_id, "-o", str(tmp_path / "res"), "--config", cfg]) == 0
    out = (tmp_path / "res" / f"{batch_id}_output.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(20))


def test_interactive_work_preempts_running_batch_lines_which_still_finish_once(tmp_path):
    """8 slots full of batch lines of ~1.3 s each: an interactive request gets
    a slot at once (a batch line steps aside and resumes later), not after one."""
    import requests

    cfg = _config(tmp_path, workers=[sim_worker("sim-0", max_num_seqs=8, sim={"step_fixed_ms": 20.0})])
    n = 40
    with start_stack(cfg, tmp_path / "run") as stack:
        client = _client(stack)
        f = client.files.create(file=("in.jsonl", _jsonl(_lines(n, max_tokens=64))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 20
        while not any(
            line.startswith("weir_worker_running{") and line.endswith(" 8.0")
            for line in requests.get(stack.metrics_url, timeout=5).text.splitlines()
        ):
            assert time.monotonic() < deadline, "the batch never filled the worker"
            time.sleep(0.05)
        ttfts = []
        for _ in range(3):
            t0 = time.monotonic()
            with requests.post(
                stack.envoy_url + "/v1/completions",
                stream=True,
                timeout=30,
                json={"model": SIM_MODEL, "prompt": "now", "max_tokens": 4, "stream": True},
            ) as r:
                assert r.status_code == 200
                next(r.iter_lines(chunk_size=1))
                ttfts.append(time.monotonic() - t0)
        assert max(ttfts) < 0.6, ttfts  # a batch line runs ~1.3 s: it did not wait for one to end
        metrics = requests.get(stack.metrics_url, timeout=5).text
        assert "weir_batch_lines_preempted_total 0.0" not in metrics
        done = _wait(client, b.id, {"completed", "failed"}, timeout=60)
        ids = [r["custom_id"] for r in _results(client, done.output_file_id)]
        assert done.status == "completed" and len(ids) == n and len(set(ids)) == n
        assert all(
            r["response"]["body"]["usage"]["completion_tokens"] == 64 for r in _results(client, done.output_file_id)
        )


# ------------------------------------------------------------------ drains and fenced leases


class _Progress:
    """Polls a batch while something breaks its router: when its done count
    moved, so the longest stretch without progress can be read afterwards."""

    def __init__(self, client: openai.OpenAI, batch_id: str) -> None:
        self.client, self.batch_id = client, batch_id
        self.moves: list[tuple[float, int]] = []  # (when, completed + failed), at each change

    def poll(self):
        try:
            b = self.client.batches.retrieve(self.batch_id)
        except openai.APIError:
            return None  # (the only router restarting: Envoy has nobody to ask)
        done = b.request_counts.completed + b.request_counts.failed
        if not self.moves or self.moves[-1][1] != done:
            self.moves.append((time.monotonic(), done))
        return b

    def until(self, statuses: set[str], timeout: float = 90.0):
        deadline = time.monotonic() + timeout
        while True:
            b = self.poll()
            if b is not None and b.status in statuses:
                return b
            assert time.monotonic() < deadline, f"batch stuck: {b}"
            time.sleep(0.1)

    def until_done(self, at_least: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.moves or self.moves[-1][1] < at_least:
            assert time.monotonic() < deadline
            self.poll()
            time.sleep(0.1)

    def stall_after(self, t0: float) -> float:
        """The longest time without progress from ``t0`` on (seconds)."""
        times = [t0] + [t for t, _ in self.moves if t > t0]
        return max(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 1 else float("nan")


def _exactly_once(client: openai.OpenAI, done, n: int) -> tuple[int, int, int]:
    """(lines answered, distinct custom_ids answered, failed lines) over both result files."""
    out = _results(client, done.output_file_id)
    errs = _results(client, done.error_file_id)
    ids = [r["custom_id"] for r in out + errs]
    assert len(ids) == len(set(ids)) == n, (len(ids), len(set(ids)), [e["response"] for e in errs[:3]])
    return len(out), len(set(ids)), len(errs)


def test_router_sigterm_mid_batch_hands_it_on_every_line_answered_once(tmp_path):
    """The only router drains (SIGTERM), is restarted by the supervisor (as
    `weir up` does): no line fails for the drain, none runs twice."""
    cfg = _config(
        tmp_path, workers=[sim_worker("sim-0", max_num_seqs=8, sim=SLOW_SIM)], router={"heartbeat_interval_s": 0.25}
    )
    n = 400
    with start_stack(cfg, tmp_path / "run", supervise=True) as stack:
        client = _client(stack)
        f = client.files.create(file=("in.jsonl", _jsonl(_lines(n, max_tokens=32))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        prog = _Progress(client, b.id)
        prog.until_done(80)
        t_term = time.monotonic()
        stack.components["router"].signal_group(signal.SIGTERM)
        done = prog.until({"completed", "failed", "cancelled", "expired"})
        assert done.status == "completed", done
        answered, once, failed = _exactly_once(client, done, n)
        assert (answered, once, failed) == (n, n, 0) and done.request_counts.failed == 0
        assert stack.restarts == {"router": 1}
        assert done.usage.output_tokens == 32 * n  # the drained router's lines are counted too
        print(
            f"\n1 router SIGTERM mid-batch: {answered}/{n} answered 200, {once} exactly once, {failed} failed; "
            f"no progress for {prog.stall_after(t_term):.1f} s at most"
        )


def test_sigterm_to_the_router_running_a_batch_of_two_the_other_takes_it_over(tmp_path, redis_url):
    """Two routers over one directory, the lease in Redis (its TTL 10 s): the
    drained one releases the lease when its running lines end, so the other
    takes over at its next scan, not after the TTL."""
    cfg = _config(
        tmp_path,
        routers=localconfig.routers(2),
        workers=[sim_worker("sim-0", max_num_seqs=8, sim=SLOW_SIM)],
        router={"heartbeat_interval_s": 0.25},
        quota={"store": "redis", "redis_url": redis_url},
        batch={"lease_ttl_s": 10.0},
    )
    n = 400
    with start_stack(cfg, tmp_path / "run") as stack:
        client = _client(stack)
        f = client.files.create(file=("in.jsonl", _jsonl(_lines(n, max_tokens=32))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        prog = _Progress(client, b.id)
        prog.until_done(80)
        holder = _holder(stack, b.id)
        t_term = time.monotonic()
        stack.components[holder].signal_group(signal.SIGTERM)
        done = prog.until({"completed", "failed", "cancelled", "expired"})
        assert done.status == "completed", done
        answered, once, failed = _exactly_once(client, done, n)
        assert (answered, once, failed) == (n, n, 0)
        assert stack.components[holder].exited() == 0  # drained and gone: the other router finished it
        log = stack.components[holder].log_path.read_text()
        assert "handed on" in log and "router_draining" not in log
        print(
            f"\n2 routers, SIGTERM the holder: {answered}/{n} answered 200, {once} exactly once, {failed} failed; "
            f"no progress for {prog.stall_after(t_term):.1f} s at most (lease TTL 10 s)"
        )


def test_a_lease_holder_paused_past_its_ttl_writes_nothing_when_it_wakes(tmp_path, redis_url):
    """SIGSTOP the router running a batch past lease_ttl_s: the other router
    takes the batch over (a newer fencing token); SIGCONT: the woken holder's
    next write is refused by the fence, it stops, and no line is written twice."""
    ttl = 2.0
    cfg = _config(
        tmp_path,
        routers=localconfig.routers(2),
        workers=[sim_worker("sim-0", max_num_seqs=8, sim=SLOW_SIM)],
        router={"heartbeat_interval_s": 0.25},
        quota={"store": "redis", "redis_url": redis_url},
        batch={"lease_ttl_s": ttl},
    )
    n = 400
    with start_stack(cfg, tmp_path / "run") as stack:
        client = _client(stack)
        f = client.files.create(file=("in.jsonl", _jsonl(_lines(n, max_tokens=32))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        prog = _Progress(client, b.id)
        prog.until_done(80)
        holder = _holder(stack, b.id)
        victim = stack.components[holder]
        victim.signal_group(signal.SIGSTOP)
        try:
            at_stop = prog.moves[-1][1]
            time.sleep(ttl + 1.0)
            prog.until_done(at_stop + 40)  # the other router runs it now
        finally:
            victim.signal_group(signal.SIGCONT)
        done = prog.until({"completed", "failed", "cancelled", "expired"})
        assert done.status == "completed", done
        answered, once, failed = _exactly_once(client, done, n)
        assert (answered, once, failed) == (n, n, 0)
        time.sleep(1.0)
        log = victim.log_path.read_text()
        stale = "is stale" in log
        assert stale or "lease lost" in log, log[-2000:]
        assert victim.exited() is None  # it serves on; it only stopped running the batch
        print(
            f"\nSIGSTOP the holder past lease_ttl_s, then SIGCONT: {answered} lines, 0 duplicates; the woken "
            f"holder {'was refused by the fence at its next write' if stale else 'lost its lease at renewal'}"
            f" and stopped"
        )


def test_a_redis_lease_taken_over_after_its_ttl_fences_out_the_first_holder(tmp_path, redis_url):
    """Each Redis grant's token is larger than the last; the first holder, its
    key expired and taken, can neither renew nor write to the batch's files."""
    import asyncio

    from router.services.batch.lease import RedisLease
    from router.services.batch.store import BatchStore, ResultLog, StaleLease

    store = BatchStore(tmp_path)
    (store.dir / "batch_f").mkdir()
    log = ResultLog(tmp_path / "out.data")
    a, b = RedisLease(redis_url, "fence-test:", 0.3), RedisLease(redis_url, "fence-test:", 0.3)

    async def main() -> None:
        assert await a.acquire("batch_f") and not await b.acquire("batch_f")
        first = store.fence("batch_f", a.token("batch_f"))
        first.claim()
        with first.hold():
            log.append([b"a\n"])
        await asyncio.sleep(0.5)  # a stalls past the TTL
        assert await b.acquire("batch_f") and b.token("batch_f") > a.token("batch_f") >= 1
        store.fence("batch_f", b.token("batch_f")).claim()
        with pytest.raises(StaleLease):
            with first.hold():
                log.append([b"stale\n"])
        assert not await a.renew("batch_f") and await b.renew("batch_f")
        await b.release("batch_f")
        assert await a.acquire("batch_f") and a.token("batch_f") > 2  # a later grant: larger again
        await a.release("batch_f")
        await a.close()
        await b.close()

    asyncio.run(main())
    assert (tmp_path / "out.data").read_bytes() == b"a\n"


def test_storage_limits_expiry_and_paged_lists_through_envoy_with_the_sdk(tmp_path):
    """The tenant's limits refuse with OpenAI's bodies, ``expires_after`` and
    ``output_expires_after`` come back in the objects, and the SDK's paging
    (``after``) walks the lists."""
    cfg = _config(
        tmp_path,
        workers=[sim_worker("sim-0", max_num_seqs=8)],
        batch={"max_stored_files": 4, "max_active_batches": 1},
    )
    with start_stack(cfg, tmp_path / "run") as stack:
        client = _client(stack)
        once = client.with_options(max_retries=0)  # a 429 here is an answer, not a reason to wait
        expiry = {"anchor": "created_at", "seconds": 3600}
        made = [
            client.files.create(file=(f"in{i}.jsonl", _jsonl(_lines(2))), purpose="batch", expires_after=expiry)
            for i in range(3)
        ]
        assert all(f.expires_at == f.created_at + 3600 for f in made)
        with pytest.raises(openai.BadRequestError) as bad:
            once.files.create(
                file=("x.jsonl", _jsonl(_lines(1))),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 5},
            )
        assert bad.value.body["param"] == "expires_after"
        page = client.files.list(limit=2)
        assert len(page.data) == 2 and page.has_more
        assert sorted(f.id for f in page) == sorted(f.id for f in made)  # the SDK follows `after` to the end
        b = client.batches.create(
            input_file_id=made[0].id,
            endpoint="/v1/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 7200},
        )
        with pytest.raises(openai.RateLimitError) as full:
            once.batches.create(input_file_id=made[1].id, endpoint="/v1/completions", completion_window="24h")
        assert full.value.body["code"] == "active_batch_limit_exceeded"
        assert full.value.body["param"] == "max_active_batches" and full.value.response.headers["retry-after"]
        done = _wait(client, b.id, {"completed"})
        out = client.files.retrieve(done.output_file_id)  # the output file: the 4th of the tenant's 4
        assert out.expires_at == out.created_at + 7200
        with pytest.raises(openai.RateLimitError) as count:
            once.files.create(file=("y.jsonl", _jsonl(_lines(1))), purpose="batch")
        assert count.value.body["code"] == "file_count_limit_exceeded"
        client.files.delete(made[2].id)
        client.files.create(file=("y.jsonl", _jsonl(_lines(1))), purpose="batch")  # room again
        batches = client.batches.list(limit=1)
        assert [x.id for x in batches.data] == [b.id] and not batches.has_more


def test_uploads_stream_through_envoy_the_router_refuses_one_over_the_limit_and_keeps_nothing(tmp_path):
    """Envoy's /v1/files route does not buffer: a body over ``batch.max_file_bytes``
    is refused by the router (413, OpenAI's body) as it streams, chunked or not,
    and nothing of it stays on disk; one within the limit is stored whole."""
    import requests

    cfg = _config(tmp_path, workers=[sim_worker("sim-0", max_num_seqs=8)], batch={"max_file_bytes": 1 << 20})
    files_dir = tmp_path / "batches" / "files"
    with start_stack(cfg, tmp_path / "run") as stack:
        big = _jsonl(_lines(10000))  # ~1.4 MiB
        assert len(big) > 1 << 20
        url = stack.envoy_url + "/v1/files"

        def chunked():
            for i in range(0, len(big), 64 << 10):
                yield big[i : i + (64 << 10)]

        for body in (big, chunked()):  # with a Content-Length, and chunked (no length to refuse on)
            if isinstance(body, bytes):
                r = requests.post(url, files={"file": ("big.jsonl", body)}, data={"purpose": "batch"}, timeout=30)
            else:
                head = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
                head += b'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
                r = requests.post(
                    url,
                    data=(x for x in (head, *body, b"\r\n--B--\r\n")),
                    headers={"content-type": "multipart/form-data; boundary=B"},
                    timeout=30,
                )
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large"
        deadline = time.monotonic() + 5
        while [p.name for p in files_dir.iterdir()] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.name for p in files_dir.iterdir()] == []
        small = _jsonl(_lines(100))
        f = _client(stack).files.create(file=("small.jsonl", small), purpose="batch")
        assert f.bytes == len(small)
        assert _client(stack).files.content(f.id).content == small
