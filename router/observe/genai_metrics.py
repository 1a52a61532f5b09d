"""Metrics under OpenTelemetry's GenAI semantic-convention names, beside weir's own,
so dashboards built for those names work on weir (docs/operating.md#tracing).

``gen_ai.server.time_to_first_token``, ``gen_ai.server.time_per_output_token``
and ``gen_ai.server.request.duration`` as Prometheus histograms (dots become
underscores, seconds a ``_seconds`` suffix), labelled by the conventions'
``gen_ai.operation.name`` and ``gen_ai.request.model``, with the conventions'
bucket boundaries.  The same observations as weir's ``weir_time_to_first_token_seconds``
and ``weir_request_duration_seconds``: a bisect each (router.observe.metrics).
"""

from __future__ import annotations

from collections.abc import Iterator

from router.observe.exposition import TextCollector
from router.observe.families import HistogramChild, HistogramFamily

# By RequestKind's value: COMPLETION, CHAT, EMBEDDING (shared.protocol).
OPERATIONS = ("text_completion", "chat", "embeddings")
_LABELS = ["gen_ai_operation_name", "gen_ai_request_model"]

# The conventions' advised boundaries (semantic-conventions, gen-ai-metrics).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


class GenAiChildren:
    """One model's children, by operation (RequestKind's value): what a job observes into."""

    __slots__ = ("ttft", "tpot", "duration")

    def __init__(self, g: GenAiMetrics, model: str) -> None:
        self.ttft: tuple[HistogramChild, ...] = tuple(g.ttft.labels(op, model) for op in OPERATIONS)
        self.tpot: tuple[HistogramChild, ...] = tuple(g.tpot.labels(op, model) for op in OPERATIONS)
        self.duration: tuple[HistogramChild, ...] = tuple(g.duration.labels(op, model) for op in OPERATIONS)


class GenAiMetrics(TextCollector):
    def __init__(self) -> None:
        self.ttft = HistogramFamily(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to generate the first token (GenAI semantic conventions; the router's view: arrival to first token)",
            _LABELS,
            TTFT_BUCKETS,
        )
        self.tpot = HistogramFamily(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first (GenAI semantic conventions)",
            _LABELS,
            TPOT_BUCKETS,
        )
        self.duration = HistogramFamily(
            "gen_ai_server_request_duration_seconds",
            "Generative AI server request duration (GenAI semantic conventions; requests that finished)",
            _LABELS,
            DURATION_BUCKETS,
        )
        self._models: dict[str, GenAiChildren] = {}

    def for_model(self, model: str) -> GenAiChildren:
        got = self._models.get(model)
        if got is None:
            got = self._models[model] = GenAiChildren(self, model)
        return got

    def text(self) -> Iterator[str]:
        for f in (self.ttft, self.tpot, self.duration):
            yield from f.text()
