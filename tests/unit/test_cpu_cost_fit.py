"""The CPU-cost scenario's split of CPU per request into a fixed part and a
part per streamed token (bench.scenarios.cpu_cost.fits): the line comes back
from rows made on it, per process and for the frontend summed, against the
tokens actually streamed; one output length gives no line."""

from __future__ import annotations

import pytest

from bench.scenarios.cpu_cost import fit_line, fits

# ms per request = fixed + per_token * tokens, by process
WEIR = {"router": (1.8, 0.064), "envoy": (1.3, 0.033), "worker": (2.0, 0.115)}
VLLM = {"api_server": (5.2, 0.191)}


def _row(
    server: str,
    rate: float,
    output_len: int,
    streamed: int,
    roles: dict[str, tuple[float, float]],
    completed: int = 100,
    noise: float = 0.0,
) -> dict:
    cpu = {role: completed * (fixed + per_token * streamed + noise) / 1e3 for role, (fixed, per_token) in roles.items()}
    return {
        "server": server,
        "rate": rate,
        "output_len": output_len,
        "completed": completed,
        "output_tokens": completed * streamed,
        "cpu_s": cpu | {"engine": 99.0},
    }


def test_fit_line_recovers_a_line_and_needs_two_xs():
    assert fit_line([4, 128], [5.0, 30.0]) == pytest.approx((5.0 - 25.0 / 124 * 4, 25.0 / 124))
    assert fit_line([1, 2, 3], [3.0, 5.0, 7.0]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError):
        fit_line([32, 32], [1.0, 2.0])


def test_fits_split_each_process_into_fixed_and_per_token():
    rows = []
    for rnd, noise in enumerate((0.0, 0.5, -0.5)):  # the median round is the clean one
        for olen, streamed in ((4, 4), (32, 31), (128, 128)):  # a run may stream fewer than asked
            rows.append(_row("weir", 5.0, olen, streamed, WEIR, noise=noise) | {"round": rnd})
            rows.append(_row("vllm", 5.0, olen, streamed, VLLM, noise=noise) | {"round": rnd})
    (vllm,) = [f for f in fits(rows) if f["server"] == "vllm"]
    (weir,) = [f for f in fits(rows) if f["server"] == "weir"]
    assert vllm["api_server"]["fixed_ms"] == pytest.approx(5.2)
    assert vllm["api_server"]["us_per_token"] == pytest.approx(191)
    for role, (fixed, per_token) in WEIR.items():
        assert weir[role]["fixed_ms"] == pytest.approx(fixed)
        assert weir[role]["us_per_token"] == pytest.approx(1e3 * per_token)
    assert weir["frontend"]["fixed_ms"] == pytest.approx(sum(f for f, _ in WEIR.values()))
    assert weir["frontend"]["us_per_token"] == pytest.approx(1e3 * sum(t for _, t in WEIR.values()))
    assert "api_server" not in weir and "router" not in vllm


def test_one_output_length_gives_no_line():
    rows = [_row("weir", 20.0, 32, 32, WEIR), _row("vllm", 20.0, 32, 32, VLLM)]
    assert fits(rows) == []
