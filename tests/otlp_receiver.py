"""A real OTLP trace receiver for tests, built on the installed OTLP protobufs:
gRPC (TraceService/Export) and HTTP (POST /v1/traces, protobuf), keeping
every span it is sent with the service that sent it."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
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


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self, protocol: str = "grpc") -> None:
        self.protocol = protocol
        self.port = free_port()
        self.spans: list[RSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def take(self, body: bytes) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        got = []
        for rs in req.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        RSpan(
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
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(got)

    def start(self) -> Receiver:
        if self.protocol == "grpc":
            receiver = self

            class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request: Any, context: Any) -> Any:
                    receiver.take(request.SerializeToString())
                    return trace_service_pb2.ExportTraceServiceResponse()

            self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
            self._grpc.add_insecure_port(self.endpoint)
            self._grpc.start()
        else:
            take = self.take

            class Handler(BaseHTTPRequestHandler):
                def do_POST(self) -> None:
                    body = self.rfile.read(int(self.headers.get("content-length", "0")))
                    if self.path != "/v1/traces":
                        self.send_response(404)
                    else:
                        take(body)
                        self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                    self.send_header("content-length", "0")
                    self.end_headers()

                def log_message(self, *args: Any) -> None:
                    pass

            self._http = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
            threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(0)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def trace(self, trace_id: str) -> list[RSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[RSpan]:
        """The trace's spans once every name in ``names`` is among them (else what came, after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)
