"""LoRA adapters through the router's lifecycle in-process (fake workers, the real
intake, policy and adapter table): what a worker is sent for an adapter, the
per-key and per-tenant allow-lists, removal with requests admitted, heartbeats'
adapters in placement, and the per-adapter metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from fakes import FakeClock, FakeSink, FakeWorkers, registration

from deploy.make_adapter import build
from router.lifecycle.core import RouterCore
from shared import protocol as p
from shared.config import Config

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
KEY_A, KEY_B, KEY_ALL = "sk-only-a", "sk-tenant-b", "sk-all"


@pytest.fixture
def core(tmp_path):
    a = build(str(tmp_path / "a"), str(TINY), seed=1)
    b = build(str(tmp_path / "b"), str(TINY), seed=2)
    cfg = msgspec.convert(
        {
            "models": [{"name": "tiny", "engine": "vllm", "path": str(TINY), "max_model_len": 512}],
            "adapters": [
                {"name": "lora-a", "base": "tiny", "path": str(a)},
                {"name": "lora-b", "base": "tiny", "path": str(b)},
            ],
            "api_keys": [
                {"key": KEY_A, "tenant": "ta", "adapters": ["lora-a"]},
                {"key": KEY_B, "tenant": "tb"},
                {"key": KEY_ALL, "tenant": "tc"},
            ],
            "tenants": [{"name": "tb", "adapters": ["lora-b"]}],
        },
        Config,
    )
    loop = asyncio.new_event_loop()
    workers = FakeWorkers()
    c = RouterCore(cfg, loop, workers, clock=FakeClock())
    c.fakes = workers  # type: ignore[attr-defined]
    c.settle = lambda: [loop.run_until_complete(asyncio.sleep(0)) for _ in range(3)]  # type: ignore[attr-defined]
    for wid in ("w0", "w1"):
        workers.linked.add(wid)
        c.worker_joined(registration(wid, "tiny", max_model_len=512, engine="vllm"))
    yield c
    c.close()
    loop.close()


def _submit(core, model: str, key: str = KEY_ALL):
    sink = FakeSink()
    got = core.submit(p.Submit("c", model, prompt="hello there", max_tokens=4, api_key=key), sink)
    core.settle()
    return got, sink


def _sent(core) -> list[tuple[str, p.GenerateRequest]]:
    return [(w, r) for w, reqs in core.fakes.dispatched.items() for r in reqs]


def test_an_adapter_runs_on_its_base_with_its_lora_ref(core):
    handle, _ = _submit(core, "lora-a")
    assert isinstance(handle, int)
    ((worker, req),) = _sent(core)
    a = core.registry.adapters.get("lora-a")
    assert req.lora == a.ref and req.lora.path == a.path  # what the worker's LoRARequest is built from
    plain, _ = _submit(core, "tiny")
    assert isinstance(plain, int) and _sent(core)[-1][1].lora is None
    err, _ = _submit(core, "lora-nope")
    assert isinstance(err, p.ErrorInfo) and err.status == 404 and err.code == "model_not_found"


def test_allow_lists_of_key_and_tenant(core):
    for key, model, ok in (
        (KEY_A, "lora-a", True),
        (KEY_A, "lora-b", False),  # not on the key's list
        (KEY_B, "lora-b", True),
        (KEY_B, "lora-a", False),  # not on its tenant's list
        (KEY_A, "tiny", True),  # base models are not adapters: no list applies
        (KEY_ALL, "lora-b", True),
    ):
        got, _ = _submit(core, model, key)
        if ok:
            assert isinstance(got, int), (key, model, got)
        else:  # a forbidden adapter is as unknown to that key: the same 404 as one that does not exist
            assert isinstance(got, p.ErrorInfo) and (got.status, got.code) == (404, "model_not_found")
            assert got.message == "The model `lora-nope` does not exist.".replace("lora-nope", model)


def test_removed_adapter_lets_admitted_requests_finish(core):
    running, sink = _submit(core, "lora-b")
    assert isinstance(running, int)
    assert core.remove_adapter("lora-b") is None
    assert core.remove_adapter("lora-b") == "no adapter 'lora-b'"
    err, _ = _submit(core, "lora-b")
    assert isinstance(err, p.ErrorInfo) and err.code == "model_not_found"
    worker, req = _sent(core)[0]
    assert req.lora is not None and req.lora.name == "lora-b"
    core.on_outputs(worker, [p.Delta(req.request_id, "x", 1, "length", prompt_tokens=3, completion_tokens=4)])
    core.settle()
    assert len(sink.finals) == 1 and sink.finals[0].error is None and sink.finals[0].finish_reason == "length"


def test_heartbeats_steer_placement_to_the_holder(core):
    a = core.registry.adapters.get("lora-a")
    held = p.LoraHeld(slot=[a.lora_id], slots=1)
    core.worker_stats("w1", p.WorkerStats(loras=held))
    core.worker_stats("w0", p.WorkerStats(loras=p.LoraHeld(slot=[7], slots=1)))
    for _ in range(2):
        _submit(core, "lora-a")
    assert [w for w, _ in _sent(core)] == ["w1", "w1"]  # w0 is as free, but would have to load it


def _sample(core, family: str, **labels: str) -> float:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    for line in "".join(core.metrics.text()).splitlines():
        if line.startswith(family + want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_per_adapter_metrics(core):
    handle, sink = _submit(core, "lora-a")
    worker, req = _sent(core)[0]
    assert _sample(core, "weir_adapter_loads_total", adapter="lora-a") == 1  # neither worker held it
    core.on_outputs(worker, [p.Delta(req.request_id, "xy", 2, "length", prompt_tokens=3, completion_tokens=2)])
    core.settle()
    assert _sample(core, "weir_adapter_requests_total", adapter="lora-a", outcome="length") == 1
    assert _sample(core, "weir_adapter_tokens_total", adapter="lora-a", kind="completion") == 2
    assert (
        _sample(core, "weir_adapter_tokens_total", adapter="lora-a", kind="prompt") == sink.finals[0].prompt_tokens > 0
    )
    a = core.registry.adapters.get("lora-a")
    core.worker_stats(worker, p.WorkerStats(loras=p.LoraHeld(slot=[a.lora_id], slots=1)))
    _submit(core, "lora-a")  # held now: no second load
    assert _sample(core, "weir_adapter_loads_total", adapter="lora-a") == 1
    core.worker_stats(worker, p.WorkerStats(loras=p.LoraHeld(slot=[99], slots=1)))  # evicted for another
    assert _sample(core, "weir_adapter_evictions_total", adapter="lora-a") == 1
    assert _sample(core, "weir_adapter_requests_total", adapter="lora-b", outcome="length") == 0


def test_models_list_shows_a_key_only_the_adapters_it_may_use(core):
    from router.lifecycle.reads import RouterCoreReads
    from router.observe.metrics import RouterMetrics
    from router.observe.views import RouterViews

    class NoLink:
        def worker_count(self):
            return 0

        def report(self, worker_id):
            return None

        def reports(self):
            return []

    views = RouterViews(RouterCoreReads(core), NoLink(), RouterMetrics())
    names = {key: [a[0] for a in views.adapters_for(key)] for key in (KEY_A, KEY_B, KEY_ALL)}
    assert names == {KEY_A: ["lora-a"], KEY_B: ["lora-b"], KEY_ALL: ["lora-a", "lora-b"]}
    for key in ("sk-unknown", None, "sk bad"):  # refused as a generation is: no list at all
        refused = views.adapters_for(key)
        assert isinstance(refused, p.ErrorInfo) and refused.code == "invalid_api_key", key
    assert [a[0] for a in views.adapters()] == ["lora-a", "lora-b"]  # the operator's view: all
