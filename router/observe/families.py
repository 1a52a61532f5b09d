"""Metric families whose children are plain Python numbers, written as text at
scrape time: prometheus_client's own ``Counter.inc`` / ``Histogram.observe`` cost
1-3 us each (a lock, a Python loop over the buckets), and a request makes five
or six of them; here an increment is an attribute add and an observation a
``bisect``.  The exposition is prometheus_client's (``_total``, ``_created``,
``_bucket``/``_count``/``_sum``).  ``router.observe.metrics`` (the router's
families) and the GenAI and phase families build on these."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from router.observe.exposition import header, label_text, number

# Latency buckets from sub-millisecond (sim, overhead) to minutes (long generations).
LATENCY_BUCKETS = (
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


class CounterChild:
    __slots__ = ("value", "created", "sort_key", "label_text")

    def __init__(self, sort_key: tuple[str, ...], label_text: str) -> None:
        self.value = 0.0
        self.created = time.time()
        self.sort_key = sort_key  # its label values as strings: the order of the exposition
        self.label_text = label_text  # ``{a="x",b="y"}``: its labels as the exposition writes them

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
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


Child = TypeVar("Child", CounterChild, HistogramChild)


def _sort_key(child: CounterChild | HistogramChild) -> tuple[str, ...]:
    return child.sort_key


class Family(Generic[Child]):
    """A labelled counter or histogram: children by label values."""

    __slots__ = ("name", "doc", "labelnames", "children")

    def __init__(self, name: str, doc: str, labelnames: list[str]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        # by label values, both as the caller passed them and as strings
        self.children: dict[tuple[object, ...], Child] = {}

    def _new_child(self, values: tuple[str, ...]) -> Child:
        raise NotImplementedError

    def collect(self) -> Metric:
        """The family as prometheus_client's (the reference ``text()`` is tested against)."""
        raise NotImplementedError

    def text(self) -> Iterator[str]:
        """The family in the text exposition, as ``generate_latest`` writes ``collect()``."""
        raise NotImplementedError

    def labels(self, *values: object) -> Child:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
            key = tuple(str(v) for v in values)
            child = self._new_child(key)
            self.children[key] = child
            self.children[values] = child  # the same child under the caller's exact key
        return child

    def _sorted(self) -> list[Child]:
        """Each child once, in ``_unique``'s order, allocating no object per child (a scrape's garbage
        is what sets off the interpreter's full collections, tens of ms each in a large router)."""
        return sorted({id(c): c for c in self.children.values()}.values(), key=_sort_key)

    def _unique(self) -> Iterator[tuple[list[str], Child]]:
        seen = set()
        for values, child in sorted(self.children.items(), key=lambda kv: tuple(map(str, kv[0]))):
            if id(child) not in seen:
                seen.add(id(child))
                yield [str(v) for v in values], child


class CounterFamily(Family[CounterChild]):
    __slots__ = ()

    def _new_child(self, values: tuple[str, ...]) -> CounterChild:
        return CounterChild(values, label_text(self.labelnames, values))

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


class HistogramFamily(Family[HistogramChild]):
    __slots__ = ("buckets",)

    def __init__(self, name: str, doc: str, labelnames: list[str], buckets: tuple[float, ...]) -> None:
        super().__init__(name, doc, labelnames)
        self.buckets = buckets

    def _new_child(self, values: tuple[str, ...]) -> HistogramChild:
        names = [*self.labelnames, "le"]
        bounds = [number(b) for b in self.buckets] + ["+Inf"]
        labels = label_text(self.labelnames, values)
        return HistogramChild(self.buckets, values, labels, [label_text(names, [*values, b]) for b in bounds])

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
