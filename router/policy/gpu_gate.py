"""Whether a worker's GPU may take new work: a pure check the policy consults
on each heartbeat's NVML reading (router/policy/facade.py ``Policy.update_worker``).

A GPU over ``gpu_max_temperature_c`` or with more than
``gpu_max_memory_fraction`` of its memory used gets no new work until a later
reading is back under the threshold; what it runs finishes there.  No GPU, or
a reading the board does not give, never blocks (0 turns a threshold off).
"""

from __future__ import annotations

from shared.config import SchedulerConfig
from shared.protocol import GpuInfo

HOT = "gpu_temperature"
FULL = "gpu_memory"


def gpu_block(gpu: GpuInfo | None, cfg: SchedulerConfig) -> str | None:
    """Why this GPU takes no new work (``HOT`` / ``FULL``), or None."""
    if gpu is None or not gpu.present:
        return None
    limit = cfg.gpu_max_temperature_c
    if limit > 0 and gpu.temperature_c is not None and gpu.temperature_c >= limit:
        return HOT
    frac = cfg.gpu_max_memory_fraction
    if frac > 0 and gpu.total_bytes > 0 and gpu.used_bytes >= frac * gpu.total_bytes:
        return FULL
    return None
