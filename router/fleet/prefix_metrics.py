"""Prometheus metrics of prefix-cache routing (router/fleet/prefix_index.py).

Counters and the lag histogram are updated on the loop (the same cheap
children as router.observe.metrics); index sizes and worker trust are read from the
index at scrape time.  Hit rate per worker and model:
``rate(weir_prefix_cached_tokens_total[5m]) / rate(weir_prefix_prompt_tokens_total[5m])``.
"""

from __future__ import annotations

from collections.abc import Iterator

from router.fleet.prefix_index import PrefixIndex
from router.observe.exposition import TextCollector, header, label_text, number
from router.observe.families import CounterFamily, HistogramFamily
from router.observe.metrics import RouterMetrics

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PrefixMetrics(TextCollector):
    def __init__(self, metrics: RouterMetrics, index: PrefixIndex) -> None:
        self.index = index
        self.prompt_tokens = CounterFamily(
            "weir_prefix_prompt_tokens", "Prompt tokens of finished requests, by model and worker", ["model", "worker"]
        )
        self.cached_tokens = CounterFamily(
            "weir_prefix_cached_tokens",
            "Of those, tokens the engine found in its prefix cache (vLLM's num_cached_tokens)",
            ["model", "worker"],
        )
        self.lag = HistogramFamily(
            "weir_prefix_event_lag_seconds",
            "Engine's KV event batch to the router applying it (wall clocks of two hosts where they differ)",
            ["worker"],
            _LAG_BUCKETS,
        )
        self.recoveries = CounterFamily(
            "weir_prefix_recoveries",
            "Snapshots asked of a worker because its prefix "
            "events had a gap or a heartbeat announced one never applied",
            ["worker"],
        )
        self._families: list[CounterFamily | HistogramFamily] = [
            self.prompt_tokens,
            self.cached_tokens,
            self.lag,
            self.recoveries,
        ]
        metrics.add_text_source(self)  # per worker: written as text (router.observe.exposition)

    def text(self) -> Iterator[str]:
        for f in self._families:
            yield from f.text()
        view = self.index.view()
        models = sorted(view["models"].items())
        size, evicted = "weir_prefix_index_blocks", "weir_prefix_index_evicted_total"
        yield header(size, "Block hashes in the router's prefix index", "gauge")
        for name, m in models:
            yield f"{size}{label_text(['model'], [name])} {number(m['blocks'])}\n"
        yield header(evicted, "Index entries evicted at its cap (scheduler.prefix_index_max_blocks)", "counter")
        for name, m in models:
            yield f"{evicted}{label_text(['model'], [name])} {number(m['evicted'])}\n"
        workers = [
            (label_text(["worker", "model"], [wid, w["model"]]), w) for wid, w in sorted(view["workers"].items())
        ]
        blocks, trusted = "weir_prefix_worker_blocks", "weir_prefix_worker_trusted"
        yield header(blocks, "Blocks the index holds for a worker", "gauge")
        for labels, w in workers:
            yield f"{blocks}{labels} {number(w['blocks'])}\n"
        yield header(trusted, "1 while the worker's prefix entries count (0: cache-blind until its snapshot)", "gauge")
        for labels, w in workers:
            yield f"{trusted}{labels} {'1.0' if w['trusted'] else '0.0'}\n"
