"""Fixed-seed fingerprints of the scheduling simulations, to show that a
refactor of the policy (or of the simulations' drivers) decides exactly as before.

    python -m simulation.golden            # print the fingerprints as JSON
    python -m simulation.golden --write    # rewrite tests/golden/des.json

Each scenario's fingerprint is a SHA-256 over every request's record (times
rounded to 1 ns, outcome, attempts, predicted wait) plus the preemption count
and the simulation's end time; tests/unit/test_des_golden.py compares them with
the committed file.  A deliberate change of a decision rewrites the file in
the same commit that changes the decision.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulation import des, routers_des
from simulation.des import Result

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "des.json"


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 9)


def fingerprint(res: Result) -> dict[str, Any]:
    h = hashlib.sha256()
    for r in sorted(res.records, key=lambda r: r.job_id):
        h.update(
            repr(
                (
                    r.job_id,
                    r.kind,
                    r.klass,
                    r.tenant,
                    r.prompt,
                    r.max_tokens,
                    _r(r.arrival),
                    _r(r.dispatched),
                    _r(r.first_token),
                    _r(r.finished),
                    r.outcome,
                    _r(r.predicted),
                    _r(r.submitted),
                    r.attempts,
                    r.first_refusal,
                )
            ).encode()
        )
    return {
        "records": len(res.records),
        "done": len(res.done()),
        "preemptions": res.preemptions,
        "sim_time_s": _r(res.sim_time_s),
        "sha256": h.hexdigest(),
    }


def _mixed() -> dict[str, Result]:
    _, weir, fifo = des.scenario_mixed(duration_s=30.0)
    return {"weir": weir, "fifo": fifo}


def _overload() -> dict[str, Result]:
    _, unloaded, weir, fifo = des.scenario_overload(duration_s=10.0)
    return {"unloaded": unloaded, "weir": weir, "fifo": fifo}


def _burst() -> dict[str, Result]:
    _, _, res = des.scenario_burst(multiple=5.0)
    return {"weir": res}


def _ledger() -> dict[str, Result]:
    on, off = des.scenario_ledger(duration_s=10.0)
    return {"on": on, "off": off}


def _sampled() -> dict[str, Result]:
    _, sampled, every = des.scenario_sampled_placement(n_workers=24, duration_s=10.0)
    return {"sampled": sampled, "every": every}


def _routers() -> dict[str, Result]:
    _, out = routers_des.compare(ns=(1, 3), duration_s=15.0)
    return {f"n{n}": res for n, (res, _) in out.items()}


SCENARIOS: dict[str, Callable[[], dict[str, Result]]] = {
    "mixed": _mixed,
    "overload": _overload,
    "burst": _burst,
    "ledger": _ledger,
    "sampled_placement": _sampled,
    "routers": _routers,
}


def compute(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in names or list(SCENARIOS):
        for run, res in SCENARIOS[name]().items():
            out[f"{name}/{run}"] = fingerprint(res)
    return out


def main(argv: list[str]) -> int:
    got = compute()
    text = json.dumps(got, indent=1, sort_keys=True) + "\n"
    if "--write" in argv:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
