"""The batch tier's pure and on-disk parts: statuses, windows, the feeder's
decision, the input check, the result files' recovery, the one-host lease."""

from __future__ import annotations

import asyncio
import json

import pytest

from router import api
from router.services.batch import rules as m
from router.services.batch.lease import FileLease
from router.services.batch.store import BatchStore, ResultLog, is_done, result_id
from router.services.batch.validate import BatchLine, check_file, decode_line, to_jobs, with_model_tools
from shared import protocol as p
from shared.errors import Code


def test_statuses_move_only_as_openai_documents():
    assert m.can_move(m.VALIDATING, m.IN_PROGRESS) and m.can_move(m.IN_PROGRESS, m.FINALIZING)
    assert m.can_move(m.FINALIZING, m.COMPLETED) and m.can_move(m.IN_PROGRESS, m.CANCELLING)
    assert m.can_move(m.CANCELLING, m.CANCELLED) and m.can_move(m.IN_PROGRESS, m.EXPIRED)
    for ended in m.TERMINAL:
        assert not any(m.can_move(ended, to) for to in (*m.TERMINAL, m.IN_PROGRESS, m.VALIDATING))
    assert not m.can_move(m.IN_PROGRESS, m.COMPLETED)  # always through finalizing
    assert not m.can_move(m.CANCELLING, m.IN_PROGRESS)
    with pytest.raises(m.BadMove):
        m.check_move(m.COMPLETED, m.CANCELLING)


def test_a_record_stamps_each_move(tmp_path):
    rec = BatchStore(tmp_path).new(
        owner="t",
        key_digest="",
        input_file_id="file-x",
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=1,
        expires_at=2,
    )
    rec.move(m.IN_PROGRESS, now=10)
    rec.move(m.CANCELLING, now=11)
    obj = rec.public()
    assert (obj["status"], obj["in_progress_at"], obj["cancelling_at"], obj["completed_at"]) == (
        "cancelling",
        10,
        11,
        None,
    )
    assert obj["output_file_id"] is None  # shown once the batch ends with output


def test_windows():
    assert m.window_seconds("24h") == 86400 and m.window_seconds("3s") == 3 and m.window_seconds("2d") == 172800
    for bad in ("", "24", "0h", "1w", "h", "-1h"):
        assert m.window_seconds(bad) is None


@pytest.mark.parametrize(
    "state, want",
    [
        (m.FeedState(in_flight=0, queued=0, window=256, queue_target=16), 16),  # start: fill the queue target
        (m.FeedState(in_flight=100, queued=16, window=256, queue_target=16), 0),  # enough waiting for free slots
        (m.FeedState(in_flight=100, queued=3, window=256, queue_target=16), 13),  # slots took some: top up
        (m.FeedState(in_flight=250, queued=0, window=256, queue_target=16), 6),  # the window bounds it
        (m.FeedState(in_flight=256, queued=0, window=256, queue_target=16), 0),
        (m.FeedState(in_flight=300, queued=40, window=256, queue_target=16), 0),  # never negative
    ],
)
def test_the_feeder_keeps_a_short_queue_within_the_window(state, want):
    assert m.lines_to_send(state) == want


def test_refusals_for_room_or_budget_are_retried_others_are_results():
    for code in (
        Code.QUEUE_WAIT_EXCEEDED,
        Code.QUEUE_FULL,
        Code.QUEUE_DEADLINE,
        Code.TOKENS_BUDGET,
        Code.NO_WORKER,
        Code.WORKER_LOST,
        Code.REQUESTS_BUDGET,
    ):
        assert m.retryable(code.status, code.wire, code.type), code
    for code in (
        Code.BAD_REQUEST,
        Code.MODEL_NOT_FOUND,
        Code.CONTEXT_LENGTH,
        Code.BUDGET_TOO_SMALL,
        Code.INVALID_API_KEY,
        Code.ENGINE_ERROR,
        Code.GENERATION_DEADLINE,
    ):
        assert not m.retryable(code.status, code.wire, code.type), code
    assert not m.retryable(
        Code.RATE_LIMITED.status, Code.RATE_LIMITED.wire, Code.RATE_LIMITED.type
    )  # Envoy's, not ours


def test_eta():
    assert m.eta_seconds(0, 100, 5.0) is None
    assert m.eta_seconds(25, 100, 5.0) == pytest.approx(15.0)


def _write(path, rows):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def test_the_file_check_names_bad_lines_and_repeated_custom_ids(tmp_path):
    ok = [{"custom_id": f"c{i}", "url": "/v1/completions", "body": {}} for i in range(5)]
    got = check_file(_write(tmp_path / "ok.jsonl", [*ok[:2], b"", *ok[2:]]))
    assert (got.lines, got.total, got.errors) == (6, 5, [])
    got = check_file(
        _write(tmp_path / "bad.jsonl", [ok[0], b"{nope", {"custom_id": 3}, {"custom_id": ""}, ok[0], ok[1]])
    )
    assert [(e.code, e.line) for e in got.errors] == [
        ("invalid_json_line", 2),
        ("invalid_request", 3),
        ("empty_custom_id", 4),
        ("duplicate_custom_id", 5),
    ]
    assert [e.code for e in check_file(_write(tmp_path / "empty.jsonl", [b"", b" "])).errors] == ["empty_file"]


def test_each_line_is_checked_as_a_live_request():
    def line(url="/v1/completions", **body):
        raw = json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}).encode()
        decoded = decode_line(raw)
        assert decoded is not None
        return decoded

    jobs = to_jobs(line(model="m", prompt="hi", max_tokens=3), "/v1/completions", 1 << 20, "rid")
    (sub,), ctx = jobs.subs, jobs.ctx
    assert isinstance(ctx, api.ResponseContext)
    assert (sub.model, sub.prompt, sub.max_tokens, ctx.stream) == ("m", "hi", 3, False)
    cases = [
        (line(url="/v1/chat/completions", model="m"), "url", 400),
        (line(model="m", prompt="hi", max_tokens=0), "max_tokens", 400),
        (line(model="m", prompt="hi", stream=True), "stream", 400),
        (line(model="m", prompt="x" * 200), "body", 413),
    ]
    for decoded, param, status in cases:
        with pytest.raises(api.RequestError) as e:
            to_jobs(decoded, "/v1/completions", 100, "rid")
        assert (e.value.info.param, e.value.info.status) == (param, status)


def _line(url: str, **body: object) -> BatchLine:
    decoded = decode_line(json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}).encode())
    assert decoded is not None
    return decoded


def test_an_embeddings_line_is_one_job_per_input_parsed_as_the_live_endpoint():
    emb = "/v1/embeddings"
    jobs = to_jobs(_line(emb, model="e", input=["a", "b", "c"], dimensions=8), emb, 1 << 20, "rid")
    assert isinstance(jobs.ctx, api.EmbeddingContext) and jobs.ctx.count == 3
    assert [(s.kind, s.prompt, s.dimensions) for s in jobs.subs] == [(p.RequestKind.EMBEDDING, x, 8) for x in "abc"]
    (tokens,) = to_jobs(_line(emb, model="e", input=[1, 2, 3]), emb, 1 << 20, "rid").subs
    assert tokens.prompt_token_ids == [1, 2, 3]
    cases = [
        (_line(emb, model="e", input=[]), "input", 400),
        (_line(emb, model="e", input="x", truncate_prompt_tokens=4), "truncate_prompt_tokens", 400),
        (_line(emb, model="e", input="x", encoding_format="hex"), "encoding_format", 400),
        (_line("/v1/completions", model="e", prompt="x"), "url", 400),
        (_line(emb, model="e", input="x" * 200), "body", 413),
    ]
    for decoded, param, status in cases:
        with pytest.raises(api.RequestError) as e:
            to_jobs(decoded, emb, 100, "rid")
        assert (e.value.info.param, e.value.info.status) == (param, status), e.value.info


def test_a_completions_line_with_a_prompt_list_is_one_job_per_prompt_within_the_configured_bound():
    url = "/v1/completions"
    jobs = to_jobs(_line(url, model="m", prompt=["a", "b"], n=2, max_tokens=3), url, 1 << 20, "rid", max_prompts=4)
    assert [s.prompt for s in jobs.subs] == ["a", "b"] and jobs.n == 2 and jobs.ctx.n == 4
    (ids,) = to_jobs(_line(url, model="m", prompt=[5, 6]), url, 1 << 20, "rid").subs
    assert ids.prompt_token_ids == [5, 6]
    with pytest.raises(api.RequestError) as e:
        to_jobs(_line(url, model="m", prompt=["a", "b", "c"]), url, 1 << 20, "rid", max_prompts=2)
    assert (e.value.info.param, e.value.info.status) == ("prompt", 400)


def test_recovery_reads_done_lines_back_and_cuts_a_torn_last_line(tmp_path):
    bid = "batch_" + "ab" * 12
    path = tmp_path / "out.data"
    log = ResultLog(path)
    log.append([json.dumps({"id": result_id(bid, n), "custom_id": f"c{n}"}).encode() + b"\n" for n in (0, 3, 17)])
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"id":"' + result_id(bid, 5).encode() + b'","custom_')  # killed mid-write
    again = ResultLog(path)
    done = bytearray(3)
    again.recover(done)
    assert again.lines == 3 and [n for n in range(24) if is_done(done, n)] == [0, 3, 17]
    assert path.read_bytes().endswith(b"\n")  # the torn line is gone; the three written lines stay
    again.append([b'{"id":"' + result_id(bid, 5).encode() + b'"}\n'])
    assert len(path.read_bytes().splitlines()) == 4


def test_one_host_lease_one_holder_at_a_time(tmp_path):
    store = BatchStore(tmp_path)
    rec = store.new(
        owner="t",
        key_digest="",
        input_file_id="file-x",
        endpoint="/v1/completions",
        completion_window="24h",
        created_at=1,
        expires_at=2,
    )

    async def run():
        a, b = FileLease(store.dir), FileLease(store.dir)
        assert await a.acquire(rec.id) and await a.renew(rec.id)
        assert not await b.acquire(rec.id)  # (a process's flock conflicts with its own other open too)
        await a.release(rec.id)
        assert not await a.renew(rec.id)
        assert await b.acquire(rec.id)

    asyncio.run(run())


def test_a_tenants_batch_day_budget_makes_its_batches_wait_then_refills():
    b = m.DayBudget(86_400, now=0.0)  # refills 1 token a second
    assert b.allows(0.0)
    b.charge(86_400 + 100, now=0.0)  # a line in flight may take it below zero
    assert not b.allows(50.0)  # -50: still waiting
    assert b.allows(101.0)  # +1
    b.charge(0, now=10 * 86_400.0)
    assert b.level == 86_400  # never above its capacity


def test_weir_stats_shows_a_line_per_running_batch():
    from weir.stats import _batches_view, render

    def reading(done):
        lines = [
            ({"batch": "batch_a", "state": s}, v)
            for s, v in (("done", done), ("running", 8), ("queued", 16), ("pending", 900 - done))
        ]
        return {
            "metrics": {
                "weir_batch_lines": lines,
                "weir_batch_eta_seconds": [({"batch": "batch_a"}, 120.0)],
                "weir_batch_window_left_seconds": [({"batch": "batch_a"}, 86000.0)],
            }
        }

    rows = _batches_view("r0", reading(150), reading(100), 2.0)
    assert rows == [
        {
            "router": "r0",
            "batch": "batch_a",
            "done": 150,
            "running": 8,
            "queued": 16,
            "pending": 750,
            "lines_per_s": 25.0,
            "eta_s": 120.0,
            "window_left_s": 86000.0,
        }
    ]
    assert _batches_view("r0", {"error": "down"}, None, 0.0) == []
    from rich.console import Console

    snap = {
        "time": "now",
        "interval_s": 2.0,
        "envoy": {"reachable": False, "error": "x"},
        "routers": [],
        "workers": [],
        "tenants": [],
        "batches": rows,
    }
    console = Console(width=160, record=True)
    console.print(render(snap, "t"))
    text = console.export_text()
    assert "batch_a" in text and "25.0" in text and "120 s" in text


class _Run:
    """What an EmbeddingLine reports to (router.services.batch.feeder.LineFeeder): its one end."""

    def __init__(self):
        self.ends = []

    def line_ok(self, sink, body):
        self.ends.append(("ok", json.loads(body)))

    def line_refused(self, sink, err):
        self.ends.append(("refused", err.code))


def test_a_completions_lines_prompt_logprobs_refusal_names_echo():
    # a CPU LoRA worker refuses prompt logprobs naming SamplingParams' prompt_logprobs; the
    # line's client asked for them with echo and logprobs, as over HTTP (router.api.echo_param)
    from router.services.batch.lines import LineSink

    class Run:
        def line_refused(self, sink, err):
            self.err = err

    url = "/v1/completions"
    refused = p.ErrorInfo(400, "prompt logprobs are not served", param="prompt_logprobs")
    for body, param in (({"echo": True, "logprobs": 1}, "echo"), ({"logprobs": 1}, "prompt_logprobs")):
        jobs = to_jobs(_line(url, model="m", prompt="hi", max_tokens=2, **body), url, 1 << 20, "rid")
        run = Run()
        LineSink(run, 0, b"", "a", jobs.ctx).on_deltas([p.Delta("rid", error=refused)])
        assert run.err.param == param and run.err.status == 400, body


class _Core:
    def __init__(self, refuse_at=None):
        self.sinks, self.cancelled, self.refuse_at = [], [], refuse_at

    def submit(self, sub, sink, who=None, group=None):
        if len(self.sinks) == self.refuse_at:
            return p.ErrorInfo(429, "queue full", "rate_limit_error", code="queue_full")
        self.sinks.append(sink)
        return len(self.sinks)

    def cancel(self, handle):
        self.cancelled.append(handle)


def test_an_embeddings_line_ends_once_with_every_vector_in_order_or_with_the_first_failure():
    import struct

    from router.services.batch.lines import AsOwner, EmbeddingLine

    emb = "/v1/embeddings"
    jobs = to_jobs(_line(emb, model="e", input=["a", "b", "c"]), emb, 1 << 20, "rid")
    vec = [struct.pack("<2f", i, 1.0) for i in range(3)]

    run, core = _Run(), _Core()
    line = EmbeddingLine(run, 0, b"", "a", jobs.ctx)
    assert line.submit(AsOwner(core, None), jobs.subs) is None and line.handles == [1, 2, 3]
    for i in (2, 0, 1):  # any order: the response keeps the inputs'
        core.sinks[i].on_deltas([p.Delta(f"r-{i}", finish_reason="stop", prompt_tokens=2, embedding=vec[i])])
    ((kind, body),) = run.ends
    assert kind == "ok" and [d["embedding"][0] for d in body["data"]] == [0.0, 1.0, 2.0]
    assert body["usage"]["prompt_tokens"] == 6

    run, core = _Run(), _Core()
    line = EmbeddingLine(run, 0, b"", "a", jobs.ctx)
    line.submit(AsOwner(core, None), jobs.subs)
    core.sinks[0].on_deltas([p.Delta("r-0", finish_reason="stop", prompt_tokens=2, embedding=vec[0])])
    core.sinks[1].on_deltas([p.Delta("r-1", error=p.ErrorInfo(503, "lost", "server_error", code="worker_lost"))])
    core.sinks[2].on_deltas([p.Delta("r-2", finish_reason="stop", prompt_tokens=2, embedding=vec[2])])
    assert run.ends == [("refused", "worker_lost")]  # once; the later vector is ignored

    core = _Core(refuse_at=2)  # the third input refused at submit: the two before are cancelled
    line = EmbeddingLine(_Run(), 0, b"", "a", jobs.ctx)
    got = line.submit(AsOwner(core, None), jobs.subs)
    assert got is not None and got.code == "queue_full" and core.cancelled == [1, 2] and line.handles == []


def test_a_line_nested_past_the_decoders_depth_is_an_invalid_line_not_a_failed_batch(tmp_path):
    ok = {"custom_id": "c0", "url": "/v1/completions", "body": {}}
    deep = b'{"custom_id":"c1","url":"/v1/completions","body":' + b'{"a":' * 5000 + b"{}" + b"}" * 5000 + b"}"
    got = check_file(_write(tmp_path / "deep.jsonl", [ok, deep, ok]))
    assert [(e.code, e.line) for e in got.errors] == [("invalid_json_line", 2), ("duplicate_custom_id", 3)]
    assert decode_line(deep) is None  # (fed anyway, it is a bad line's error entry, not an exception)


def test_a_chat_lines_tools_are_read_with_its_models_parser_as_a_live_requests_are():
    """auto parses the model's calls only once its tool-call parser is known,
    and is constrained by vLLM's structural tag for a strict tool: a batch
    line gets both, as the live ingress gives them (without, its calls came
    back as plain text)."""
    chat = "/v1/chat/completions"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    jobs = to_jobs(
        _line(chat, model="m", messages=[{"role": "user", "content": "x"}], tools=[tool], tool_choice="auto"),
        chat,
        1 << 20,
        "rid",
    )
    with_model_tools(jobs, lambda model: ("hermes", True))
    (sub,), ctx = jobs.subs, jobs.ctx
    assert isinstance(ctx, api.ResponseContext) and ctx.tools is not None and ctx.tools.parses
    assert sub.params is not None and sub.params.structured is not None and sub.params.structured.structural_tag
    acc = api.Accumulator(ctx)
    acc.add([p.Delta("rid", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', 9, "stop", 3, 9)])
    (choice,) = json.loads(acc.render())["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]
    ] == [("f", {"a": 1})]
