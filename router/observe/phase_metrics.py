"""The phases of finished requests by model (router.observe.phases), as one
histogram ``weir_request_phase_seconds{model, phase}``: what ``weir stats``
splits each model's time by, and what a dashboard can."""

from __future__ import annotations

from collections.abc import Iterator

from router.observe.exposition import TextCollector
from router.observe.families import LATENCY_BUCKETS, HistogramChild, HistogramFamily
from shared.protocol import Timing

PHASES = ("tokenize", "queue", "prefill", "decode")


class PhaseMetrics(TextCollector):
    def __init__(self) -> None:
        self.phase = HistogramFamily(
            "weir_request_phase_seconds",
            "Where finished requests' time went in the router, by model and phase (tokenize, queue, prefill, decode)",
            ["model", "phase"],
            LATENCY_BUCKETS,
        )
        self._models: dict[str, tuple[HistogramChild, ...]] = {}

    def for_model(self, model: str) -> tuple[HistogramChild, ...]:
        got = self._models.get(model)
        if got is None:
            got = self._models[model] = tuple(self.phase.labels(model, ph) for ph in PHASES)
        return got

    def text(self) -> Iterator[str]:
        yield from self.phase.text()


def observe(children: tuple[HistogramChild, ...], t: Timing) -> None:
    children[0].observe(t.tokenize)
    children[1].observe(t.queue)
    children[2].observe(t.prefill)
    children[3].observe(t.decode)
