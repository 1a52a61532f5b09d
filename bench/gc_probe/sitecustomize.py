"""The router's full garbage collections, logged for a benchmark's run.

A benchmark that puts this directory first on PYTHONPATH and names a file in
WEIR_BENCH_GC_LOG gets a line per full (generation-2) collection of the
router process (``python -m router``; every other process ignores it): its
wall-clock time at the end, how long it held the interpreter, what it freed
and what it left tracked.  Diagnostics of a run only (bench.scenarios.scrape_cost);
the router itself carries no such hook: a gc callback runs on every young
collection too.

    <unix time> <duration ms> <collected> <tracked after>
"""

import os

_LOG = os.environ.get("WEIR_BENCH_GC_LOG")


def _is_router() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return argv[1:3] == [b"-m", b"router"]


if _LOG and _is_router():
    import gc
    import time

    _out = open(_LOG, "a", buffering=1)  # open for the process's lifetime
    _started = [0.0]

    def _on_gc(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        held = time.perf_counter() - _started[0]
        _out.write(f"{time.time():.4f} {held * 1e3:.2f} {info['collected']} {len(gc.get_objects(2))}\n")

    gc.callbacks.append(_on_gc)
