"""``weir models list|add|remove``: models at run time, through the router's
admin API (``/admin/models``); ``weir up``'s supervisor starts and stops the
workers (deploy/runtime_models.py).

    weir models add sim-extra --engine sim --workers 2 --wait
    weir models add big --path /models/big --max-model-len 4096 --worker-env CUDA_VISIBLE_DEVICES=1
    weir models remove sim-extra --wait
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from shared.config import load


def add_parser(sub: Any) -> None:  # argparse's subparsers action
    models = sub.add_parser("models", help="list, add or remove models of a running stack")
    ms = models.add_subparsers(dest="models_cmd", required=True)
    ls = ms.add_parser("list", help="every model and its state (loading / ready / unloading)")
    ls.add_argument("--config")
    ls.set_defaults(func=cmd_list)
    add = ms.add_parser("add", help="serve a new model: the supervisor starts its workers")
    add.add_argument("name")
    add.add_argument("--config")
    add.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    add.add_argument("--path", help="model directory (vllm)")
    add.add_argument("--max-model-len", type=int, default=512)
    add.add_argument("--workers", type=int, default=1, help="how many workers (ids NAME-0, NAME-1, ...)")
    add.add_argument("--max-num-seqs", type=int, default=16)
    add.add_argument(
        "--worker-env", action="append", default=[], metavar="K=V", help="environment for the workers (repeatable)"
    )
    add.add_argument("--wait", action="store_true", help="until a worker of it is ready")
    add.add_argument("--timeout", type=float, default=300.0)
    add.set_defaults(func=cmd_add)
    rm = ms.add_parser("remove", help="stop serving a model: its workers drain, then exit")
    rm.add_argument("name")
    rm.add_argument("--config")
    rm.add_argument("--wait", action="store_true", help="until it is gone (its in-flight requests finished)")
    rm.add_argument("--timeout", type=float, default=300.0)
    rm.set_defaults(func=cmd_remove)


# The admin token's header where the config names one (one command, one config).
_ADMIN: dict[str, str] = {}


def _router(args: argparse.Namespace) -> str:
    from deploy.stack import _http_url
    from shared.keys import admin_headers

    cfg = load(args.config)
    _ADMIN.update(admin_headers(cfg))
    return _http_url(cfg.router.http)


def _call(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    from deploy.runtime_models import _call as call

    try:
        return call(url, body, timeout=10.0, headers=_ADMIN)
    except OSError as e:
        print(
            f"weir models: the router at {url} does not answer ({getattr(e, 'reason', e)}); is the stack "
            f"running (`weir up`)?",
            file=sys.stderr,
        )
        raise SystemExit(1) from None


def _states(router: str) -> dict[str, dict[str, Any]]:
    _, models = _call(router + "/admin/models")
    return {m["name"]: m for m in models}


def cmd_list(args: argparse.Namespace) -> int:
    for m in _states(_router(args)).values():
        print(
            f"{m['name']:<24} {m['state']:<10} ready workers: {m['ready_workers']}"
            + ("  (added at run time)" if m["runtime"] else "")
        )
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    router = _router(args)
    env = dict(kv.split("=", 1) for kv in args.worker_env)
    model = {"name": args.name, "engine": args.engine, "max_model_len": args.max_model_len}
    if args.path:
        model["path"] = args.path
    workers = [
        {"id": f"{args.name}-{i}", "model": args.name, "max_num_seqs": args.max_num_seqs, "env": env}
        for i in range(args.workers)
    ]
    t0 = time.monotonic()
    code, out = _call(router + "/admin/models", {"model": model, "workers": workers})
    if code != 200:
        print(f"weir models add: {out.get('error', out)}", file=sys.stderr)
        return 1
    print(f"model {args.name} added ({args.workers} workers); state {out['state']}")
    if args.wait:
        return _wait(router, args.name, lambda m: m is not None and m["state"] == "ready", "ready", t0, args.timeout)
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    router = _router(args)
    t0 = time.monotonic()
    code, out = _call(router + f"/admin/models/{args.name}/remove", {})
    if code != 200:
        print(f"weir models remove: {out.get('error', out)}", file=sys.stderr)
        return 1
    print(f"model {args.name} {out['state']}")
    if args.wait and out["state"] != "removed":
        return _wait(router, args.name, lambda m: m is None, "removed", t0, args.timeout)
    return 0


def _wait(
    router: str, name: str, done: Callable[[dict[str, Any] | None], bool], what: str, t0: float, timeout: float
) -> int:
    while time.monotonic() - t0 < timeout:
        if done(_states(router).get(name)):
            print(json.dumps({"model": name, "state": what, "seconds": round(time.monotonic() - t0, 3)}))
            return 0
        time.sleep(0.1)
    print(f"weir models: {name} not {what} after {timeout:g} s", file=sys.stderr)
    return 1
