"""The /metrics page without holding the router's loop.

With a large fleet most of the page is per-worker series (about fifteen lines
a worker: 1,024 workers are some 15,000 lines, 1.2 MB).  prometheus_client's
``generate_latest`` builds a sample object per line and escapes every label of
every line, 0.1-0.2 s for such a fleet, all of it on the loop every other
stream is served from.  So the big families are written here as text
directly -- label strings built once per child or worker, numbers formatted
as prometheus_client formats them (byte for byte the same exposition) -- by
*text sources*: generators of text pieces that read the router's live state
as they go.  ``render`` runs them on the loop in slices of ``SLICE_S``,
letting the loop serve everything else between slices; the small collectors
in the prometheus_client registry (per-model gauges, tenants, stores) are
rendered by ``generate_latest`` in one slice first.  Text sources are
registered collectors too (``TextCollector``), so the registry stays whole
for its other readers; the page's pass over it skips them.

Staleness: each source reads the router's state as its slices run (the
per-worker series from one snapshot taken when they start), so a page shows
the router's state from the start to the end of its own render (~12 ms of
CPU at 1,024 workers, spread over loop turns); scrapes
that arrive while a render is in flight share it (``MetricsPage``), so their
data is at most that render's duration older than their arrival.  Nothing
is cached between renders and nothing runs off the loop, so no locks.

A source must not fail part-way on state changing between slices: it takes
a list of what it iterates (the workers, a family's children) before it
yields its first piece, and reads each item's values when it comes to it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Loop time one slice of a render may hold before it lets the loop run.
SLICE_S = 0.002
# Pieces written between two looks at the clock (a look costs ~0.1 us).
_PIECES_PER_LOOK = 32

TextSource = Callable[[], Iterator[str]]

# True while a page renders the registry (in that thread): collectors that
# are text sources yield nothing then, their text being on the page already.
_WRITING_PAGE: ContextVar[bool] = ContextVar("weir_writing_metrics_page", default=False)


class TextCollector(Collector):
    """A text source that is also registered as a prometheus_client collector,
    so the registry stays whole for its other readers (``get_sample_value``,
    tests): they get the same text parsed back.  The page's own pass over the
    registry skips it."""

    def text(self) -> Iterator[str]:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if _WRITING_PAGE.get():
            return iter(())
        return iter(text_string_to_metric_families("".join(self.text())))


def number(v: float | int | bool) -> str:
    """``floatToGoString``'s text for ``v`` (``5`` -> ``5.0``, ``2e6`` -> ``2e+06``), ints the fast way."""
    if type(v) is int and -(10**15) < v < 1_000_000:  # repr(float(v)) is then "<v>.0" (bool is not int here)
        return f"{v}.0"
    s: str = floatToGoString(v)  # type: ignore[no-untyped-call]  # (shipped unannotated)
    return s


def label_text(names: Sequence[str], values: Sequence[object]) -> str:
    """``{a="x",b="y"}`` with labels sorted by name and values escaped, as
    prometheus_client writes them; ``""`` without labels."""
    if not names:
        return ""
    pairs = sorted(zip(names, values))
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs) + "}"


def _escape(s: str) -> str:
    if "\\" in s or "\n" in s or '"' in s:
        return s.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return s


def header(name: str, doc: str, kind: str) -> str:
    """A family's ``# HELP`` and ``# TYPE`` lines."""
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


async def render(registry: CollectorRegistry, sources: Sequence[TextSource]) -> bytes:
    """The whole page: the registry's collectors, then each source's text (see the module's docstring)."""
    clock = time.perf_counter
    writing = _WRITING_PAGE.set(True)
    try:
        parts = [generate_latest(registry).decode()]  # the small collectors: one slice
    finally:
        _WRITING_PAGE.reset(writing)
    await asyncio.sleep(0)
    deadline = clock() + SLICE_S
    for source in sources:
        n = 0
        for piece in source():  # a source's first piece may follow a snapshot of its state: look at once
            parts.append(piece)
            if n % _PIECES_PER_LOOK == 0 and clock() > deadline:
                await asyncio.sleep(0)  # one turn of the loop: its ready callbacks and I/O run
                deadline = clock() + SLICE_S
            n += 1
    await asyncio.sleep(0)  # the join (~1 ms a megabyte) in a slice of its own
    return "".join(parts).encode()


class MetricsPage:
    """The /metrics body; scrapes that arrive while one renders share it."""

    def __init__(self, registry: CollectorRegistry, sources: Sequence[TextSource]) -> None:
        self.registry = registry
        self.sources = sources
        self._inflight: asyncio.Task[bytes] | None = None
        self.renders = 0  # how many were started (shared scrapes do not start one)

    async def payload(self) -> tuple[bytes, str]:
        task = self._inflight
        if task is None or task.done():
            self.renders += 1
            task = self._inflight = asyncio.get_running_loop().create_task(render(self.registry, self.sources))
        # shielded: a scrape whose client went away does not cancel the others' render
        return await asyncio.shield(task), CONTENT_TYPE_LATEST
