"""When requests are sent.

Open loop (arrivals do not wait for answers, as real users do not):
  * Poisson at ``rate`` req/s (exponential gaps);
  * gamma gaps with shape ``burstiness`` and the same mean 1/rate -- the
    convention of ``vllm bench serve``: burstiness 1 is Poisson, < 1 is
    burstier, > 1 smoother;
  * ``rate = inf``: everything at once.
Closed loop: ``concurrency`` requests always in flight (a new one starts
when one ends), which measures capacity without queueing in the client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Arrivals:
    rate: float | None = None  # req/s, open loop; math.inf = all at t=0
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop

    def __post_init__(self):
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate (open loop) or concurrency (closed loop)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    def describe(self) -> str:
        if not self.open_loop:
            return f"closed loop, concurrency {self.concurrency}"
        if math.isinf(self.rate):
            return "open loop, all at once"
        kind = "Poisson" if self.burstiness == 1.0 else f"gamma (burstiness {self.burstiness:g})"
        return f"open loop, {kind} at {self.rate:g} req/s"

    def schedule(self, n: int, seed: int = 0) -> np.ndarray:
        """Send times (seconds from the start) of ``n`` open-loop arrivals."""
        if math.isinf(self.rate):
            return np.zeros(n)
        rng = np.random.default_rng(seed)
        theta = 1.0 / (self.rate * self.burstiness)
        gaps = rng.gamma(self.burstiness, theta, size=n)
        gaps[0] = 0.0  # the first request goes at once
        return np.cumsum(gaps)
