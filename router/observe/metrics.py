"""The router's Prometheus metrics.

Per-request metrics are plain Python numbers on label-bound children, turned
into Prometheus families only when scraped: prometheus_client's own
``Counter.inc`` / ``Histogram.observe`` cost 1-3 us each (a lock, a Python
loop over the buckets), and a request makes five or six of them.  Here an
increment is an attribute add and an observation a ``bisect``.  The
exposition is the same as prometheus_client's (``_total``, ``_created``,
``_bucket``/``_count``/``_sum``), written as text by ``text()`` (router.observe.exposition:
each child's label string built once, when it is created).  Everything runs
on the router's event loop, so no locks.

State that already lives elsewhere -- queue depths, reservations, worker
stats -- is read at scrape time by a collector instead of being mirrored on
every event.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry

from router.observe.exposition import TextCollector, TextSource, header, label_text, number
from router.observe.families import (
    LATENCY_BUCKETS,
    Child,
    CounterFamily,
    Family,
    HistogramFamily,
)
from router.observe.genai_metrics import GenAiMetrics
from router.observe.phase_metrics import PhaseMetrics

MAX_USERS_PER_TENANT = 10_000


class RouterMetrics(TextCollector):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = CounterFamily(
            "weir_requests", "Requests finished, by model, class and outcome", ["model", "klass", "outcome"]
        )
        self.rejected = CounterFamily(
            "weir_rejected", "Requests refused, by class, pool and reason", ["klass", "pool", "reason"]
        )
        self.tokens = CounterFamily("weir_output_tokens", "Tokens generated", ["model"])
        self.ttft = HistogramFamily(
            "weir_time_to_first_token_seconds",
            "Arrival at the router to first token",
            ["model", "klass"],
            LATENCY_BUCKETS,
        )
        self.e2e = HistogramFamily(
            "weir_request_duration_seconds", "Arrival at the router to last token", ["model", "klass"], LATENCY_BUCKETS
        )
        self.queue_wait = HistogramFamily(
            "weir_queue_wait_seconds", "Arrival to dispatch to a worker", ["klass", "pool"], LATENCY_BUCKETS
        )
        self.worker_events = CounterFamily("weir_worker_events", "Worker registrations and losses", ["worker", "event"])
        self.fallbacks = CounterFamily(
            "weir_fallbacks",
            "Requests answered by a fallback model, by the model asked for and the one that answered",
            ["model", "fallback"],
        )
        self.resumed = CounterFamily(
            "weir_resumed",
            "Requests continued on another worker after output streamed, by model and why",
            ["model", "why"],
        )
        self.bad_frames = CounterFamily("weir_malformed_frames", "ZeroMQ frames dropped as undecodable", ["socket"])
        # The HTTP ingress's (router.ingress.http_server); the path label is its route.
        self.http_requests = CounterFamily(
            "weir_http_requests", "HTTP requests answered by the router, by route and status", ["path", "status"]
        )
        self.http_duration = HistogramFamily(
            "weir_http_request_duration_seconds",
            "Time from a request's last byte to its response's last byte (whole stream for SSE)",
            ["path"],
            LATENCY_BUCKETS,
        )
        # OpenAI's ``user`` field: recorded under the tenant the API key says,
        # never used as an identity; distinct ids are counted up to a bound.
        self.user_requests = CounterFamily(
            "weir_user_field_requests", "Requests that named an end user (OpenAI's `user` field), by tenant", ["tenant"]
        )
        self.users: dict[str, set[str]] = {}
        self.auth_denied = CounterFamily(
            "weir_zmq_auth_denied",
            "ZeroMQ peers refused by CURVE (unknown key), by ZAP domain (clients, workers)",
            ["domain"],
        )
        # LoRA adapters (router.lifecycle.adapters, router.policy.adapter_placement)
        self.adapter_requests = CounterFamily(
            "weir_adapter_requests",
            "Requests finished under a LoRA adapter, by adapter and outcome",
            ["adapter", "outcome"],
        )
        self.adapter_tokens = CounterFamily(
            "weir_adapter_tokens", "Tokens of requests under a LoRA adapter, by adapter and kind", ["adapter", "kind"]
        )
        self.adapter_loads = CounterFamily(
            "weir_adapter_loads", "Dispatches under an adapter to a worker that did not hold it (a load)", ["adapter"]
        )
        self.adapter_evictions = CounterFamily(
            "weir_adapter_evictions", "Adapters a worker's heartbeat stopped reporting held", ["adapter"]
        )
        self._families: list[CounterFamily | HistogramFamily] = [
            self.adapter_requests,
            self.adapter_tokens,
            self.adapter_loads,
            self.adapter_evictions,
            self.auth_denied,
            self.requests,
            self.rejected,
            self.tokens,
            self.ttft,
            self.e2e,
            self.queue_wait,
            self.worker_events,
            self.resumed,
            self.fallbacks,
            self.bad_frames,
            self.http_requests,
            self.http_duration,
            self.user_requests,
        ]
        # What /metrics writes as text (router.observe.exposition), after the registry's other collectors.
        self.sources: list[TextSource] = [self.text]
        self.registry.register(self)
        # The same latencies under OpenTelemetry's GenAI names (router.observe.genai_metrics)
        self.genai = GenAiMetrics()
        self.add_text_source(self.genai)
        self.phases = PhaseMetrics()  # where finished requests' time went, by model (weir stats)
        self.add_text_source(self.phases)

    def add_text_source(self, source: TextCollector) -> None:
        """A text source on /metrics, and in the registry for its other readers."""
        self.sources.append(source.text)
        self.registry.register(source)

    def saw_user(self, tenant: str, user: str) -> None:
        self.child(self.user_requests, tenant).inc()
        seen = self.users.get(tenant)
        if seen is None:
            seen = self.users[tenant] = set()
        if len(seen) < MAX_USERS_PER_TENANT:
            seen.add(user)

    @staticmethod
    def child(metric: Family[Child], *labels: object) -> Child:
        """``metric.labels(*labels)``: a child with ``inc()`` (a counter's) or ``observe()`` (a histogram's)."""
        child = metric.children.get(labels)
        return child if child is not None else metric.labels(*labels)

    def text(self) -> Iterator[str]:
        for f in self._families:
            yield from f.text()
        name = "weir_tenant_distinct_users"
        yield header(name, f"Distinct `user` values seen per tenant (counted up to {MAX_USERS_PER_TENANT})", "gauge")
        for tenant, seen in sorted(self.users.items()):
            yield f"{name}{label_text(['tenant'], [tenant])} {number(len(seen))}\n"

    def observe_http(self, path: str, status: int, seconds: float) -> None:
        self.child(self.http_requests, path, status).inc()
        self.child(self.http_duration, path).observe(seconds)
