"""Tiers and markers for every test (fixtures for real processes: tests/e2e/conftest.py).

A test's folder is its tier, and its tier is its marker (``-m unit``, ...):

  unit/    pure logic: the policy, the DES, the wire and config rendering, on
           values -- no sockets, no servers, nothing left running.  Offline
           checkers of what weir renders (Envoy's ``--mode validate``,
           ``kubectl kustomize``) count as pure.
  inproc/  the lifecycle and the adapters in this process: the router core
           with fake workers and a fake clock, the HTTP server and the ZeroMQ
           planes on real loopback sockets.  Seconds.
  e2e/     real processes: Envoy, the router, workers, vLLM, Redis, Prometheus.

``vllm`` marks what runs the real vLLM engine (every test on the session
``stack``, tests/e2e/test_engine_vllm.py, and tests that start a vLLM worker
of their own, marked in place).  ``slow`` marks the unit and in-process tests
that take seconds rather than milliseconds (SLOW below): ``make test-fast``
leaves them out, ``make test`` runs everything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "inproc", "e2e")
VLLM_FILES = {"e2e/test_engine_vllm.py"}
# Seconds each here (2 shared cores): whole DES scenarios, large property
# runs, schema validation and kustomize.  "<file>" marks a whole file,
# "<file>::<test name>" one test (a name prefix: every parameter of it).
SLOW = (
    "unit/test_des.py",
    "unit/test_routers_des.py",
    "unit/test_des_golden.py::test_simulation_decides_as_the_golden_fingerprints[sampled_placement]",
    "unit/test_placement_sampling.py::test_sampled_placement_serves_as_well_as_scoring_every_worker",
    "unit/test_policy_properties.py::test_ledger_bounds_and_exactly_once_release",
    "unit/test_policy_properties.py::test_no_class_waits_past_the_aging_bound",
    "unit/test_k8s.py::test_every_object_validates_against_its_schema",
    "unit/test_k8s.py::test_kustomize_builds_what_the_renderer_validated",
    "unit/test_key_rule.py::test_envoy_and_router_agree_on_every_header_value",
    "unit/test_agents_des.py::test_weir_beats_the_baselines_on_agent_traffic",
    "unit/test_targets_des.py",
    "inproc/test_batch_drain.py::test_a_drain_while_the_disk_is_full_hands_on_only_what_was_written",
    "inproc/test_tokenize_calls.py::test_another_tenants_prompt_and_call_go_before_a_backlog_of_long_calls",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            rel = item.path.resolve().relative_to(TESTS).as_posix()
        except ValueError:
            continue  # not under tests/ (a path given on the command line)
        tier = rel.split("/", 1)[0]
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{rel}: every test lives in tests/unit, tests/inproc or tests/e2e "
                "(the folder is its tier: see tests/conftest.py)"
            )
        item.add_marker(tier)
        if rel in VLLM_FILES or "stack" in getattr(item, "fixturenames", ()):
            item.add_marker("vllm")
        test_id = f"{rel}::{item.name}"
        if any(test_id.startswith(s + "::" if s.endswith(".py") else s) for s in SLOW):
            item.add_marker("slow")
