"""A real OTLP trace receiver for tests, built on the installed OTLP protobufs:
gRPC (TraceService/Export) and HTTP (POST /v1/traces, protobuf; chunked, as
Envoy sends it), keeping every span it is sent with the service that sent it.

It runs as a process of its own (``python tests/otlp_receiver.py``), as a
collector would, and writes each span as a JSON line the test reads: a gRPC
server's threads in the test process are in every process the test forks
(an Envoy started beside one aborted in gRPC's fork handler)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stackutil import free_port


@dataclass
class RSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[str] = field(default_factory=list)


class Receiver:
    """The receiver process, and what it has received so far."""

    def __init__(self, protocol: str = "grpc") -> None:
        self.protocol = protocol
        self.port = free_port()
        self._out = Path(tempfile.mkdtemp(prefix="otlp-")) / "spans.jsonl"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        self._out.touch()
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--protocol", self.protocol, "--port", str(self.port), "--out", str(self._out)],
            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the OTLP receiver did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)

    @property
    def spans(self) -> list[RSpan]:
        out = []
        for line in self._out.read_text().splitlines():
            if line.endswith("}"):  # (a line being written is skipped until whole)
                out.append(RSpan(**json.loads(line)))
        return out

    def trace(self, trace_id: str) -> list[RSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[RSpan]:
        """The trace's spans once every name in ``names`` is among them (else what came, after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


# -- the receiver process ------------------------------------------------------------


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _serve(protocol: str, port: int, out_path: str) -> None:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    lock = threading.Lock()
    out = open(out_path, "a")

    def take(body: bytes) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        lines = []
        for rs in req.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span = RSpan(
                        service,
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.kind,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        [link.span_id.hex() for link in s.links],
                    )
                    lines.append(json.dumps(asdict(span)) + "\n")
        with lock:
            out.write("".join(lines))
            out.flush()

    if protocol == "grpc":
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                take(request.SerializeToString())
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self._body()
            if self.path != "/v1/traces":
                self.send_response(404)
            else:
                take(body)
                self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def _body(self) -> bytes:
            if self.headers.get("transfer-encoding", "").lower() != "chunked":
                return self.rfile.read(int(self.headers.get("content-length", "0")))
            body = b""
            while True:  # Envoy's exporter sends its body chunked
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size + 2)
                if size == 0:
                    return body
                body += chunk[:-2]

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--protocol", choices=["grpc", "http"], required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _serve(a.protocol, a.port, a.out)


# Spans exported from a child process: gRPC's threads in the test runner itself
# made a later fork (a stack's Envoy, before its exec) abort now and then
# ("epoll_wait error: Bad file descriptor"), so the runner never loads grpc.
_EXPORT_CHILD = r"""
import json, sys, time
from shared.config import TracingConfig
from shared.otlp import SERVER, Span, SpanExporter, new_span_id
endpoint, protocol, tid, n, timeout_s = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
cfg = TracingConfig(endpoint=endpoint, protocol=protocol, **({"export_timeout_s": timeout_s} if timeout_s > 0 else {}))
exp = SpanExporter(cfg, "weir-test")
def span(name, parent=b""):
    now = time.time_ns()
    return Span(tid, new_span_id(), parent, name, SERVER, now, now + 1000, {"gen_ai.request.model": "m", "n": 3, "x": 0.5})
t0 = time.perf_counter()
if n == 0:  # a root and its child
    root = span("root")
    exp.add([root, span("child", root.span_id)])
else:
    for _ in range(n):
        exp.add([span("s")])
added_s = time.perf_counter() - t0
exp.close(timeout_s=5.0)
print(json.dumps({"exported": exp.exported, "dropped": exp.dropped, "added_s": added_s}))
"""


def export_in_child(
    endpoint: str, protocol: str, trace_id: bytes, n: int = 0, timeout_s: float = 0.0
) -> dict[str, Any]:
    """Export spans of ``trace_id`` from a child process (n=0: a root and its
    child; else n single spans): its exporter's counts and how long adding took."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _EXPORT_CHILD, endpoint, protocol, trace_id.hex(), str(n), str(timeout_s)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=repo,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
