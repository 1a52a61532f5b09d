"""The scheduling simulations decide exactly as the committed fingerprints say
(simulation/golden.py): a refactor of the policy or of the simulation drivers
that changes any request's dispatch, finish, outcome or predicted wait fails here."""

from __future__ import annotations

import json

import pytest

from simulation import golden

EXPECTED = json.loads(golden.GOLDEN.read_text())


@pytest.mark.parametrize("scenario", list(golden.SCENARIOS))
def test_simulation_decides_as_the_golden_fingerprints(scenario: str) -> None:
    got = golden.compute([scenario])
    want = {k: v for k, v in EXPECTED.items() if k.split("/")[0] == scenario}
    assert want, f"no golden fingerprints for {scenario}"
    assert got == want
