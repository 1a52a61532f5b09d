"""The router's text exposition (router.observe.exposition, the families' ``text()``)
is byte for byte what prometheus_client's ``generate_latest`` writes for the
same families, awkward label values and numbers included: dashboards and
alert rules read the same page whichever writes it."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.utils import floatToGoString

from router.observe.exposition import label_text, number
from router.observe.families import CounterFamily, HistogramFamily


class _One:
    def __init__(self, family: CounterFamily | HistogramFamily) -> None:
        self.family = family

    def collect(self):
        return [self.family.collect()]


def _same(family: CounterFamily | HistogramFamily) -> None:
    assert "".join(family.text()).encode() == generate_latest(_One(family))


AWKWARD = ["plain", 'quo"te', "back\\slash", "new\nline", "ünïcödé", "", "w-0.a_b:c"]


def test_counter_text_is_generate_latests():
    c = CounterFamily("weir_x", "Doc with \\ and\nnewline", ["worker", "event"])
    _same(c)  # no children: the header only
    for i, v in enumerate(AWKWARD):
        c.labels(v, "registered" if i % 2 else 200).inc(10**i + 0.5)
    c.labels("big", "x").inc(123456789.0)
    c.labels("neg", "x").inc(-3)
    c.labels("inf", "x").inc(math.inf)
    _same(c)


def test_histogram_text_is_generate_latests_whatever_sorts_before_le():
    for names in (["model", "klass"], ["a"], ["zz", "path"]):  # label names each side of "le"
        h = HistogramFamily("weir_h_seconds", "Latency", names, (0.0005, 0.01, 1.0, 2.5, 60.0, 1e7))
        _same(h)
        for i, v in enumerate(AWKWARD):
            child = h.labels(*([v] * len(names)))
            for x in (0.0001, 0.01, 3.0, 1e9, i):
                child.observe(x)
        _same(h)


@given(st.one_of(st.integers(min_value=-(10**20), max_value=10**20), st.floats(allow_nan=False), st.booleans()))
def test_number_is_float_to_go_string(v):
    assert number(v) == floatToGoString(v)


def test_label_text_sorts_by_name_and_escapes():
    assert label_text([], []) == ""
    assert label_text(["worker", "model"], ['a"b', "c\\d\ne"]) == '{model="c\\\\d\\ne",worker="a\\"b"}'
