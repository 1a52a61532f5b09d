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

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from router.observe.exposition import TextCollector, TextSource, header, label_text, number

# Latency buckets from sub-millisecond (sim, overhead) to minutes (long generations).
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class _CounterChild:
    __slots__ = ("value", "created", "sort_key", "label_text")

    def __init__(self, sort_key: tuple[str, ...], label_text: str) -> None:
        self.value = 0.0
        self.created = time.time()
        self.sort_key = sort_key  # its label values as strings: the order of the exposition
        self.label_text = label_text  # ``{a="x",b="y"}``: its labels as the exposition writes them

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created", "sort_key", "label_text", "bucket_labels")

    def __init__(
        self, bounds: tuple[float, ...], sort_key: tuple[str, ...], label_text: str, bucket_labels: list[str]
    ) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.created = time.time()
        self.sort_key = sort_key
        self.label_text = label_text
        self.bucket_labels = bucket_labels  # label_text with each bucket's ``le``, +Inf last

    def observe(self, value: float) -> None:
        # bucket ``le=b`` counts values <= b: the first bound >= value
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


_Child = TypeVar("_Child", _CounterChild, _HistogramChild)


def _sort_key(child: _CounterChild | _HistogramChild) -> tuple[str, ...]:
    return child.sort_key


class _Family(Generic[_Child]):
    """A labelled counter or histogram: children by label values."""

    __slots__ = ("name", "doc", "labelnames", "children")

    def __init__(self, name: str, doc: str, labelnames: list[str]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        # by label values, both as the caller passed them and as strings
        self.children: dict[tuple[object, ...], _Child] = {}

    def _new_child(self, values: tuple[str, ...]) -> _Child:
        raise NotImplementedError

    def collect(self) -> Metric:
        """The family as prometheus_client's (the reference ``text()`` is tested against)."""
        raise NotImplementedError

    def text(self) -> Iterator[str]:
        """The family in the text exposition, as ``generate_latest`` writes ``collect()``."""
        raise NotImplementedError

    def labels(self, *values: object) -> _Child:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
            key = tuple(str(v) for v in values)
            child = self._new_child(key)
            self.children[key] = child
            self.children[values] = child  # the same child under the caller's exact key
        return child

    def _sorted(self) -> list[_Child]:
        """Each child once, in ``_unique``'s order, allocating no object per child (a scrape's garbage
        is what sets off the interpreter's full collections, tens of ms each in a large router)."""
        return sorted({id(c): c for c in self.children.values()}.values(), key=_sort_key)

    def _unique(self) -> Iterator[tuple[list[str], _Child]]:
        seen = set()
        for values, child in sorted(self.children.items(), key=lambda kv: tuple(map(str, kv[0]))):
            if id(child) not in seen:
                seen.add(id(child))
                yield [str(v) for v in values], child


class CounterFamily(_Family[_CounterChild]):
    __slots__ = ()

    def _new_child(self, values: tuple[str, ...]) -> _CounterChild:
        return _CounterChild(values, label_text(self.labelnames, values))

    def collect(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, c in self._unique():
            fam.add_metric(values, c.value, created=c.created)
        return fam

    def text(self) -> Iterator[str]:
        children = self._sorted()  # taken now: children added meanwhile wait for the next scrape
        total = self.name + "_total"
        yield header(total, self.doc, "counter")
        for c in children:
            yield f"{total}{c.label_text} {number(c.value)}\n"
        if children:
            created = self.name + "_created"
            yield header(created, self.doc, "gauge")
            for c in children:
                yield f"{created}{c.label_text} {number(c.created)}\n"


class HistogramFamily(_Family[_HistogramChild]):
    __slots__ = ("buckets",)

    def __init__(self, name: str, doc: str, labelnames: list[str], buckets: tuple[float, ...]) -> None:
        super().__init__(name, doc, labelnames)
        self.buckets = buckets

    def _new_child(self, values: tuple[str, ...]) -> _HistogramChild:
        names = [*self.labelnames, "le"]
        bounds = [number(b) for b in self.buckets] + ["+Inf"]
        labels = label_text(self.labelnames, values)
        return _HistogramChild(self.buckets, values, labels, [label_text(names, [*values, b]) for b in bounds])

    def text(self) -> Iterator[str]:
        children = self._sorted()
        bucket, count, total = self.name + "_bucket", self.name + "_count", self.name + "_sum"
        yield header(self.name, self.doc, "histogram")
        for h in children:
            lines, cumulative = [], 0
            for labels, n in zip(h.bucket_labels, h.counts):  # one piece per child: its buckets agree with its count
                cumulative += n
                lines.append(f"{bucket}{labels} {number(cumulative)}\n")
            lines.append(f"{count}{h.label_text} {number(cumulative)}\n{total}{h.label_text} {number(h.sum)}\n")
            yield "".join(lines)
        if children:
            created = self.name + "_created"
            yield header(created, self.doc, "gauge")
            for h in children:
                yield f"{created}{h.label_text} {number(h.created)}\n"

    def collect(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        # (prometheus_client ships floatToGoString unannotated)
        bounds = [floatToGoString(b) for b in self.buckets] + ["+Inf"]  # type: ignore[no-untyped-call]
        created: list[Sample] = []
        for values, h in self._unique():
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip(bounds, h.counts):
                cumulative += n
                buckets.append((bound, cumulative))
            fam.add_metric(values, buckets, h.sum)
            created.append(Sample(self.name + "_created", dict(zip(self.labelnames, values)), h.created))
        fam.samples.extend(created)
        return fam


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
            _LATENCY_BUCKETS,
        )
        self.e2e = HistogramFamily(
            "weir_request_duration_seconds", "Arrival at the router to last token", ["model", "klass"], _LATENCY_BUCKETS
        )
        self.queue_wait = HistogramFamily(
            "weir_queue_wait_seconds", "Arrival to dispatch to a worker", ["klass", "pool"], _LATENCY_BUCKETS
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
            _LATENCY_BUCKETS,
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
        self._families: list[CounterFamily | HistogramFamily] = [
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
        from router.observe.genai_metrics import GenAiMetrics  # (they import this module)
        from router.observe.phase_metrics import PhaseMetrics

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
    def child(metric: _Family[_Child], *labels: object) -> _Child:
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
