"""router.ingress.http_server on a real loopback socket, driven by the real openai SDK,
`requests` and raw sockets.

The router core is replaced by ``ScriptedCore``, a test double of the
router's *interfaces only* (submit/cancel/models/health/admin/metrics) whose
behaviour is chosen by the prompt text.  The real end-to-end path (Envoy,
router core, workers) is tested elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httptools
import openai
import prometheus_client
import pytest
import requests
import uvloop

from router.ingress.http_server import start_http_server
from router.observe.exposition import MetricsPage
from router.observe.metrics import RouterMetrics
from shared.protocol import Delta, ErrorInfo, RequestKind, Submit

MAX_BODY = 64 * 1024
MAX_BUFFERED = 256 * 1024


class _CountingTransport:
    """Wraps a real transport to count writes (proves per-batch coalescing)."""

    def __init__(self, inner, counter: list):
        self._inner = inner
        self._counter = counter

    def write(self, data):
        self._counter.append(len(data))
        self._inner.write(data)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class ScriptedCore:
    """Test double of router.lifecycle.core.RouterCore's interface.  The prompt (or the
    last chat message) picks the script:

      refuse:<status>     submit() refuses at once (retry_after 1.5 on 429/503)
      queued-error        two idle loop turns, then a final Delta carrying a 503
      midstream-error     two text deltas, then a Delta carrying an error
      lora-cpu            a final Delta with the 400 a CPU LoRA worker refuses prompt logprobs with
      forever             a token every 5 ms until cancelled
      never               no output at all until cancelled (queued)
      big                 64 KiB deltas, one per loop turn, until cancelled
      count-writes        6 deltas in ONE on_deltas call; counts socket writes
      count-turns         3 on_deltas calls in one loop turn, the final one in the next; counts writes
      anything else       sub.max_tokens tokens " t0", " t1", ... two per loop turn
    """

    def __init__(self):
        self.registry = prometheus_client.CollectorRegistry()
        self.submits: list[Submit] = []
        self.handles: list[int] = []  # of accepted submits, in order
        self.cancels: list[int] = []
        self.tasks: dict[int, asyncio.Task] = {}
        self.writes: list[int] = []
        self._next = 0

    def submit(self, sub: Submit, sink, group=None):
        self.submits.append(sub)
        if sub.model not in ("tiny", "sim-tiny"):
            return ErrorInfo(404, f"The model {sub.model!r} does not exist", code="model_not_found", param="model")
        text = sub.prompt if sub.kind == RequestKind.COMPLETION else sub.messages[-1].content
        if text.startswith("refuse:"):
            status = int(text.split(":")[1])
            return ErrorInfo(
                status,
                "refused by script",
                type="rate_limit_error" if status == 429 else "server_error",
                retry_after=1.5 if status in (429, 503) else None,
            )
        self._next += 1
        handle = self._next
        self.handles.append(handle)
        self.tasks[handle] = asyncio.get_running_loop().create_task(self._run(handle, sub, text, sink))
        return handle

    def tool_parser(self, model: str) -> tuple[str | None, bool]:
        return "hermes", True  # (how the served model writes tool calls, as its config says)

    def cancel(self, handle: int) -> None:
        self.cancels.append(handle)
        task = self.tasks.pop(handle, None)
        if task is not None:
            task.cancel()

    async def _run(self, handle: int, sub: Submit, text: str, sink) -> None:
        rid = sub.request_id
        prompt_tokens = len(text.split())
        if text == "queued-error":
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            sink.on_deltas(
                [
                    Delta(
                        rid,
                        error=ErrorInfo(
                            503, "queue deadline passed", type="server_error", code="queue_timeout", retry_after=2.2
                        ),
                    )
                ]
            )
        elif text == "midstream-error":
            sink.on_deltas([Delta(rid, "a", 1, prompt_tokens=prompt_tokens, completion_tokens=1)])
            await asyncio.sleep(0.01)
            sink.on_deltas([Delta(rid, "b", 1, completion_tokens=2)])
            await asyncio.sleep(0.01)
            sink.on_deltas([Delta(rid, error=ErrorInfo(503, "worker lost", type="server_error", code="worker_lost"))])
        elif text == "lora-cpu":  # as engine_worker.lora.refuse_prompt_logprobs, via the worker's _failed
            await asyncio.sleep(0)
            refused = ErrorInfo(400, "prompt logprobs are not served by this model's workers", param="prompt_logprobs")
            sink.on_deltas([Delta(rid, error=refused)])
        elif text == "forever":
            i = 0
            while True:
                i += 1
                sink.on_deltas([Delta(rid, f" t{i}", 1, completion_tokens=i)])
                await asyncio.sleep(0.005)
        elif text == "never":
            await asyncio.sleep(3600)
        elif text == "big":
            while True:
                sink.on_deltas([Delta(rid, "x" * 65536, 1)])
                await asyncio.sleep(0)
        elif text == "count-turns":
            sink.conn.transport = _CountingTransport(sink.conn.transport, self.writes)
            for i in range(3):
                sink.on_deltas([Delta(rid, f" c{i}", 1, completion_tokens=i + 1)])
            await asyncio.sleep(0)
            sink.on_deltas([Delta(rid, " end", 1, "stop", prompt_tokens=prompt_tokens, completion_tokens=4)])
        elif text == "count-writes":
            sink.conn.transport = _CountingTransport(sink.conn.transport, self.writes)
            deltas = [Delta(rid, f" w{i}", 1, completion_tokens=i + 1) for i in range(6)]
            deltas[-1].finish_reason = "stop"
            deltas[-1].prompt_tokens = prompt_tokens
            sink.on_deltas(deltas)
        else:
            n = sub.max_tokens or 16
            for start in range(0, n, 2):
                batch = [Delta(rid, f" t{i}", 1, completion_tokens=i + 1) for i in range(start, min(n, start + 2))]
                if start == 0:
                    batch[0].prompt_tokens = prompt_tokens
                if start + 2 >= n:
                    batch[-1].finish_reason = "length"
                    batch[-1].prompt_tokens = prompt_tokens
                sink.on_deltas(batch)
                await asyncio.sleep(0)
        self.tasks.pop(handle, None)

    def token_text(self, model):
        return None  # logprobs' tokens shown as ids

    def models(self):
        return [("tiny", 512, 1, "ready"), ("sim-tiny", 2048, 0, "loading")]

    def adapters(self):
        return [("tiny-lora", "tiny", 512, 1, "ready")]

    def adapters_for(self, api_key):
        return self.adapters() if api_key != "sk-no-adapters" else []

    def health(self):
        return {"status": "ok", "workers": 1}

    def readiness(self):
        return True, {"status": "ready", "models": {"tiny": 1, "sim-tiny": 0}}

    def drain(self, worker_id, on):
        return worker_id == "w0"

    def admin_workers(self):
        return [{"id": "w0", "model": "tiny", "running": len(self.tasks)}]

    def admin_queues(self):
        return [{"class": "normal", "queued": 0}]

    async def metrics_payload(self):
        return await self.page.payload()


class Server:
    def __init__(self, core: ScriptedCore, port: int, loop):
        self.core = core
        self.port = port
        self.loop = loop
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="sk-test", max_retries=0, timeout=10, **kw)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        return s

    def wait_for(self, predicate, timeout=5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return False


@pytest.fixture(scope="module")
def server():
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    core = ScriptedCore()

    metrics = RouterMetrics(core.registry)
    core.page = MetricsPage(core.registry, metrics.sources)

    async def start():
        return await start_http_server(
            core, core, metrics, "127.0.0.1", 0, max_body_bytes=MAX_BODY, max_buffered_bytes=MAX_BUFFERED
        )

    srv = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield Server(core, srv.sockets[0].getsockname()[1], loop)
    loop.call_soon_threadsafe(srv.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


# ------------------------------------------------------------ raw HTTP helpers


class Response:
    def __init__(self):
        self.status = None
        self.headers: dict[str, str] = {}
        self.body = b""
        self.chunks: list[bytes] = []
        self.complete = False

    @property
    def json(self):
        return json.loads(self.body)


class ResponseReader:
    """Reads successive responses from one socket with httptools' response parser."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.done: list[Response] = []
        self.cur = None
        self.closed = False
        self.taken = 0  # responses already returned by read()
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self):
        self.cur = Response()

    def on_status(self, status):
        pass

    def on_header(self, name, value):
        self.cur.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self):
        self.cur.status = self.parser.get_status_code()

    def on_body(self, body):
        self.cur.body += body
        self.cur.chunks.append(body)

    def on_message_complete(self):
        self.cur.complete = True
        self.done.append(self.cur)

    def read(self, until=None) -> Response:
        """Next complete response (``until``: stop early once the in-progress
        response satisfies it)."""
        n = self.taken
        while len(self.done) == n:
            if until and self.cur is not None and self.cur.status and until(self.cur):
                return self.cur
            data = self.sock.recv(65536)
            if not data:
                self.closed = True
                try:
                    self.parser.feed_data(b"")
                except httptools.HttpParserError:
                    pass
                if len(self.done) == n and self.cur is not None and self.cur.status:
                    # close-delimited body (HTTP/1.0)
                    self.cur.complete = True
                    self.done.append(self.cur)
                    break
                raise ConnectionError("closed before a response")
            self.parser.feed_data(data)
        self.taken += 1
        return self.done[n]

    def at_eof(self, timeout=3.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def post(path: str, obj, extra: str = "", version: str = "1.1") -> bytes:
    body = json.dumps(obj).encode()
    return (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def get(path: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


def sse_events(body: bytes) -> list[str]:
    return [e[len(b"data: ") :].decode() for e in body.split(b"\n\n") if e]


def metric(server: Server, name: str, **labels) -> float:
    text = requests.get(server.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------ the openai SDK


def test_sdk_completion_non_stream(server):
    c = server.client().completions.create(
        model="tiny",
        prompt="one two three",
        max_tokens=5,
        temperature=0.5,
        stop=["zz"],
        extra_headers={"x-weir-priority": "low"},
    )
    assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.model == "tiny"
    assert c.choices[0].text == " t0 t1 t2 t3 t4" and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (3, 5, 8)
    sub = server.core.submits[-1]
    assert sub.api_key == "sk-test" and sub.priority == "low" and sub.max_tokens == 5
    assert sub.params.temperature == 0.5 and sub.params.stop == ["zz"]


def test_sdk_chat_non_stream(server):
    c = server.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi there"}],
        max_completion_tokens=3,
    )
    assert c.object == "chat.completion" and c.id.startswith("chatcmpl-")
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == " t0 t1 t2"
    assert c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (2, 3)


def test_sdk_completion_stream_with_usage(server):
    chunks = list(
        server.client().completions.create(
            model="tiny", prompt="a b", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == " t0 t1 t2 t3 t4"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 5)


def test_sdk_chat_stream(server):
    chunks = list(
        server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == " t0 t1 t2 t3"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_sdk_models(server):
    client = server.client()
    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny", "sim-tiny", "tiny-lora"]
    # a LoRA adapter names its base model as parent (vLLM's field), a model none
    assert [getattr(m, "parent", "?") for m in listed] == [None, None, "tiny"]
    assert client.models.retrieve("sim-tiny").id == "sim-tiny"
    assert client.models.retrieve("tiny-lora").parent == "tiny"
    # a key whose allow-list leaves an adapter out is not shown it, and gets a 404 for it
    other = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-no-adapters", max_retries=0, timeout=10)
    assert [m.id for m in other.models.list()] == ["tiny", "sim-tiny"]
    with pytest.raises(openai.NotFoundError):
        other.models.retrieve("tiny-lora")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_sdk_validation_error_is_400_with_param(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="tiny", prompt="x", temperature=7)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"


def test_sdk_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"


def test_refusal_at_submit_has_status_and_retry_after(server):
    with pytest.raises(openai.RateLimitError) as e:
        server.client().completions.create(model="tiny", prompt="refuse:429", stream=True)
    assert e.value.response.headers["retry-after"] == "2"  # ceil(1.5)
    assert e.value.body["type"] == "rate_limit_error"


def test_stream_error_before_first_delta_gets_real_status(server):
    """A request refused while queued (final Delta with an error) still gets
    a real HTTP status with Retry-After, not a 200 stream."""
    with pytest.raises(openai.InternalServerError) as e:
        list(
            server.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "queued-error"}], stream=True
            )
        )
    assert e.value.status_code == 503
    assert e.value.response.headers["retry-after"] == "3"  # ceil(2.2)
    assert e.value.body["code"] == "queue_timeout"


def test_non_stream_error_gets_real_status(server):
    with pytest.raises(openai.InternalServerError) as e:
        server.client().completions.create(model="tiny", prompt="queued-error")
    assert e.value.status_code == 503


def test_stream_error_after_start_is_sse_error_event(server):
    stream = server.client().completions.create(model="tiny", prompt="midstream-error", stream=True)
    got = []
    with pytest.raises(openai.APIError) as e:
        for ch in stream:
            got.append(ch.choices[0].text)
    assert got == ["a", "b"]
    assert "worker lost" in str(e.value)
    # and on the wire: the error event is followed by [DONE] and the chunked end
    s = server.connect()
    s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "midstream-error", "stream": True}))
    r = ResponseReader(s).read()
    events = sse_events(r.body)
    assert r.status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "worker_lost"
    s.close()


def test_worker_refusing_prompt_logprobs_names_echo_the_field_the_client_sent(server):
    # the worker names SamplingParams' prompt_logprobs; an HTTP client asked for them with echo and
    # logprobs (its own prompt_logprobs field is refused before any job), so echo is what to drop
    for extra in ({"prompt": "lora-cpu"}, {"prompt": "lora-cpu", "stream": True}, {"prompt": ["lora-cpu", "x"]}):
        r = requests.post(
            server.url + "/v1/completions",
            json={"model": "tiny", "echo": True, "logprobs": 1, "max_tokens": 2, **extra},
            timeout=10,
        )
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == "echo", (extra, r.text)
    # without echo the prompt logprobs came from elsewhere: the worker's name stands
    r = requests.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "lora-cpu"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


# ------------------------------------------------------------ HTTP/1.1 behaviour


def test_tools_nested_too_deeply_to_write_their_constraint_are_a_400_never_a_500(server):
    """auto with a strict tool: the router writes vLLM's structural tag from the
    tool's schema, which nests it a few levels deeper than the body did.  At
    every depth up to the body decoder's limit: served, or a 400."""
    statuses = []
    for depth in range(900, 1000, 2):
        schema = '{"a":' * depth + "{}" + "}" * depth
        body = (
            '{"model":"tiny","messages":[{"role":"user","content":"x"}],"max_tokens":1,'
            '"tools":[{"type":"function","function":{"name":"f","strict":true,"parameters":' + schema + "}}]}"
        )
        r = requests.post(server.url + "/v1/chat/completions", data=body, timeout=10)
        statuses.append(r.status_code)
        if r.status_code == 400:
            assert r.json()["error"]["type"] == "invalid_request_error"
    assert set(statuses) <= {200, 400} and 400 in statuses, statuses


def test_keep_alive_reuses_one_connection(server):
    s = server.connect()
    reader = ResponseReader(s)
    for _ in range(3):
        s.sendall(get("/health"))
        r = reader.read()
        assert r.status == 200 and r.json == {"status": "ok", "workers": 1}
        s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "p", "max_tokens": 2}))
        r = reader.read()
        assert r.status == 200 and r.json["choices"][0]["text"] == " t0 t1"
        assert int(r.headers["content-length"]) == len(r.body)
        s.sendall(
            post(
                "/v1/chat/completions",
                {"model": "tiny", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "p"}]},
            )
        )
        r = reader.read()
        assert r.headers["transfer-encoding"] == "chunked" and r.headers["content-type"] == "text/event-stream"
        assert sse_events(r.body)[-1] == "[DONE]"
    assert not reader.closed
    s.close()


def test_requests_session_keep_alive(server):
    with requests.Session() as sess:
        for _ in range(3):
            r = sess.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert len(sess.get_adapter(server.url).poolmanager.pools) == 1


def test_pipelined_requests_answer_in_order(server):
    s = server.connect()
    s.sendall(
        post("/v1/completions", {"model": "tiny", "prompt": "p", "max_tokens": 6, "stream": True})
        + get("/v1/models")
        + get("/nope")
        + post("/v1/completions", {"model": "tiny", "prompt": "p", "max_tokens": 1})
    )
    reader = ResponseReader(s)
    first, second, third, fourth = (reader.read() for _ in range(4))
    assert first.status == 200 and sse_events(first.body)[-1] == "[DONE]"
    assert second.status == 200 and second.json["object"] == "list"
    assert third.status == 404
    assert fourth.status == 200 and fourth.json["choices"][0]["text"] == " t0"
    s.close()


def test_connection_close_is_honoured(server):
    s = server.connect()
    s.sendall(get("/health", "Connection: close\r\n"))
    reader = ResponseReader(s)
    r = reader.read()
    assert r.status == 200 and r.headers["connection"] == "close"
    assert reader.at_eof()


def test_http10_stream_is_close_delimited(server):
    s = server.connect()
    s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "p", "max_tokens": 3, "stream": True}, version="1.0"))
    reader = ResponseReader(s)
    r = reader.read()
    assert r.status == 200 and "transfer-encoding" not in r.headers
    assert sse_events(r.body)[-1] == "[DONE]"
    assert reader.closed or reader.at_eof()


def test_chunked_request_body(server):
    body = json.dumps({"model": "tiny", "prompt": "p", "max_tokens": 2}).encode()
    s = server.connect()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (10, body[:10])
        + b"%x\r\n%s\r\n" % (len(body) - 10, body[10:])
        + b"0\r\n\r\n"
    )
    r = ResponseReader(s).read()
    assert r.status == 200 and r.json["choices"][0]["text"] == " t0 t1"
    s.close()


def test_expect_100_continue(server):
    body = json.dumps({"model": "tiny", "prompt": "p", "max_tokens": 1}).encode()
    s = server.connect()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.sendall(body)
    assert ResponseReader(s).read().status == 200
    s.close()


def test_upgrade_request_is_answered_as_plain_http(server):
    s = server.connect()
    reader = ResponseReader(s)
    s.sendall(
        get(
            "/health",
            "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n",
        )
        + get("/v1/models")
    )
    assert reader.read().status == 200
    assert reader.read().json["object"] == "list"  # the connection carries on as HTTP/1.1
    s.close()


def test_upgrade_request_with_body_is_refused(server):
    """llhttp would hand the body to the upgraded protocol: refuse rather than lose it."""
    s = server.connect()
    s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "p"}, "Connection: Upgrade\r\nUpgrade: h2c\r\n"))
    reader = ResponseReader(s)
    r = reader.read()
    assert r.status == 400 and "upgrade" in r.json["error"]["message"]
    assert reader.at_eof()


# ------------------------------------------------------------ errors


def test_404_and_405_are_json(server):
    r = requests.get(server.url + "/v2/nothing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.get(server.url + "/v1/completions", timeout=5)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = requests.post(server.url + "/health", timeout=5)
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_bad_json_is_400_and_keeps_the_connection(server):
    s = server.connect()
    reader = ResponseReader(s)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{oops")
    r = reader.read()
    assert r.status == 400 and r.json["error"]["type"] == "invalid_request_error"
    s.sendall(get("/health"))
    assert reader.read().status == 200
    s.close()


def test_body_over_limit_by_content_length_is_413(server):
    s = server.connect()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    reader = ResponseReader(s)
    r = reader.read()
    assert r.status == 413 and r.json["error"]["code"] == "request_too_large"
    assert r.headers["connection"] == "close"
    s.close()


def test_chunked_body_over_limit_is_413(server):
    s = server.connect()
    piece = b"x" * 16384
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (len(piece), piece) * 5
    )
    r = ResponseReader(s).read()
    assert r.status == 413
    s.close()


def test_large_body_from_requests_reads_413_not_a_reset(server):
    """The client is still sending when the 413 goes out: the lingering close
    lets it read the reply."""
    r = requests.post(
        server.url + "/v1/completions",
        data=b"x" * (4 * MAX_BODY),
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413


@pytest.mark.parametrize(
    "garbage",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n",
    ],
)
def test_malformed_http_is_400_and_close(server, garbage):
    s = server.connect()
    s.sendall(garbage)
    reader = ResponseReader(s)
    r = reader.read()
    assert r.status == 400 and r.json["error"]["type"] == "invalid_request_error"
    assert reader.at_eof()


def test_server_survives_bad_input(server):
    """After all of the above the server still serves."""
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


# ------------------------------------------------------------ cancellation and backpressure


def _submitted(server, send) -> int:
    """Run ``send`` and return the handle of the request it submitted."""
    n = len(server.core.handles)
    send()
    assert server.wait_for(lambda: len(server.core.handles) > n)
    return server.core.handles[n]


def test_disconnect_mid_stream_cancels(server):
    s = server.connect()
    before = metric(server, "weir_http_requests_total", path="/v1/completions", status="499")
    handle = _submitted(
        server, lambda: s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "forever", "stream": True}))
    )
    r = ResponseReader(s).read(until=lambda r: len(r.chunks) >= 3)
    assert r.status == 200 and handle not in server.core.cancels
    s.close()
    assert server.wait_for(lambda: handle in server.core.cancels)
    assert server.wait_for(
        lambda: metric(server, "weir_http_requests_total", path="/v1/completions", status="499") == before + 1
    )


def test_disconnect_while_queued_cancels(server):
    s = server.connect()
    handle = _submitted(
        server, lambda: s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "never", "stream": True}))
    )
    s.close()
    assert server.wait_for(lambda: handle in server.core.cancels)


def test_non_stream_half_close_cancels(server):
    s = server.connect()
    handle = _submitted(
        server,
        lambda: s.sendall(
            post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "never"}]})
        ),
    )
    s.shutdown(socket.SHUT_WR)  # EOF from the client: it went away
    assert server.wait_for(lambda: handle in server.core.cancels)
    s.close()


def test_finished_request_is_not_cancelled(server):
    s = server.connect()
    handle = _submitted(server, lambda: s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "p"})))
    assert ResponseReader(s).read().status == 200
    s.close()
    time.sleep(0.1)
    assert handle not in server.core.cancels


def test_slow_reader_is_cut_off(server):
    """A client that stops reading cannot make the server buffer without
    bound: past max_buffered_bytes its stream is cancelled and dropped."""
    s = server.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    before = metric(server, "weir_http_requests_total", path="/v1/completions", status="499")
    handle = _submitted(
        server, lambda: s.sendall(post("/v1/completions", {"model": "tiny", "prompt": "big", "stream": True}))
    )
    assert server.wait_for(lambda: handle in server.core.cancels, timeout=10)
    assert metric(server, "weir_http_requests_total", path="/v1/completions", status="499") == before + 1
    s.close()


def test_one_write_per_delta_batch(server):
    """Head + every event of one on_deltas call + the chunked terminator: one write."""
    server.core.writes.clear()
    s = server.connect()
    s.sendall(
        post(
            "/v1/chat/completions",
            {
                "model": "tiny",
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "count-writes"}],
            },
        )
    )
    r = ResponseReader(s).read()
    events = sse_events(r.body)
    assert len(events) == 5  # role, content, finish, usage, [DONE]
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == " w0 w1 w2 w3 w4 w5"
    assert len(server.core.writes) == 1
    s.close()


def test_one_write_per_stream_per_loop_turn(server):
    """Deltas delivered by several on_deltas calls in one loop turn (a router
    draining several engine steps at once) leave in one write."""
    server.core.writes.clear()
    s = server.connect()
    s.sendall(post("/v1/completions", {"model": "tiny", "stream": True, "prompt": "count-turns"}))
    r = ResponseReader(s).read()
    events = sse_events(r.body)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [" c0", " c1", " c2", " end"]
    assert events[-1] == "[DONE]"
    assert len(server.core.writes) == 2  # turn 1: head + c0..c2; turn 2: end + [DONE] + terminator
    s.close()


# ------------------------------------------------------------ operational endpoints


def test_admin_and_health_endpoints(server):
    assert requests.get(server.url + "/admin/workers", timeout=5).json()[0]["id"] == "w0"
    assert requests.get(server.url + "/admin/queues", timeout=5).json() == [{"class": "normal", "queued": 0}]
    assert requests.get(server.url + "/health", timeout=5).json()["status"] == "ok"


def test_metrics_count_requests_and_latency(server):
    labels = {"path": "/v1/chat/completions", "status": "200"}
    before = metric(server, "weir_http_requests_total", **labels)
    hist_before = metric(server, "weir_http_request_duration_seconds_count", path="/v1/chat/completions")
    server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert metric(server, "weir_http_requests_total", **labels) == before + 1
    assert metric(server, "weir_http_request_duration_seconds_count", path="/v1/chat/completions") == hist_before + 1
    r = requests.get(server.url + "/metrics", timeout=5)
    assert r.headers["content-type"].startswith("text/plain")
    assert 'weir_http_requests_total{path="other",status="404"}' in r.text
