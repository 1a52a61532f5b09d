"""``weir stats``: one live terminal view of the whole stack (rich), or one
JSON snapshot (``--json``) for scripts.

Everything comes from what the stack already serves -- Envoy's admin
``/stats?format=json``; each router's ``/admin/workers``, ``/admin/queues``,
``/admin/tenants``, ``/admin/models``, ``/health``, ``/health/ready`` and
``/metrics`` -- read every ``--interval`` seconds (1 s); rates are the
difference of two readings over the time between them, so ``--json`` reads
twice, ``--interval`` apart.  Nothing here is on a request's path: it costs
the router seven HTTP answers a second.

A worker that a router had registered (or that the config names) and that
is no longer registered shows as ``lost``.  A stack that does not answer at
all is a one-line message and exit status 1, not a traceback.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from deploy.envoy_config import RATE_LIMIT_STAT_PREFIX, ROUTER_CLUSTER
from deploy.stack import _http_url
from shared.config import Config
from shared.keys import admin_headers

if TYPE_CHECKING:
    from rich.console import Group, RenderableType

FETCH_TIMEOUT_S = 1.0
HCM_PREFIX = "http.ingress_http."  # deploy/envoy_config.py: the listener's stat_prefix
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


class Unreachable(Exception):
    pass


def _fetch(url: str, headers: dict[str, str] | None = None) -> bytes:
    try:
        with _opener.open(urllib.request.Request(url, headers=headers or {}), timeout=FETCH_TIMEOUT_S) as r:
            body: bytes = r.read()
            return body
    except urllib.error.HTTPError as e:  # 503 from /health/ready still has a body
        return e.read()
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"{url}: {reason}") from None


def _json(url: str, headers: dict[str, str] | None = None) -> Any:
    try:
        return json.loads(_fetch(url, headers))
    except json.JSONDecodeError as e:
        raise Unreachable(f"{url}: not JSON ({e})") from None


# ---------------------------------------------------------------- one reading


def read_envoy(admin_url: str) -> dict[str, Any]:
    """Envoy's counters and gauges by name."""
    data = _json(admin_url + "/stats?format=json")
    return {s["name"]: s["value"] for s in data.get("stats", []) if "value" in s}


def read_router(url: str, admin: dict[str, str] | None = None) -> dict[str, Any]:
    """``admin``: the headers /admin/* needs (shared.keys.admin_headers)."""
    metrics: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(_fetch(url + "/metrics").decode()):
        for s in fam.samples:
            metrics.setdefault(s.name, []).append((s.labels, s.value))
    return {
        "workers": _json(url + "/admin/workers", admin),
        "queues": _json(url + "/admin/queues", admin),
        "tenants": _json(url + "/admin/tenants", admin),
        "ready": _json(url + "/health/ready"),
        "health": _json(url + "/health"),
        "models": _json(url + "/admin/models", admin),
        "metrics": metrics,
    }


def read(envoy_admin: str, routers: list[str], admin: dict[str, str] | None = None) -> dict[str, Any]:
    """One raw reading of everything; what did not answer says why."""
    out: dict[str, Any] = {"t": time.monotonic(), "envoy": None, "envoy_error": None, "routers": {}}
    try:
        out["envoy"] = read_envoy(envoy_admin)
    except Unreachable as e:
        out["envoy_error"] = str(e)
    for url in routers:
        try:
            out["routers"][url] = read_router(url, admin)
        except Unreachable as e:
            out["routers"][url] = {"error": str(e)}
    return out


# ---------------------------------------------------------------- derived view


def _rate(now: float, before: float | None, dt: float) -> float | None:
    if before is None or dt <= 0:
        return None
    return max(0.0, now - before) / dt


def _sum(metrics: dict[str, Any], name: str, **match: str) -> float:
    total: float = sum(v for labels, v in metrics.get(name, []) if all(labels.get(k) == x for k, x in match.items()))
    return total


def _by(metrics: dict[str, Any], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in metrics.get(name, []):
        out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + v
    return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (le, count) buckets."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le  # beyond the last finite bound: its value
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def _wait_buckets(metrics: dict[str, Any], klass: str) -> list[tuple[float, float]]:
    """A class's queue-wait histogram, summed over its ``pool`` label (the
    pool of the worker it went to, not the queue's short/long)."""
    out: dict[float, float] = {}
    for labels, v in metrics.get("weir_queue_wait_seconds_bucket", []):
        if labels.get("klass") == klass:
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + v
    return sorted(out.items())


PHASES = ("tokenize", "queue", "prefill", "decode")  # router.observe.phase_metrics


def _phases(m: dict[str, Any], pm: dict[str, Any] | None) -> dict[str, dict[str, float | None]]:
    """Each model's phase split: the p50 of each phase of its finished requests
    (``weir_request_phase_seconds``), over the last interval when any finished in it."""
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    before: dict[tuple[str, str], dict[float, float]] = {}
    for src, out in ((m, buckets), (pm or {}, before)):
        for labels, v in src.get("weir_request_phase_seconds_bucket", []):
            out.setdefault((labels.get("model", ""), labels.get("phase", "")), {})[float(labels["le"])] = v
    split: dict[str, dict[str, float | None]] = {}
    for (model, phase), b in sorted(buckets.items()):
        now = sorted(b.items())
        window = _window(now, sorted(before.get((model, phase), {}).items())) if pm is not None else []
        use = window if window and window[-1][1] > 0 else now
        split.setdefault(model, {})[f"{phase}_p50_s"] = quantile(0.5, use)
    return split


def _window(now: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    prev = dict(before)
    return [(le, n - prev.get(le, 0.0)) for le, n in now]


def _envoy_view(
    cur: dict[str, Any] | None, prev: dict[str, Any] | None, dt: float, error: str | None
) -> dict[str, Any]:
    if cur is None:
        return {"reachable": False, "error": error}
    p = prev or {}

    def counter(name: str) -> dict[str, Any]:
        v = cur.get(name, 0)
        return {"total": v, "per_s": _rate(v, p.get(name), dt) if prev else None}

    statuses = {c: counter(f"{HCM_PREFIX}downstream_rq_{c}") for c in ("2xx", "3xx", "4xx", "5xx")}
    local = counter(f"{RATE_LIMIT_STAT_PREFIX}.http_local_rate_limit.rate_limited")
    upstream_429 = counter(f"cluster.{ROUTER_CLUSTER}.upstream_rq_429")
    per_s = None
    if local["per_s"] is not None and upstream_429["per_s"] is not None:
        per_s = local["per_s"] + upstream_429["per_s"]
    return {
        "reachable": True,
        "requests": counter(f"{HCM_PREFIX}downstream_rq_total"),
        "active_requests": cur.get(f"{HCM_PREFIX}downstream_rq_active", 0),
        "by_status": statuses,
        "rate_limited_429": {
            "envoy": local,
            "router": upstream_429,
            "total": local["total"] + upstream_429["total"],
            "per_s": per_s,
        },
        "upstream": {
            "healthy": cur.get(f"cluster.{ROUTER_CLUSTER}.membership_healthy", 0),
            "total": cur.get(f"cluster.{ROUTER_CLUSTER}.membership_total", 0),
            "health_check_failures": cur.get(f"cluster.{ROUTER_CLUSTER}.health_check.failure", 0),
        },
    }


def _router_view(url: str, cur: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> dict[str, Any]:
    if "error" in cur:
        return {"url": url, "reachable": False, "error": cur["error"]}
    m = cur["metrics"]
    pm = prev["metrics"] if prev and "metrics" in prev else None
    queues = []
    for q in cur["queues"]:
        buckets = _wait_buckets(m, q["class"])
        window = _window(buckets, _wait_buckets(pm, q["class"])) if pm is not None else []
        queues.append(
            {
                "class": q["class"],
                "pool": q["pool"],
                "queued": q["queued"],
                "by_model": q.get("by_model", {}),
                "oldest_wait_s": q["oldest_wait_s"],
                "wait_p50_s": quantile(0.5, buckets),
                "wait_p99_s": quantile(0.99, buckets),
                "window_wait_p50_s": quantile(0.5, window),
                "window_wait_p99_s": quantile(0.99, window),
            }
        )
    refusals = _by(m, "weir_rejected_total", "reason")
    prev_refusals = _by(pm, "weir_rejected_total", "reason") if pm is not None else {}
    finished = _sum(m, "weir_requests_total")
    decisions = _by(m, "weir_policy_decisions_total", "decision")
    return {
        "url": url,
        "reachable": True,
        "ready": cur["ready"].get("status") == "ready",
        "uptime_s": cur["health"].get("uptime_s"),
        "jobs": cur["health"].get("jobs"),
        "ready_workers": cur["ready"].get("models", {}),
        "models": [
            {"name": x["name"], "state": x["state"], "ready_workers": x["ready_workers"], "runtime": x["runtime"]}
            for x in cur["models"]
        ],
        "queues": queues,
        "admissions": {
            "dispatched": decisions.get("dispatched", 0),
            "requeued": decisions.get("requeued", 0),
            "finished": finished,
            "finished_per_s": _rate(finished, _sum(pm, "weir_requests_total"), dt) if pm else None,
        },
        "phases": _phases(m, pm),
        "outcomes": _by(m, "weir_requests_total", "outcome"),
        "refusals": {
            r: {"total": n, "per_s": _rate(n, prev_refusals.get(r, 0.0), dt) if pm else None}
            for r, n in sorted(refusals.items())
        },
        "tokens_per_s": _rate(_sum(m, "weir_output_tokens_total"), _sum(pm, "weir_output_tokens_total"), dt)
        if pm
        else None,
    }


def _workers_view(
    url: str, cur: dict[str, Any], prev: dict[str, Any] | None, dt: float, expected: set[str]
) -> list[dict[str, Any]]:
    if "error" in cur:
        return []
    before = {w["id"]: w for w in prev.get("workers", [])} if prev and "workers" in prev else {}
    out = []
    seen = set()
    for w in cur["workers"]:
        seen.add(w["id"])
        b = before.get(w["id"])
        tps = None
        if b is not None and "tokens_total" in w and "tokens_total" in b:
            tps = _rate(w["tokens_total"], b["tokens_total"], dt)
        out.append(
            {
                "router": url,
                "id": w["id"],
                "model": w["model"],
                "pool": w["pool"],
                "engine": w.get("engine"),
                "state": w.get("state", "ready"),
                "healthy": w.get("healthy"),
                "drain_left_s": w.get("drain_left_s"),
                "kv_reserved_tokens": w["reserved_tokens"],
                "kv_capacity_tokens": w["capacity_tokens"],
                "kv_budget_tokens": w.get("budget_tokens"),
                "kv_usage": w.get("kv_usage"),
                "running": w["running"],
                "engine_running": w.get("engine_running"),
                "engine_waiting": w.get("engine_waiting"),
                "max_num_seqs": w.get("max_num_seqs"),
                "tokens_total": w.get("tokens_total"),
                "tokens_per_s": tps,
                "gpu": {
                    "present": w.get("gpu_present", False),
                    "name": w.get("gpu"),
                    "utilization_percent": w.get("gpu_utilization_percent"),
                    "memory_used_bytes": w.get("gpu_memory_used_bytes"),
                    "memory_total_bytes": w.get("gpu_memory_total_bytes"),
                    "temperature_celsius": w.get("gpu_temperature_celsius"),
                    "power_watts": w.get("gpu_power_watts"),
                    "block": w.get("gpu_block"),
                },
            }
        )
    for wid in sorted((expected | set(before)) - seen):
        b = before.get(wid, {})
        out.append({"router": url, "id": wid, "model": b.get("model"), "pool": b.get("pool"), "state": "lost"})
    return out


def _tenants_view(cur: dict[str, Any]) -> list[dict[str, Any]]:
    if "error" in cur:
        return []
    out = []
    for name, t in sorted(cur["tenants"].get("tenants", {}).items()):
        usage = t.get("usage", {})
        out.append(
            {
                "tenant": name,
                "requests": usage.get("requests", 0),
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0),
                "budgets": t.get("budgets", {}),
                "refusals": t.get("refusals", {}),
            }
        )
    for kid, budgets in sorted(cur["tenants"].get("keys", {}).items()):  # a key's own budgets (by its id)
        out.append(
            {
                "tenant": f"key {kid}",
                "requests": None,
                "prompt_tokens": None,
                "completion_tokens": None,
                "budgets": budgets,
                "refusals": {},
            }
        )
    return out


def _batches_view(url: str, cur: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> list[dict[str, Any]]:
    """One row per batch this router runs (router/services/batch: weir_batch_* gauges)."""
    if "error" in cur:
        return []
    metrics = cur["metrics"]
    before = prev.get("metrics", {}) if prev and "error" not in prev else {}
    rows: dict[str, dict[str, Any]] = {}
    for labels, v in metrics.get("weir_batch_lines", []):
        rows.setdefault(labels["batch"], {"router": url, "batch": labels["batch"]})[labels["state"]] = int(v)
    for bid, row in rows.items():
        done_before = _sum(before, "weir_batch_lines", batch=bid, state="done") if before else None
        row["lines_per_s"] = _rate(row.get("done", 0), done_before, dt) if before else None
        eta = [v for labels, v in metrics.get("weir_batch_eta_seconds", []) if labels.get("batch") == bid]
        left = [v for labels, v in metrics.get("weir_batch_window_left_seconds", []) if labels.get("batch") == bid]
        row["eta_s"] = eta[0] if eta else None
        row["window_left_s"] = left[0] if left else None
    return [rows[b] for b in sorted(rows)]


def view(cur: dict[str, Any], prev: dict[str, Any] | None, expected_workers: dict[str, set[str]]) -> dict[str, Any]:
    """The snapshot ``--json`` prints and the live view draws.  ``expected_workers``:
    per router, the ids it should have (shown as lost where it does not)."""
    dt = cur["t"] - prev["t"] if prev else 0.0
    routers, workers, tenants, batches = [], [], [], []
    for url, r in cur["routers"].items():
        pr = prev["routers"].get(url) if prev else None
        routers.append(_router_view(url, r, pr, dt))
        batches += _batches_view(url, r, pr, dt)
        workers += _workers_view(url, r, pr, dt, expected_workers.get(url, set()))
        for t in _tenants_view(r):
            tenants.append({"router": url, **t})
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "interval_s": round(dt, 3),
        "envoy": _envoy_view(cur["envoy"], prev["envoy"] if prev else None, dt, cur["envoy_error"]),
        "routers": routers,
        "workers": workers,
        "tenants": tenants,
        "batches": batches,
    }


def stack_down(snap: dict[str, Any]) -> str | None:
    """Why the stack is not running (nothing answers), or None."""
    if snap["envoy"]["reachable"] or any(r["reachable"] for r in snap["routers"]):
        return None
    errors = [snap["envoy"].get("error")] + [r.get("error") for r in snap["routers"]]
    return "; ".join(e for e in errors if e)


# ---------------------------------------------------------------- the terminal


def _n(v: object, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / (1 << 30):.1f}"


def render(snap: dict[str, Any], title: str) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[RenderableType] = [
        Text(f"weir stats  {title}  {snap['time']}  (every {snap['interval_s']:.1f} s; Ctrl-C quits)", style="bold")
    ]
    e = snap["envoy"]
    t = Table(title="Envoy", title_justify="left", expand=True)
    if not e["reachable"]:
        parts.append(Text(f"Envoy unreachable: {e['error']}", style="bold red"))
    else:
        for col in ("req/s", "2xx/s", "4xx/s", "5xx/s", "429/s", "429 total", "active", "routers healthy"):
            t.add_column(col, justify="right")
        s = e["by_status"]
        up = e["upstream"]
        t.add_row(
            _n(e["requests"]["per_s"]),
            *(_n(s[c]["per_s"]) for c in ("2xx", "4xx", "5xx")),
            _n(e["rate_limited_429"]["per_s"]),
            str(int(e["rate_limited_429"]["total"])),
            str(int(e["active_requests"])),
            Text(
                f"{int(up['healthy'])}/{int(up['total'])}",
                style="green" if up["total"] and up["healthy"] == up["total"] else "red",
            ),
        )
        parts.append(t)
    for r in snap["routers"]:
        if not r["reachable"]:
            parts.append(Text(f"router {r['url']} unreachable: {r['error']}", style="bold red"))
            continue
        head = Text(f"router {r['url']}  ", style="bold")
        head.append("ready" if r["ready"] else "NOT READY", style="green" if r["ready"] else "bold red")
        head.append(
            f"  jobs {r['jobs']}  finished/s {_n(r['admissions']['finished_per_s'])}"
            f"  dispatched {int(r['admissions']['dispatched'])}  tokens/s {_n(r['tokens_per_s'], '{:.0f}')}"
        )
        parts.append(head)
        parts.append(
            Text("models: " + ", ".join(f"{x['name']} {x['state']} ({x['ready_workers']} ready)" for x in r["models"]))
        )
        if r.get("phases"):  # where finished requests' time went, per model (p50s)
            ph = Table(title="phases (p50 of finished requests)", title_justify="left", expand=True)
            for col in ("model", *PHASES):
                ph.add_column(col, justify="left" if col == "model" else "right")
            for model, x in r["phases"].items():
                ph.add_row(model, *(_ms(x.get(f"{p}_p50_s")) for p in PHASES))
            parts.append(ph)
        q = Table(title="queues", title_justify="left", expand=True)
        for col in ("class", "pool", "queued", "by model", "oldest wait", "wait p50", "wait p99"):
            q.add_column(col, justify="right" if col not in ("class", "pool", "by model") else "left")
        for x in r["queues"]:
            if x["queued"] or x["wait_p50_s"] is not None:
                p50 = x["window_wait_p50_s"] if x["window_wait_p50_s"] is not None else x["wait_p50_s"]
                p99 = x["window_wait_p99_s"] if x["window_wait_p99_s"] is not None else x["wait_p99_s"]
                q.add_row(
                    x["class"],
                    x["pool"],
                    str(x["queued"]),
                    ", ".join(f"{m}: {n}" for m, n in x["by_model"].items()) or "-",
                    _ms(x["oldest_wait_s"]),
                    _ms(p50),
                    _ms(p99),
                )
        parts.append(q)
        if r["refusals"]:
            parts.append(
                Text(
                    "refusals: "
                    + ", ".join(
                        f"{reason} {int(v['total'])} ({_n(v['per_s'])}/s)" for reason, v in r["refusals"].items()
                    ),
                    style="yellow",
                )
            )
    w = Table(title="workers", title_justify="left", expand=True)
    for col in (
        "worker",
        "model",
        "pool",
        "state",
        "KV reserved/capacity",
        "running",
        "engine run/wait",
        "tokens/s",
        "GPU util",
        "GPU mem GiB",
        "GPU °C",
        "GPU W",
    ):
        w.add_column(col, justify="left" if col in ("worker", "model", "pool", "state") else "right")
    for x in snap["workers"]:
        style = {"ready": "green", "draining": "yellow", "lost": "bold red"}.get(x["state"], "")
        if x["state"] == "lost":
            w.add_row(x["id"], x.get("model") or "-", x.get("pool") or "-", Text("lost", style=style), *["-"] * 8)
            continue
        g = x["gpu"]
        state = x["state"] + (f" ({g['block']})" if g.get("block") else "")
        if g["present"]:
            gpu = [
                _n(g["utilization_percent"], "{:.0f}%"),
                f"{_gib(g['memory_used_bytes'])}/{_gib(g['memory_total_bytes'])}",
                _n(g["temperature_celsius"], "{:.0f}"),
                _n(g["power_watts"], "{:.0f}"),
            ]
        else:
            gpu = ["no GPU", "-", "-", "-"]
        w.add_row(
            x["id"],
            x["model"],
            x["pool"],
            Text(state, style=style),
            f"{x['kv_reserved_tokens']}/{x['kv_capacity_tokens']}",
            f"{x['running']}/{x['max_num_seqs']}",
            f"{_n(x['engine_running'], '{}')}/{_n(x['engine_waiting'], '{}')}",
            _n(x["tokens_per_s"], "{:.0f}"),
            *gpu,
        )
    parts.append(w)
    if snap["tenants"]:
        tt = Table(title="tenants", title_justify="left", expand=True)
        for col in (
            "tenant",
            "requests",
            "prompt tokens",
            "completion tokens",
            "budgets (remaining/limit)",
            "refusals",
        ):
            tt.add_column(
                col, justify="left" if col in ("tenant", "budgets (remaining/limit)", "refusals") else "right"
            )
        for x in snap["tenants"]:
            budgets = ", ".join(f"{f} {b.get('remaining', '?')}/{b['limit']}" for f, b in x["budgets"].items())
            refusals = ", ".join(f"{k} {v}" for k, v in x["refusals"].items())
            tt.add_row(
                x["tenant"],
                _n(x["requests"], "{}"),
                _n(x["prompt_tokens"], "{}"),
                _n(x["completion_tokens"], "{}"),
                budgets or "unlimited",
                refusals or "-",
            )
        parts.append(tt)
    if snap.get("batches"):
        bt = Table(title="batches", title_justify="left", expand=True)
        for col in ("batch", "done", "running", "queued", "pending", "lines/s", "ETA", "window left"):
            bt.add_column(col, justify="left" if col == "batch" else "right")
        for x in snap["batches"]:
            bt.add_row(
                x["batch"],
                _n(x.get("done"), "{}"),
                _n(x.get("running"), "{}"),
                _n(x.get("queued"), "{}"),
                _n(x.get("pending"), "{}"),
                _n(x["lines_per_s"], "{:.1f}"),
                _n(x["eta_s"], "{:.0f} s"),
                _n(x["window_left_s"], "{:.0f} s"),
            )
        parts.append(bt)
    return Group(*parts)


# ---------------------------------------------------------------- the command


def targets(cfg: Config, routers: list[str] | None, envoy_admin: str | None) -> tuple[str, list[str]]:
    return (envoy_admin or _http_url(cfg.envoy.admin)).rstrip("/"), [
        u.rstrip("/") for u in (routers or [_http_url(cfg.router.http)])
    ]


def _registered(expected: dict[str, set[str]], reading: dict[str, Any]) -> None:
    """Once a router has had a worker, its leaving shows as lost -- at that
    router only (with several, each may have only some of the workers)."""
    for url, r in reading["routers"].items():
        expected.setdefault(url, set()).update(w["id"] for w in r.get("workers", []))


def run(
    cfg: Config,
    *,
    routers: list[str] | None = None,
    envoy_admin: str | None = None,
    as_json: bool = False,
    interval: float = 1.0,
    count: int | None = None,
) -> int:
    admin, urls = targets(cfg, routers, envoy_admin)
    token = admin_headers(cfg)
    # the config's one router should have its workers; routers named on the
    # command line only those they have been seen with
    expected = {urls[0]: {w.id for w in cfg.workers}} if routers is None else {}
    prev = read(admin, urls, token)
    first = view(prev, None, expected)
    _registered(expected, prev)
    why = stack_down(first)
    if why is not None:
        print(
            f"weir stats: the stack is not running (nothing answers: {why}). Start it with `weir up`.", file=sys.stderr
        )
        return 1
    if as_json:
        time.sleep(interval)
        cur = read(admin, urls, token)
        json.dump(view(cur, prev, expected), sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console
    from rich.live import Live

    title = ", ".join(urls)
    console = Console()
    shown = 0
    try:
        with Live(render(first, title), console=console, screen=True, auto_refresh=False) as live:
            while count is None or shown < count:
                time.sleep(interval)
                cur = read(admin, urls, token)
                live.update(render(view(cur, prev, expected), title), refresh=True)
                _registered(expected, cur)
                prev = cur
                shown += 1
    except KeyboardInterrupt:
        pass
    return 0
