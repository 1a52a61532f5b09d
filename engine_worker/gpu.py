"""The worker's GPU as NVML sees it.  No GPU, no driver, or any NVML failure
reads as ``GpuInfo(present=False)``: a CPU-only worker is normal, not an error."""

from __future__ import annotations

import logging
from typing import Optional

from shared.protocol import GpuInfo

log = logging.getLogger(__name__)

_nvml_ok: Optional[bool] = None  # None: not tried yet


def _init() -> bool:
    global _nvml_ok
    if _nvml_ok is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml_ok = True
        except Exception as e:  # library missing, no driver, ...
            log.info("NVML unavailable (%s): reporting no GPU", e)
            _nvml_ok = False
    return _nvml_ok


def read_gpu(index: Optional[int]) -> GpuInfo:
    if index is None or not _init():
        return GpuInfo(present=False)
    try:
        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuInfo(True, name, index, int(mem.total), int(mem.used))
    except Exception as e:
        log.warning("NVML read of GPU %s failed: %s", index, e)
        return GpuInfo(present=False, index=index)
