"""``python -m engine_worker --config PATH --worker-id ID``: one engine worker process.

Environment is settled before vLLM is imported: HF_HUB_OFFLINE=1 (models are
local), CUDA_VISIBLE_DEVICES from ``gpu_index``, then the worker's ``env``
table from the config (it wins).

vLLM's CPU threading comes from the worker's ``env`` too: deploy/weir.toml
and the test/bench configs set ``VLLM_CPU_OMP_THREADS_BIND=nobind
OMP_NUM_THREADS=1`` -- one OpenMP thread the kernel may move, instead of
vLLM's default of one pinned to a core that Envoy and the router also need
(weir's median TTFT at 20 req/s: 52 ms pinned, 11-16 ms unpinned;
bench/README.md, Versus).
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
    # Kubernetes: every pod of a StatefulSet runs one [[workers]] entry's
    # settings under its own pod name (deploy/k8s_objects.py), so replicas differ.
    ap.add_argument("--instance-id", help="register under this id instead (default: --worker-id)")
    args = ap.parse_args(argv)

    from shared.config import load

    cfg = load(args.config)
    try:
        wcfg = cfg.worker(args.worker_id)
    except KeyError:
        ap.error(f"no worker {args.worker_id!r} in the config")
    if args.instance_id:
        import msgspec

        wcfg = msgspec.structs.replace(wcfg, id=args.instance_id)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if wcfg.gpu_index is not None:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(wcfg.gpu_index))
    os.environ.update(wcfg.env)

    logging.basicConfig(
        level=cfg.router.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker[{wcfg.id}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if cfg.logging.format == "json":
        from shared.logs import use_json

        use_json(f"worker[{wcfg.id}]")

    import uvloop

    from .worker import Worker, make_engine

    async def run() -> int:
        engine = make_engine(cfg, wcfg)
        return await Worker(cfg, wcfg, engine).run()

    return uvloop.run(run())


if __name__ == "__main__":
    sys.exit(main())
