"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from .metrics import OK, Record

_GETTERS = {
    "ttft_ms": lambda r: r.ttft,
    "e2e_ms": lambda r: r.e2e,
    "tpot_ms": lambda r: r.tpot,
}


def _values(records: Sequence[Record], metric: str) -> np.ndarray:
    get = _GETTERS[metric]
    xs = [get(r) for r in records if r.status == OK]
    return np.sort(np.asarray([x for x in xs if x is not None], dtype=float) * 1000.0)


def latency_cdf(series: dict[str, Sequence[Record]], path: Path, title: str, metrics=("ttft_ms", "e2e_ms")) -> Path:
    """One panel per metric; one CDF line per series (class, or run)."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for name, recs in series.items():
            v = _values(recs, m)
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{name} (n={len(v)})")
        ax.set_xscale("log")
        ax.set_xlabel(m.replace("_ms", " (ms, log)").upper())
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_vs_load(sweeps: dict[str, list[dict]], path: Path, title: str, metric: str = "e2e_ms") -> Path:
    """p50/p99 of ``metric`` and achieved throughput against offered load;
    ``sweeps`` maps a series name (e.g. a path) to its sweep points, each
    ``{"offered": req/s, "summary": run summary}``."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, pts in sweeps.items():
        pts = sorted(pts, key=lambda p: p["offered"])
        x = [p["offered"] for p in pts]
        s = [p["summary"]["overall"] for p in pts]
        p50 = [o[metric]["p50"] if o[metric] else np.nan for o in s]
        p99 = [o[metric]["p99"] if o[metric] else np.nan for o in s]
        (line,) = ax.plot(x, p50, "o-", label=f"{name} p50")
        ax.plot(x, p99, "s--", color=line.get_color(), label=f"{name} p99")
        ax2.plot(x, [o["throughput_rps"] for o in s], "o-", color=line.get_color(), label=name)
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel(metric.replace("_ms", " (ms, log)").upper())
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("offered load (req/s)")
    ax2.set_ylabel("achieved (req/s)")
    lim = max((p["offered"] for pts in sweeps.values() for p in pts), default=1)
    ax2.plot([0, lim], [0, lim], color="grey", lw=0.6, ls=":")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
