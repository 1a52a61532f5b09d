"""Per-request measurements and their summary.

Conventions (those of ``vllm bench serve``, so numbers compare):
  * TTFT: request start -> first event carrying output (streamed requests
    only: a non-streamed answer shows when the last token was made, not the
    first; the ZeroMQ client always streams).
  * ITL: gaps between successive output-carrying events (an event may hold
    several tokens when the server coalesces them).
  * TPOT: (E2E - TTFT) / (output_tokens - 1), for requests with > 1 token.
  * E2E: request start -> last byte.
Times are seconds on ``time.perf_counter`` relative to the run's start, and
milliseconds in summaries.

Outcome of every sent request is exactly one of: ok (HTTP 200 and a clean
end), an HTTP error status (429, 503, 400, ... -- a refusal, counted by
status), ``status=0`` (transport error or an error event inside a 200
stream), or ``status=-1`` (still running when the time limit hit; cancelled).
So ``sent == ok + sum(http_errors) + errors + incomplete`` always.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .spec import Slo, Workload

OK = 200
TRANSPORT_ERROR = 0
INCOMPLETE = -1
PERCENTILES = (50, 90, 99)


class Record(msgspec.Struct, kw_only=True):
    cls: str
    scheduled: float = 0.0  # intended send time (open loop); == start when closed
    start: float = 0.0
    end: float = 0.0
    status: int = INCOMPLETE
    ttft: float | None = None  # seconds
    itl: list[float] = []  # seconds
    events: int = 0  # output-carrying events received
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    retry_after: float | None = None
    last_output: float = 0.0  # clock time of the latest output-carrying event

    def output_event(self, t: float) -> None:
        """An output-carrying event arrived at clock time ``t``: the first sets
        TTFT, each later one adds an inter-token gap."""
        if self.ttft is None:
            self.ttft = t - self.start
        else:
            self.itl.append(t - self.last_output)
        self.last_output = t
        self.events += 1

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _pct(xs: list[float]) -> dict | None:
    if not xs:
        return None
    a = np.asarray(xs, dtype=np.float64) * 1000.0
    out = {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES))}
    out["mean"] = float(a.mean())
    out["min"] = float(a.min())
    out["max"] = float(a.max())
    return out


def meets(r: Record, slo: Slo) -> bool:
    if r.status != OK:
        return False
    # Not streamed: TTFT is unobservable, and E2E is an upper bound of it.
    ttft = r.ttft if r.ttft is not None else r.e2e
    if slo.ttft_ms is not None and ttft * 1000 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > slo.tpot_ms:
        return False
    if slo.e2e_ms is not None and r.e2e * 1000 > slo.e2e_ms:
        return False
    return True


def summarise(records: list[Record], slo: Slo | None, elapsed_s: float, issue_s: float) -> dict:
    """Summary of one group of records (one class, or all of them).

    ``elapsed_s``: first send to last completion of the whole run (the
    throughput denominator, shared by all groups so classes add up);
    ``issue_s``: how long requests were being sent (offered load)."""
    ok = [r for r in records if r.status == OK]
    by_status: dict[str, int] = {}
    for r in records:
        if r.status > 0 and r.status != OK:
            by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    errors = sum(1 for r in records if r.status == TRANSPORT_ERROR)
    incomplete = sum(1 for r in records if r.status == INCOMPLETE)
    out_tokens = sum(r.output_tokens for r in ok)
    el = max(elapsed_s, 1e-9)
    s = {
        "sent": len(records),
        "ok": len(ok),
        "http_errors": dict(sorted(by_status.items())),
        "rate_limited_429": by_status.get("429", 0),
        "unavailable_503": by_status.get("503", 0),
        "errors": errors,
        "incomplete": incomplete,
        "offered_rps": len(records) / issue_s if issue_s > 0 else None,
        "throughput_rps": len(ok) / el,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / el,
        "prompt_tokens_mean": (sum(r.prompt_tokens for r in ok) / len(ok)) if ok else None,
        "output_tokens_mean": (out_tokens / len(ok)) if ok else None,
        "ttft_ms": _pct([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _pct([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _pct([g for r in ok for g in r.itl]),
        "e2e_ms": _pct([r.e2e for r in ok]),
        "dispatch_lag_ms": _pct([r.start - r.scheduled for r in records]),
    }
    if slo is not None and any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms)):
        good = sum(1 for r in records if meets(r, slo))
        s["slo"] = msgspec.to_builtins(slo)
        s["goodput_rps"] = good / el
        s["goodput_fraction"] = good / len(records) if records else None
    ra = sorted(r.retry_after for r in records if r.retry_after is not None)
    if ra:  # what refusals told clients to wait (429/503 Retry-After)
        s["retry_after_s"] = {"min": ra[0], "p50": ra[len(ra) // 2], "max": ra[-1], "count": len(ra)}
    sample_err = next((r.error for r in records if r.error), None)
    if sample_err:
        s["first_error"] = sample_err[:300]
    return s


def summarise_run(records: list[Record], workload: Workload, issue_s: float, elapsed_s: float | None = None) -> dict:
    """Overall and per-class summaries; throughput is over the run's span.

    Records merged from several runs (times relative to each run's start)
    need the runs' summed ``elapsed_s`` and ``issue_s`` passed in."""
    if elapsed_s is not None:
        elapsed = elapsed_s
    elif records:
        elapsed = max(r.end or r.start for r in records) - min(r.start for r in records)
    else:
        elapsed = 0.0
    classes = {}
    for c in workload.classes:
        rs = [r for r in records if r.cls == c.name]
        if rs:
            classes[c.name] = summarise(rs, workload.class_slo(c), elapsed, issue_s)
    # Overall goodput judges each request by its own class's SLO.
    overall = summarise(records, None, elapsed, issue_s)
    slos = {c.name: workload.class_slo(c) for c in workload.classes}
    if any(any(v is not None for v in (s.ttft_ms, s.tpot_ms, s.e2e_ms)) for s in slos.values()):
        good = sum(1 for r in records if meets(r, slos[r.cls]))
        overall["goodput_rps"] = good / max(elapsed, 1e-9)
        overall["goodput_fraction"] = good / len(records) if records else None
    return {"elapsed_s": elapsed, "issue_s": issue_s, "overall": overall, "classes": classes}
