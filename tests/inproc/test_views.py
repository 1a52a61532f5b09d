"""The operators' views (router/observe/views.py), actions (router/observe/operator_actions.py)
and their HTTP routes (router/ingress/routes.py), over the real lifecycle and a
fake worker link: no sockets, no processes."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Iterator

import msgspec
import pytest
from fakes import registration
from prometheus_client.parser import text_string_to_metric_families

from router.ingress.routes import ErrorReply, Reply, Routes, routes
from router.lifecycle.core import RouterCore
from router.lifecycle.reads import RouterCoreReads
from router.observe import exposition
from router.observe.metrics import RouterMetrics
from router.observe.operator_actions import RouterOperator
from router.observe.views import RouterViews
from router.observe.worker_report import WorkerReport
from shared import protocol as p
from shared.config import Config


class FakeLink:
    """The worker link as the views and the operator see it (and the lifecycle's WorkerPort)."""

    def __init__(self) -> None:
        self.models: dict[str, str] = {}  # worker id -> model
        self.drain_left: dict[str, float] = {}  # draining workers -> seconds left
        self.stats: dict[str, p.WorkerStats] = {}  # a worker's last heartbeat (default: one running)

    def dispatch(self, worker_id: str, req: p.GenerateRequest) -> bool:
        return worker_id in self.models

    def abort(self, worker_id: str, job_id: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def worker_count(self) -> int:
        return len(self.models)

    def worker_ids(self) -> set[str]:
        return set(self.models)

    def workers_of(self, model: str) -> list[str]:
        return [w for w, m in self.models.items() if m == model]

    def report(self, worker_id: str) -> WorkerReport | None:
        model = self.models.get(worker_id)
        if model is None:
            return None
        return WorkerReport(
            worker_id,
            model,
            "sim",
            p.GpuInfo(),
            self.stats.get(worker_id, p.WorkerStats(running=1)),
            self.drain_left.get(worker_id),
        )

    def reports(self) -> list[WorkerReport]:
        return [r for w in self.models if (r := self.report(w)) is not None]

    def drain(self, worker_id: str) -> bool:
        if worker_id not in self.models:
            return False
        self.drain_left.setdefault(worker_id, 30.0)
        return True

    def undrain(self, worker_id: str) -> bool:
        self.drain_left.pop(worker_id, None)
        return worker_id in self.models


class Req(msgspec.Struct):
    method: bytes
    path: bytes
    body: bytes = b""

    def header(self, name: bytes) -> str | None:
        return None


def _config() -> Config:
    return msgspec.convert({"models": [{"name": "sim-m", "engine": "sim", "max_model_len": 4096}]}, Config)


class Router:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.link = FakeLink()
        self.metrics = RouterMetrics()
        self.core = RouterCore(_config(), self.loop, self.link, metrics=self.metrics)
        self.views = RouterViews(RouterCoreReads(self.core), self.link, self.metrics)
        self.reloads = 0
        self.operator = RouterOperator(self.core, self.link, self._reload)
        self.routes: Routes = routes(self.views, self.operator, created=7)

    def _reload(self) -> dict:
        self.reloads += 1
        return {"ok": True}

    def join(self, worker_id: str, model: str = "sim-m") -> None:
        self.link.models[worker_id] = model
        self.core.worker_joined(registration(worker_id, model))

    def call(self, method: str, path: str, body: object = None) -> tuple[int, object]:
        req = Req(method.encode(), path.encode(), b"" if body is None else json.dumps(body).encode())
        route = self.routes.exact.get(req.path)
        if route is not None:
            assert route.method in (req.method, b"*")
            answer = route.handler(req)
        else:
            pattern = next(r for r in self.routes.patterns if r.matches(req.path, req.method))
            answer = pattern.handler(req)
        if inspect.isawaitable(answer):  # /metrics: rendered over loop turns (router.observe.exposition)
            answer = self.loop.run_until_complete(answer)
        if isinstance(answer, ErrorReply):
            return answer.info.status, answer.info.code
        assert isinstance(answer, Reply)
        return answer.status, json.loads(answer.body) if answer.content_type == b"application/json" else answer.body


@pytest.fixture
def router() -> Iterator[Router]:
    r = Router()
    yield r
    r.core.close()
    r.loop.close()


def test_one_model_renders_as_in_the_list(router):
    router.join("w0")
    _, listed = router.call("GET", "/v1/models")
    status, one = router.call("GET", "/v1/models/sim-m")
    assert status == 200 and listed["data"] == [one]
    assert one == {
        "id": "sim-m",
        "object": "model",
        "created": 7,
        "owned_by": "weir",
        "root": "sim-m",
        "parent": None,
        "max_model_len": 4096,
        "ready_workers": 1,
        "state": "ready",
    }
    assert router.call("GET", "/v1/models/nope") == (404, "model_not_found")


def test_drain_shows_in_every_view_and_readiness(router):
    router.join("w0")
    assert router.call("GET", "/health/ready")[0] == 200
    assert router.call("POST", "/admin/workers/w0/drain") == (200, {"worker": "w0", "draining": True})
    assert router.call("GET", "/admin/workers/w0/drain") == (405, "method_not_allowed")
    assert router.call("POST", "/admin/workers/nope/drain") == (404, "not_found")
    _, one = router.call("GET", "/admin/workers/w0")
    assert one == {"id": "w0", "model": "sim-m", "state": "draining", "running": 0, "drain_left_s": 30.0}
    _, rows = router.call("GET", "/admin/workers")
    assert rows[0]["state"] == "draining" and rows[0]["engine_running"] == 1 and rows[0]["gpu_present"] is False
    assert router.call("GET", "/health/ready")[0] == 503
    router.call("POST", "/admin/workers/w0/undrain")
    assert router.call("GET", "/admin/workers/w0")[1]["state"] == "ready"
    assert router.call("GET", "/admin/workers/nope") == (404, "not_found")


def test_models_added_and_removed_at_run_time(router):
    router.join("w0")
    extra = {"model": {"name": "sim-extra", "engine": "sim"}, "workers": [{"id": "sim-extra-0", "model": "sim-extra"}]}
    status, body = router.call("POST", "/admin/models", extra)
    assert (status, body["state"]) == (200, "loading")
    assert router.call("POST", "/admin/models", extra)[0] == 400  # already there
    clash = {"model": {"name": "other", "engine": "sim"}, "workers": [{"id": "w0", "model": "other"}]}
    assert router.call("POST", "/admin/models", clash)[0] == 400  # a linked worker's id
    assert router.call("POST", "/admin/models", {"model": {"name": "x"}, "bogus": 1})[0] == 400
    assert router.call("PUT", "/admin/models") == (405, "method_not_allowed")
    _, models = router.call("GET", "/admin/models")
    by_name = {m["name"]: m for m in models}
    assert by_name["sim-m"]["runtime"] is False and by_name["sim-extra"]["runtime"] is True
    assert [w["id"] for w in by_name["sim-extra"]["workers"]] == ["sim-extra-0"]
    router.join("sim-extra-0", "sim-extra")
    assert router.call("POST", "/admin/models/sim-extra/remove") == (
        200,
        {"ok": True, "model": "sim-extra", "state": "unloading"},
    )
    assert router.link.drain_left == {"sim-extra-0": 30.0}  # its workers drain
    falls_back = {"model": {"name": "sim-b", "engine": "sim", "fallbacks": ["sim-extra"]}}
    assert router.call("POST", "/admin/models", falls_back)[0] == 409  # to a model unloading
    assert router.call("POST", "/admin/models/nope/remove")[0] == 404
    assert router.call("GET", "/admin/models/sim-extra/remove") == (405, "method_not_allowed")


def test_health_queues_tenants_metrics_and_reload(router):
    router.join("w0")
    assert router.call("GET", "/health")[1] == {
        "status": "ok",
        "workers": 1,
        "uptime_s": pytest.approx(0, abs=5),
        "jobs": 0,
    }
    assert all(q["queued"] == 0 for q in router.call("GET", "/admin/queues")[1])
    assert isinstance(router.call("GET", "/admin/tenants")[1], dict)
    assert b'weir_model_ready_workers{model="sim-m"} 1.0' in router.call("GET", "/metrics")[1]
    assert router.call("POST", "/admin/reload") == (200, {"ok": True}) and router.reloads == 1


def test_without_an_operator_nothing_changes_state(router):
    read_only = routes(router.views, None, created=7)
    changing = {b"/admin/reload", b"/admin/drain", b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter"}
    assert set(read_only.exact) == set(router.routes.exact) - changing
    assert read_only.exact[b"/admin/models"].method == b"GET"
    assert read_only.exact[b"/admin/adapters"].method == b"GET"
    assert not any(r.matches(b"/admin/models/m/remove", b"POST") for r in read_only.patterns)
    assert not any(r.matches(b"/admin/adapters/a/remove", b"POST") for r in read_only.patterns)


def _samples(page: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page by (name, sorted labels), as Prometheus would read it."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(page.decode())
        for s in fam.samples
    }


def _scrape(router: Router) -> tuple[bytes, int]:
    """GET /metrics as the HTTP server answers it, and the loop turns other callbacks got meanwhile."""
    turns, done = 0, False

    def other_work() -> None:  # another stream's callback: ready at every turn of the loop
        nonlocal turns
        if not done:
            turns += 1
            router.loop.call_soon(other_work)

    async def scrape() -> bytes:
        nonlocal done
        answer = router.routes.exact[b"/metrics"].handler(Req(b"GET", b"/metrics"))
        assert inspect.isawaitable(answer)  # answered later: the server serves others meanwhile
        router.loop.call_soon(other_work)
        reply = await answer
        done = True
        assert isinstance(reply, Reply) and reply.status == 200
        return reply.body

    return router.loop.run_until_complete(scrape()), turns


def test_a_scrape_of_a_large_fleet_lets_the_loop_serve_others_and_shows_every_worker(router, monkeypatch):
    # Slices of no time: the loop gets a turn at every look at the clock, however fast this machine is.
    monkeypatch.setattr(exposition, "SLICE_S", 0.0)
    n = 200
    for i in range(n):
        router.join(f"w{i:03}")
        router.link.stats[f"w{i:03}"] = p.WorkerStats(running=i % 5, waiting=i % 3, kv_usage=i / 1000)
        router.metrics.child(router.metrics.worker_events, f"w{i:03}", "registered").inc()  # as the link counts
    router.link.drain_left["w005"] = 12.5
    page, turns = _scrape(router)
    # 200 workers' ~3,800 lines in pieces of 64: dozens of turns (a page written in one go gets about 3)
    assert turns >= 30
    got = _samples(page)
    for i in range(n):
        wid = f"w{i:03}"
        three = (("model", "sim-m"), ("pool", "any"), ("worker", wid))
        assert got[("weir_worker_capacity_tokens", three)] == 8192
        assert got[("weir_worker_healthy", three)] == 1
        assert got[("weir_worker_engine_running", three)] == i % 5
        assert got[("weir_worker_engine_waiting", three)] == i % 3
        assert got[("weir_worker_kv_usage", three)] == pytest.approx(i / 1000)
        two = (("model", "sim-m"), ("worker", wid))
        assert got[("weir_gpu_present", two)] == 0 and ("weir_gpu_memory_used_bytes", two) not in got
        assert got[("weir_worker_draining", two)] == (1 if i == 5 else 0)
        assert got[("weir_worker_events_total", (("event", "registered"), ("worker", wid)))] == 1
    assert got[("weir_worker_drain_left_seconds", (("model", "sim-m"), ("worker", "w005")))] == 12.5
    assert sum(1 for name, _ in got if name == "weir_worker_drain_left_seconds") == 1
    assert got[("weir_model_ready_workers", (("model", "sim-m"),))] == n - 1
    helps = [line for line in page.splitlines() if line.startswith(b"# HELP ")]
    assert len(helps) == len(set(helps)) > 40  # each family once: the registry's pass skips what is text


def test_scrapes_share_a_render_in_flight_and_the_next_one_reads_the_last_heartbeat(router):
    for wid in ("w0", "w1"):
        router.join(wid)
    gpu = p.GpuInfo(present=True, name="H100", total_bytes=80 << 30, used_bytes=3_000_000, utilization_percent=40.0)

    async def two_at_once() -> tuple[bytes, bytes]:
        a, b = await asyncio.gather(router.views.metrics_payload(), router.views.metrics_payload())
        return a[0], b[0]

    renders = router.views.page.renders
    first, second = router.loop.run_until_complete(two_at_once())
    assert first == second and router.views.page.renders == renders + 1
    key = ("weir_worker_engine_running", (("model", "sim-m"), ("pool", "any"), ("worker", "w1")))
    assert _samples(first)[key] == 1
    # a heartbeat arrives: the next scrape renders anew and shows it (nothing is cached between renders)
    router.link.stats["w1"] = p.WorkerStats(running=7, gpu=gpu)
    got = _samples(_scrape(router)[0])
    assert router.views.page.renders == renders + 2 and got[key] == 7
    two = (("model", "sim-m"), ("worker", "w1"))
    assert got[("weir_gpu_present", two)] == 1 and got[("weir_gpu_memory_used_bytes", two)] == 3_000_000
    assert got[("weir_gpu_memory_total_bytes", two)] == 80 << 30 and got[("weir_gpu_utilization_percent", two)] == 40
    assert ("weir_gpu_power_watts", two) not in got  # a reading the board does not give: no sample, not 0
    # the registry stays whole for prometheus_client's readers: the same values, parsed back
    registry = router.metrics.registry
    assert registry.get_sample_value("weir_worker_engine_running", dict(key[1])) == 7
    assert registry.get_sample_value("weir_gpu_memory_used_bytes", dict(two)) == 3_000_000
