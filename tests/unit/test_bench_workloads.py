"""`weir bench` without a target: the built-in workload specs load, a typo is
refused, open-loop arrivals have the asked rate and burstiness, bad arguments
exit 2.  Runs against a real stack: tests/e2e/test_bench_smoke.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import spec
from bench.arrivals import Arrivals
from bench.cli import main as bench_main


def test_bad_arguments_exit_2(tmp_path):
    assert bench_main(["-w", "no-such-workload", "--url", "http://127.0.0.1:1", "--no-progress"]) == 2
    assert bench_main(["-w", "smoke", "-t", "openai", "--url", "http://10.1.2.3:80/v1"]) == 2  # not loopback
    assert bench_main(["-w", "smoke", "-t", "openai"]) == 2  # no URL


@pytest.mark.parametrize("name", sorted(p.stem for p in spec.WORKLOAD_DIR.glob("*.toml")))
def test_builtin_workloads_load(name):
    w = spec.load(name)
    assert w.classes and all(c.weight >= 0 for c in w.classes)


def test_spec_rejects_typos():
    with pytest.raises(spec.SpecError):
        spec.loads('[[classes]]\nname = "a"\npromt_tokens = { dist = "fixed", value = 3 }\n')
    with pytest.raises(spec.SpecError):
        spec.loads("name = 'x'\n")  # no classes


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_open_loop_arrivals_have_the_asked_rate(burstiness):
    t = Arrivals(rate=100.0, burstiness=burstiness).schedule(20_000, seed=1)
    gaps = np.diff(t)
    assert math.isclose(gaps.mean(), 0.01, rel_tol=0.05)
    # Coefficient of variation of gamma gaps is 1/sqrt(shape).
    assert math.isclose(gaps.std() / gaps.mean(), 1 / math.sqrt(burstiness), rel_tol=0.1)
