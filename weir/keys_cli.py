"""``weir keys new`` (an API key, printed once, and its config entry) and
``weir keys curve DIR`` (CURVE key pairs for the ZeroMQ planes)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:  # argparse's subparsers action
    keys = sub.add_parser("keys", help="API keys and CURVE keys")
    ks = keys.add_subparsers(dest="keys_cmd", required=True)
    new = ks.add_parser("new", help="a fresh API key, printed once, and the [[api_keys]] entry to paste")
    new.add_argument("--tenant", required=True)
    new.add_argument("--tier", default="normal", help="a scheduler class (default: normal)")
    new.add_argument("--requests-per-minute", type=int)
    new.add_argument("--tokens-per-minute", type=int)
    new.add_argument("--tokens-per-day", type=int)
    new.set_defaults(func=cmd_new)
    curve = ks.add_parser("curve", help="CURVE key pairs: the router's, each worker's, each client's")
    curve.add_argument("dir")
    curve.add_argument(
        "--config", help="take the worker ids from this config (default: $WEIR_CONFIG or deploy/weir.toml)"
    )
    curve.add_argument("--workers", help="comma-separated worker ids (instead of the config's)")
    curve.add_argument("--clients", default="client", help="comma-separated client names (default: client)")
    curve.set_defaults(func=cmd_curve)


def entry(args: argparse.Namespace, sha256: str) -> str:
    lines = ["[[api_keys]]", f'key_sha256 = "{sha256}"', f'tenant = "{args.tenant}"', f'tier = "{args.tier}"']
    for field in ("requests_per_minute", "tokens_per_minute", "tokens_per_day"):
        v = getattr(args, field)
        if v is not None:
            lines.append(f"{field} = {v}")
    return "\n".join(lines)


def cmd_new(args: argparse.Namespace) -> int:
    from shared.keys import digest, new_key

    key = new_key()
    print(f"# API key (shown once; weir keeps only its SHA-256):\n{key}\n\n# paste into the config:")
    print(entry(args, digest(key)))
    return 0


def cmd_curve(args: argparse.Namespace) -> int:
    from shared import curve

    if args.workers is not None:
        workers = [w for w in args.workers.split(",") if w]
    else:
        from shared.config import load

        workers = [w.id for w in load(args.config).workers]
    clients = [c for c in args.clients.split(",") if c]
    made = curve.generate(args.dir, workers, clients)
    for path in made:
        print(f"wrote {path}")
    print(
        f'\n[security]\ncurve = true\ncurve_dir = "{args.dir}"\n\n# workers read {args.dir}/workers/<id>.key_secret;'
        f' a client takes Client(..., curve=("{args.dir}/clients/NAME.key_secret", "{args.dir}/router.key"))'
    )
    return 0
