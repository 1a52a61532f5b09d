"""Workers' prefix-cache news into the policy's prefix index (prefix affinity).

The worker link passes each PrefixEvents / PrefixSnapshot and each
heartbeat's prefix seq through the lifecycle to here.  An answer of True
asks the link to request a snapshot: the worker's events had a gap, and
until its snapshot comes the worker is routed cache-blind.
"""

from __future__ import annotations

import logging
import time

from router.fleet.prefix_index import PrefixIndex
from router.fleet.prefix_metrics import PrefixMetrics
from shared import protocol as p

log = logging.getLogger("weir.router")


class PrefixRelay:
    def __init__(self, index: PrefixIndex, metrics: PrefixMetrics) -> None:
        self.index = index
        self.metrics = metrics

    def news(self, worker_id: str, msg: p.PrefixEvents | p.PrefixSnapshot) -> bool:
        """A worker's PrefixEvents / PrefixSnapshot.  True: ask it for a snapshot."""
        index = self.index
        if isinstance(msg, p.PrefixSnapshot):
            index.snapshot(worker_id, msg.seq, msg.hashes, msg.trusted)
            return False
        if msg.ts:
            self.metrics.lag.labels(worker_id).observe(max(0.0, time.time() - msg.ts))
        if index.events(worker_id, msg.seq, msg.stored, msg.removed, msg.cleared):
            return False
        self._recovery(worker_id, "gap")
        return True

    def heard_seq(self, worker_id: str, seq: int) -> bool:
        """A heartbeat's prefix seq; True: ask for a snapshot."""
        index = self.index
        was = index.trusted(worker_id)
        ask = index.heard_seq(worker_id, seq)
        if ask and was:
            self._recovery(worker_id, "heartbeat seq ahead")
        return ask

    def _recovery(self, worker_id: str, why: str) -> None:
        log.warning("worker %s: prefix events out of order (%s): cache-blind until its snapshot", worker_id, why)
        self.metrics.recoveries.labels(worker_id).inc()
