"""What agents and gateways send, end to end through Envoy: real Envoy,
router and two simulated workers (prefix cache modelled) on loopback.

Placement is round robin and prefix affinity is off here, so a turn that
finds its session's earlier context cached (``cached_tokens``) found it only
because its session sent it back to the same worker:

* gateways' priority headers pass Envoy and set the class (metrics' klass);
  a bad one is a 400 naming it;
* a session's turns (growing context) stay on one worker where requests
  without a session alternate;
* a session moves when its worker is over the load bound, and stays where
  it moved;
* a sheddable request that cannot meet its TTFT target is refused with
  llm-d's dropped reason; so is one whose TPOT target no worker meets, and
  attainment and goodput are counted per model and class;
* a session header of the config's own list passes Envoy and keeps a
  session on its worker as the built-in ones do;
* /tokenize resolves an alias;
* aliases: listed in /v1/models, split by weight (a session's requests to
  one target), an absent target's requests answered by its fallback, and
  every response names the model that served it.
"""

from __future__ import annotations

import threading

import pytest
import requests
import stackutil
from test_e2e_api import metric

MODEL = "sim-tiny"
CUSTOM_SESSION = "x-my-agent-session"  # [scheduler] session_headers


@pytest.fixture(scope="module")
def agent_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent_routing")
    cfg = stackutil.write_config(
        d,
        workers=[
            *(stackutil.sim_worker(f"sim-{i}", max_num_seqs=2, sim={"prefix_caching": True}) for i in range(2)),
            stackutil.sim_worker("simb-0", model="sim-b"),
        ],
        models=[
            *stackutil.localconfig.models(),
            {"name": "sim-b", "engine": "sim", "max_model_len": 2048},
            {"name": "sim-none", "engine": "sim", "max_model_len": 4096},  # no worker
        ],
        aliases=[
            {"name": "agent", "targets": [{"model": MODEL, "weight": 1}, {"model": "sim-b", "weight": 1}]},
            {"name": "backup", "targets": [{"model": "sim-none"}], "fallbacks": [MODEL]},
            {"name": "tok", "targets": [{"model": stackutil.VLLM_MODEL}]},  # (no worker: its tokenizer only)
        ],
        scheduler={
            "placement": "round_robin",
            "prefix_affinity": False,
            "session_load_bound": 0.5,
            "session_headers": [CUSTOM_SESSION],
        },
    )
    with stackutil.start_stack(cfg, d / "run") as s:
        yield s


def _turn(s, prompt: str, headers: dict[str, str] | None = None, max_tokens: int = 2) -> dict:
    r = requests.post(
        s.envoy_url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
        headers=headers or {},
        timeout=20,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _context(tag: str, turns: int) -> str:
    return "".join(
        f"[{tag} turn {k}] the agent reads the file, edits it and runs the tests again. " * 3 for k in range(turns)
    )


def test_gateway_priority_headers_pass_envoy_and_lower_the_class(agent_stack):
    s = agent_stack
    before = metric(s, "weir_requests_total", klass="batch")
    _turn(s, "hello", {"x-smg-priority": "bulk"})
    _turn(s, "hello", {"x-dynamo-request-priority": "-1"})  # higher first: one below the default
    assert metric(s, "weir_requests_total", klass="batch") == before + 1
    assert metric(s, "weir_requests_total", klass="low") >= 1
    r = requests.post(
        s.envoy_url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": 4},  # vLLM's body field
        timeout=10,
    )
    assert r.status_code == 200 and metric(s, "weir_requests_total", klass="batch") == before + 2
    r = requests.post(
        s.envoy_url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2},
        headers={"x-llm-d-slo-ttft-ms": "soon"},
        timeout=10,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-llm-d-slo-ttft-ms"


def test_a_sessions_turns_stay_on_one_worker(agent_stack):
    s = agent_stack
    sticky = metric(s, "weir_policy_decisions_total", decision="session_sticky")
    # Without a session, round robin moves the second turn to the other worker: nothing cached.
    _turn(s, _context("plain", 1))
    assert _cached(_turn(s, _context("plain", 2))) == 0
    # With one (a coding agent's own header), every later turn finds the context before it.
    hdr = {"x-claude-code-session-id": "e2e-session-1"}
    _turn(s, _context("agent", 1), hdr)
    for k in range(2, 6):
        assert _cached(_turn(s, _context("agent", k), hdr)) > 0, f"turn {k}"
    assert metric(s, "weir_policy_decisions_total", decision="session_sticky") == sticky + 4


def test_a_configured_session_header_passes_envoy_and_tokenize_resolves_an_alias(agent_stack):
    s = agent_stack
    sticky = metric(s, "weir_policy_decisions_total", decision="session_sticky")
    hdr = {CUSTOM_SESSION: "e2e-session-3"}
    _turn(s, _context("own-header", 1), hdr)
    for k in range(2, 4):
        assert _cached(_turn(s, _context("own-header", k), hdr)) > 0, f"turn {k}"
    assert metric(s, "weir_policy_decisions_total", decision="session_sticky") == sticky + 2
    body = {"prompt": "Hello there"}
    direct = requests.post(s.envoy_url + "/tokenize", json={"model": stackutil.VLLM_MODEL, **body}, timeout=10)
    assert direct.status_code == 200, direct.text
    via = requests.post(s.envoy_url + "/tokenize", json={"model": "tok", **body}, timeout=10)
    assert via.status_code == 200, via.text
    assert via.json() == direct.json()


def test_a_session_moves_when_its_worker_is_saturated(agent_stack):
    s = agent_stack
    hdr = {"x-session-id": "e2e-session-2"}
    moved = metric(s, "weir_policy_decisions_total", decision="session_moved")
    _turn(s, _context("busy", 1), hdr)
    # A long turn of the same session holds one of its worker's two slots: at the bound (0.5).
    stop = threading.Event()
    started = threading.Event()

    def long_turn() -> None:
        with requests.post(
            s.envoy_url + "/v1/completions",
            json={"model": MODEL, "prompt": _context("busy", 1) + " long", "max_tokens": 3000, "stream": True},
            headers=hdr,
            stream=True,
            timeout=60,
        ) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break  # closing the stream cancels the job

    t = threading.Thread(target=long_turn)
    t.start()
    try:
        assert started.wait(20)
        # the next turn cannot stay: placed on the other worker, where nothing of it is cached
        assert _cached(_turn(s, _context("busy", 2), hdr)) == 0
        assert metric(s, "weir_policy_decisions_total", decision="session_moved") == moved + 1
    finally:
        stop.set()
        t.join(30)
    # it stays where it moved: the turn after finds turn 2 there
    assert _cached(_turn(s, _context("busy", 3), hdr)) > 0


def test_a_sheddable_request_that_cannot_meet_its_target_is_refused_with_llm_ds_reason(agent_stack):
    s = agent_stack
    body = {"model": MODEL, "prompt": "x" * 400, "max_tokens": 2}
    # no worker starts a request within 10 microseconds: refused at once, through Envoy
    r = requests.post(
        s.envoy_url + "/v1/completions",
        json=body,
        timeout=10,
        headers={"x-llm-d-slo-ttft-ms": "0.01", "x-weir-sheddable": "true"},
    )
    assert r.status_code == 429, r.text
    assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "latency_target_unattainable" and err["type"] == "rate_limit_error"
    # the same target, not sheddable: served anyway (and counted as missed)
    missed = metric(s, "weir_policy_decisions_total", decision="ttft_target_missed")
    r = requests.post(s.envoy_url + "/v1/completions", json=body, timeout=10, headers={"x-slo-ttft-ms": "0.01"})
    assert r.status_code == 200, r.text
    assert metric(s, "weir_policy_decisions_total", decision="ttft_target_missed") == missed + 1
    # a target it meets easily: served, counted as met
    r = requests.post(
        s.envoy_url + "/v1/completions",
        json=body,
        timeout=10,
        headers={"x-llm-d-slo-ttft-ms": "5000", "x-weir-sheddable": "1"},
    )
    assert r.status_code == 200 and metric(s, "weir_policy_decisions_total", decision="ttft_target_met") >= 1
    assert metric(s, "weir_ttft_prediction_error_ratio") > 0.0  # its prediction checked against what came


def test_a_tpot_target_is_judged_shed_and_counted_through_envoy(agent_stack):
    s = agent_stack
    body = {"model": MODEL, "prompt": "y" * 200, "max_tokens": 8}
    # no engine steps in 10 microseconds: a sheddable request is refused at once, naming TPOT
    r = requests.post(
        s.envoy_url + "/v1/completions",
        json=body,
        timeout=10,
        headers={"x-llm-d-slo-tpot-ms": "0.01", "x-weir-sheddable": "true"},
    )
    assert r.status_code == 429, r.text
    assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert r.json()["error"]["code"] == "latency_target_unattainable" and "TPOT" in r.json()["error"]["message"]
    labels = {"model": MODEL, "target": "tpot"}
    assert metric(s, "weir_target_requests_total", outcome="shed", **labels) >= 1
    # not sheddable: served, and its end judged against the target (missed)
    missed = metric(s, "weir_target_requests_total", outcome="missed", **labels)
    r = requests.post(s.envoy_url + "/v1/completions", json=body, timeout=10, headers={"x-slo-tpot-ms": "0.01"})
    assert r.status_code == 200, r.text
    assert metric(s, "weir_target_requests_total", outcome="missed", **labels) == missed + 1
    # a target it meets: counted met, in goodput, and the prediction's error reported
    good = metric(s, "weir_target_goodput_requests_total", model=MODEL)
    r = requests.post(s.envoy_url + "/v1/completions", json=body, timeout=10, headers={"x-llm-d-slo-tpot-ms": "1000"})
    assert r.status_code == 200, r.text
    assert metric(s, "weir_target_goodput_requests_total", model=MODEL) == good + 1
    assert metric(s, "weir_tpot_prediction_error_ratio") > 0.0


def test_aliases_split_fall_back_and_name_the_model_that_served(agent_stack):
    s = agent_stack
    listed = {m["id"]: m for m in requests.get(s.envoy_url + "/v1/models", timeout=10).json()["data"]}
    assert {"agent", "backup"} <= set(listed)
    assert listed["agent"]["max_model_len"] == 2048 and listed["agent"]["ready_workers"] == 3

    def ask(model: str, headers: dict[str, str] | None = None) -> str:
        r = requests.post(
            s.envoy_url + "/v1/completions",
            json={"model": model, "prompt": "hi", "max_tokens": 2},
            headers=headers or {},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-weir-model"] == r.json()["model"]
        return r.json()["model"]

    # 1:1, drawn by the request id (x-request-id here, so the draw is the same every run)
    assert {ask("agent", {"x-request-id": f"alias-req-{k}"}) for k in range(16)} == {MODEL, "sim-b"}
    assert len({ask("agent", {"x-session-id": "alias-session"}) for _ in range(6)}) == 1
    assert ask("backup") == MODEL  # sim-none has no worker: its fallback answered
