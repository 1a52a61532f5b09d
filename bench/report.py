"""Human-readable tables and result files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def _f(x: float | None, nd: int = 2) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def _lat(s: dict, m: str) -> list[str]:
    p = s.get(m)
    return [_f(p and p["p50"]), _f(p and p["p90"]), _f(p and p["p99"])]


def rows(summary: dict) -> list[tuple[str, dict]]:
    out = [(name, s) for name, s in summary["classes"].items()]
    if len(out) != 1:
        out.append(("overall", summary["overall"]))
    return out


def markdown_table(summary: dict) -> str:
    """One row per class plus overall: counts, throughput, p50/p90/p99."""
    head = ["class", "sent", "ok", "429", "503", "other", "req/s", "tok/s", "goodput"]
    for m in METRICS:
        n = m.removesuffix("_ms").upper()
        head += [f"{n} p50", f"{n} p90", f"{n} p99"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in rows(summary):
        other = sum(v for k, v in s["http_errors"].items() if k not in ("429", "503")) + s["errors"] + s["incomplete"]
        g = s.get("goodput_fraction")
        cells = [
            name,
            str(s["sent"]),
            str(s["ok"]),
            str(s["rate_limited_429"]),
            str(s["unavailable_503"]),
            str(other),
            _f(s["throughput_rps"], 1),
            _f(s["output_tok_per_s"], 0),
            "-" if g is None else f"{100 * g:.1f} %",
        ]
        for m in METRICS:
            cells += _lat(s, m)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text_report(result_json: dict) -> str:
    meta, summary = result_json["meta"], result_json["summary"]
    o = summary["overall"]
    lines = [
        f"weir bench: {meta['label']} -> {meta['target']} ({meta['arrivals']})",
        f"  {o['sent']} sent, {o['ok']} ok, http errors {o['http_errors'] or 'none'}, "
        f"transport errors {o['errors']}, incomplete {o['incomplete']} "
        f"in {summary['elapsed_s']:.2f} s; client CPU {100 * summary['client_cpu_util']:.0f} %",
    ]
    if o.get("first_error"):
        lines.append(f"  first error: {o['first_error']}")
    lines += ["", "latencies in ms", markdown_table(summary)]
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def sweep_table(points: Iterable[dict], metric: str = "e2e_ms") -> str:
    """Offered vs achieved load and latency, one row per sweep point."""
    lines = [
        "| offered req/s | achieved req/s | tok/s | ok | errors | TTFT p50 | TTFT p99 | "
        f"{metric.removesuffix('_ms').upper()} p50 | p99 | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pt in points:
        s = pt["summary"]["overall"]
        bad = s["sent"] - s["ok"]
        lines.append(
            "| "
            + " | ".join(
                [
                    _f(pt["offered"], 0),
                    _f(s["throughput_rps"], 0),
                    _f(s["output_tok_per_s"], 0),
                    str(s["ok"]),
                    str(bad),
                    _f(s["ttft_ms"] and s["ttft_ms"]["p50"]),
                    _f(s["ttft_ms"] and s["ttft_ms"]["p99"]),
                    _f(s[metric] and s[metric]["p50"]),
                    _f(s[metric] and s[metric]["p99"]),
                    f"{100 * pt['summary']['client_cpu_util']:.0f} %",
                ]
            )
            + " |"
        )
    return "\n".join(lines)
