"""``python -m engine_worker --config PATH --worker-id ID``: one engine worker process.

Environment is settled before vLLM is imported: HF_HUB_OFFLINE=1 (models are
local), CUDA_VISIBLE_DEVICES from ``gpu_index``, then the worker's ``env``
table from the config (it wins).

VLLM_CPU_OMP_THREADS_BIND is left at vLLM's default "auto": on the 2-vCPU dev
VM that reserves one core for the EngineCore/frontend and binds one OpenMP
thread to the other.  Measured with ``python -m engine_worker.calibrate``
(tiny-llama, medians, busy host): auto gave TPOT 1.9-3.1 ms at 1 request and
2.7-2.9 ms at 16; "nobind" (OpenMP threads on every core, contending with the
frontend) gave 3.3-7.0 ms and 3.2-10.3 ms.  Override per worker via ``env``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_worker", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="weir TOML config (default: $WEIR_CONFIG or deploy/weir.toml)")
    ap.add_argument("--worker-id", required=True, help="a [[workers]] id from the config")
    args = ap.parse_args(argv)

    from shared.config import load

    cfg = load(args.config)
    try:
        wcfg = cfg.worker(args.worker_id)
    except KeyError:
        ap.error(f"no worker {args.worker_id!r} in the config")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if wcfg.gpu_index is not None:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(wcfg.gpu_index))
    os.environ.update(wcfg.env)

    logging.basicConfig(
        level=cfg.router.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker[{wcfg.id}] %(name)s: %(message)s",
        stream=sys.stderr,
    )

    import uvloop

    from .worker import Worker, make_engine

    async def run() -> int:
        engine = make_engine(cfg, wcfg)
        return await Worker(cfg, wcfg, engine).run()

    return uvloop.run(run())


if __name__ == "__main__":
    sys.exit(main())
