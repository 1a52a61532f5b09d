"""Workload specs: what requests a benchmark sends, read from TOML.

A spec is a list of request *classes* (e.g. "short", "long", "high-priority
tenant A"), each with a weight in the mix, length distributions, how it
identifies itself (API key -> tenant/tier, or the ``priority`` field) and
its SLOs.  Results are reported per class and overall.  Example::

    name = "mixed"
    model = "sim-tiny"
    [slo]                       # default SLO for every class (all optional)
    ttft_ms = 500
    [[classes]]
    name = "short"
    weight = 0.8
    prompt_tokens = { dist = "uniform", min = 16, max = 64 }
    output_tokens = { dist = "fixed", value = 16 }
    priority = "high"
    slo = { e2e_ms = 200 }

See bench/workloads/ for the ones the scenarios use.
"""

from __future__ import annotations

import os
import random
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"


class _Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class Dist(_Spec):
    """A distribution of positive integers (token counts)."""

    dist: Literal["fixed", "uniform", "normal", "lognormal", "choice"] = "fixed"
    value: int = 1  # fixed
    min: int = 1  # uniform bounds; clamp for the others
    max: int = 1 << 20
    mean: float = 0.0  # normal / lognormal (mean of the distribution itself)
    stddev: float = 0.0
    values: list[int] = []  # choice
    weights: list[float] = []  # choice; empty = uniform

    def sample(self, rng: random.Random) -> int:
        d = self.dist
        if d == "fixed":
            x = self.value
        elif d == "uniform":
            x = rng.randint(self.min, self.max)
        elif d == "normal":
            x = round(rng.gauss(self.mean, self.stddev))
        elif d == "lognormal":
            # Parameterised by the distribution's own mean/stddev, not the
            # underlying normal's: that is what people know about lengths.
            import math

            var = self.stddev**2
            sigma2 = math.log(1 + var / self.mean**2)
            x = round(rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2)))
        else:  # choice
            x = rng.choices(self.values, weights=self.weights or None)[0]
        return max(self.min, min(self.max, x, 1 << 30), 1)


class Slo(_Spec):
    """Per-request service levels; a request meets its SLO when it succeeded
    and every threshold that is set holds.  Unset = not judged."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def merged(self, over: Slo | None) -> Slo:
        if over is None:
            return self
        return Slo(
            ttft_ms=over.ttft_ms if over.ttft_ms is not None else self.ttft_ms,
            tpot_ms=over.tpot_ms if over.tpot_ms is not None else self.tpot_ms,
            e2e_ms=over.e2e_ms if over.e2e_ms is not None else self.e2e_ms,
        )


class RequestClass(_Spec):
    name: str
    weight: float = 1.0  # share of arrivals
    prompt_tokens: Dist = msgspec.field(default_factory=lambda: Dist(value=32))
    output_tokens: Dist = msgspec.field(default_factory=lambda: Dist(value=16))
    api_key: str | None = None  # -> tenant and tier at the gateway
    api_keys: list[str] = []  # several tenants in one class: one drawn per request
    priority: str | None = None  # request's own priority field (may only lower)
    task_type: Literal["short", "long"] | None = None  # hint for the router
    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    stream: bool = True
    ignore_eos: bool = True  # so that output lengths are what the spec says
    temperature: float = 1.0
    slo: Slo | None = None


class Workload(_Spec):
    name: str = "workload"
    model: str = "sim-tiny"
    seed: int = 0
    slo: Slo = msgspec.field(default_factory=Slo)
    classes: list[RequestClass] = []

    def class_slo(self, c: RequestClass) -> Slo:
        return self.slo.merged(c.slo)


class SpecError(ValueError):
    pass


def _check(w: Workload) -> Workload:
    if not w.classes:
        raise SpecError("a workload needs at least one [[classes]] entry")
    names = [c.name for c in w.classes]
    if len(set(names)) != len(names):
        raise SpecError(f"duplicate class names: {names}")
    for c in w.classes:
        if c.api_key and c.api_keys:
            raise SpecError(f"class {c.name!r}: give api_key or api_keys, not both")
        if c.weight < 0:
            raise SpecError(f"class {c.name!r}: negative weight")
        for d in (c.prompt_tokens, c.output_tokens):
            if d.dist == "choice" and not d.values:
                raise SpecError(f"class {c.name!r}: dist 'choice' needs values")
            if d.dist == "lognormal" and d.mean <= 0:
                raise SpecError(f"class {c.name!r}: lognormal needs mean > 0")
    if sum(c.weight for c in w.classes) <= 0:
        raise SpecError("class weights sum to zero")
    return w


def loads(text: str) -> Workload:
    try:
        return _check(msgspec.convert(tomllib.loads(text), Workload))
    except (msgspec.ValidationError, tomllib.TOMLDecodeError) as e:
        raise SpecError(str(e)) from None


def load(name_or_path: str | os.PathLike) -> Workload:
    """A path to a TOML file, or the name of one in bench/workloads/."""
    p = Path(name_or_path)
    if not p.exists():
        cand = WORKLOAD_DIR / (p.name if p.suffix == ".toml" else p.name + ".toml")
        if not cand.exists():
            known = ", ".join(sorted(f.stem for f in WORKLOAD_DIR.glob("*.toml")))
            raise SpecError(f"no workload file {str(p)!r} (built-in: {known})")
        p = cand
    try:
        return loads(p.read_text())
    except SpecError as e:
        raise SpecError(f"{p}: {e}") from None
