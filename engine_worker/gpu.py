"""The worker's GPU as NVML sees it.  No GPU, no driver, or any NVML failure
reads as ``GpuInfo(present=False)``: a CPU-only worker is normal, not an error.

A reading the board does not support (power on some boards, utilisation under
MIG) is None; the others are still reported.

``python -m engine_worker.gpu --probe [--index N]`` prints every GPU's reading
as JSON, with what one ``read_gpu`` took (the worker reads once per heartbeat,
on a thread off its event loop), so a GPU host can be checked without starting a stack.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from shared.protocol import GpuInfo

log = logging.getLogger(__name__)

_nvml_ok: bool | None = None  # None: not tried yet
_nvml_error = ""


def _init() -> bool:
    global _nvml_ok, _nvml_error
    if _nvml_ok is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml_ok = True
        except Exception as e:  # library missing, no driver, ...
            _nvml_error = f"{type(e).__name__}: {e}"
            log.info("NVML unavailable (%s): reporting no GPU", e)
            _nvml_ok = False
    return _nvml_ok


def _optional(read: Callable[[], float]) -> float | None:
    """One NVML reading, or None where the board does not support it."""
    try:
        return float(read())
    except Exception:  # pynvml.NVMLError_NotSupported and kin
        return None


def read_gpu(index: int | None) -> GpuInfo:
    if index is None or not _init():
        return GpuInfo(present=False)
    try:
        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception as e:
        log.warning("NVML read of GPU %s failed: %s", index, e)
        return GpuInfo(present=False, index=index)
    return GpuInfo(
        True,
        name,
        index,
        int(mem.total),
        int(mem.used),
        utilization_percent=_optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        temperature_c=_optional(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        power_w=_optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),  # NVML: milliwatts
    )


def probe(index: int | None = None) -> dict[str, Any]:
    """Every GPU's reading (or the one at ``index``), and the cost of a read."""
    if not _init():
        return {"nvml": False, "error": _nvml_error, "gpus": [msgspec.structs.asdict(GpuInfo(present=False))]}
    import pynvml

    indices = [index] if index is not None else list(range(pynvml.nvmlDeviceGetCount()))
    gpus = []
    for i in indices:
        t0 = time.perf_counter()
        info = read_gpu(i)
        ms = (time.perf_counter() - t0) * 1000
        gpus.append({**msgspec.structs.asdict(info), "read_ms": round(ms, 3)})
    return {"nvml": True, "driver": _str(pynvml.nvmlSystemGetDriverVersion()), "gpus": gpus}


def _str(v: object) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_worker.gpu", description="NVML readings as weir reports them")
    ap.add_argument("--probe", action="store_true", required=True, help="print every GPU's reading as JSON")
    ap.add_argument("--index", type=int, default=None, help="only this GPU (NVML index)")
    args = ap.parse_args(argv)
    json.dump(probe(args.index), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
