"""``weir``: run the stack and its tools.

weir up [--config PATH] [--run-dir DIR]   whole stack in the foreground
weir render-envoy [--config PATH] [-o FILE] [--validate]
weir render-k8s [--config PATH] [-o DIR]   Kubernetes manifests (deploy/k8s/)
weir bench ...                            load generator (bench/cli.py)
weir make-model [DIR] [--embed]           tiny local Llama (or embedding model) for CPU runs
weir keys new --tenant T [--tier high] [--tokens-per-minute N]   an API key, printed once
weir keys curve DIR                       CURVE key pairs for the ZeroMQ planes
weir stats [--config PATH] [--json]       live view of the whole stack (or one JSON snapshot)
weir models list|add|remove|add-adapter|remove-adapter ...   models and LoRA adapters of a running stack
weir restart [router|workers|envoy|all]   restart a running `weir up`'s components one by one, losing no request
weir batches submit|list|show|download|cancel ...   offline batches (OpenAI's Batch API)
weir router|worker ...                    one component (python -m router / engine_worker)
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from shared.config import ConfigError, load

if TYPE_CHECKING:
    from deploy.stack import Stack


class _Shutdown(Exception):
    pass


def _banner(stack: Stack) -> str:
    cfg = stack.cfg
    served: dict[str, list[str]] = {}
    for w in cfg.workers:
        if w.id in stack.worker_ids:
            served.setdefault(w.model, []).append(w.id)
    models = "\n".join(
        f"    {m:<24} workers: {', '.join(ids)}" + ("  (simulated engine)" if cfg.model(m).engine == "sim" else "")
        for m, ids in served.items()
    )
    model = next((m for m in served if cfg.model(m).engine != "sim"), next(iter(served), "MODEL"))
    key = ' -H "x-api-key: $WEIR_API_KEY"' if cfg.api_keys else ""  # keys are never printed
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32, "stream": true}'
    )
    return f"""
weir is up.
  OpenAI API (via Envoy):  {stack.envoy_url}/v1
  router direct (HTTP):    {"  ".join(stack.router_urls)}   (/v1, /admin/workers)
  ZeroMQ frontend:         {"  ".join(stack.zmq_frontends)}   (shared.client)
  Envoy admin:             {stack.admin_url}   (/stats, /stats/prometheus, /clusters)
  metrics (Prometheus):    {stack.metrics_url}
  models:
{models}
  logs:                    {stack.run_dir}
  live view:               weir stats --config {shlex.quote(str(stack.cfg_path))}

Try:
  curl -N {stack.envoy_url}/v1/chat/completions -H 'content-type: application/json'{key} \\
    -d {shlex.quote(body)}

Ctrl-C (or SIGTERM) stops everything.
""".rstrip("\n")


def cmd_up(args: argparse.Namespace) -> int:
    from deploy import restart
    from deploy.envoy_config import EnvoyValidationError
    from deploy.stack import Stack, StackError, StackInterrupted

    def say(msg: str) -> None:
        print(f"[weir] {msg}", flush=True)

    stack = Stack(args.config, args.run_dir, progress=say, supervise=True)

    def on_stop(signum: int, _frame: FrameType | None) -> NoReturn:
        stack.stop_requested = signal.Signals(signum).name  # (if the exception is lost, the next poll sees this)
        raise _Shutdown(stack.stop_requested)

    rolling = threading.Event()  # SIGHUP: restart every worker, one by one, losing no request
    restart_asked = threading.Event()  # SIGUSR1: `weir restart` left a request in the run dir
    t0 = time.monotonic()
    rc = 0
    try:
        # Ctrl-C / SIGTERM interrupt whatever we are doing (start-up included);
        # Stack.start and the finally below stop every child.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_stop)
        signal.signal(signal.SIGHUP, lambda *_: rolling.set())
        signal.signal(signal.SIGUSR1, lambda *_: restart_asked.set())
        say(f"config {stack.cfg_path}; run dir {stack.run_dir}")
        # A signal blocked by whoever started us stays blocked across exec and
        # would never reach the handlers above (unblocked once they are all in,
        # here: one already pending is then handled as any other).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1})
        stack.start()
        say(f"everything ready in {time.monotonic() - t0:.1f} s")
        restart.announce(stack.cfg_path, stack.run_dir)
        print(_banner(stack), flush=True)
        # The supervisor restarts whatever exits (it says so); a crash loop of
        # Envoy or of every router ends the stack, a worker's leaves it down.
        while not stack.stop_requested:
            time.sleep(0.5)
            if rolling.is_set():
                rolling.clear()
                # Apply the config again, losing no request: the router reloads
                # keys and budgets (its own SIGHUP), the workers restart one by one.
                say("SIGHUP: router reloads keys and budgets; rolling restart of the workers")
                for name in stack.router_names:
                    stack.components[name].signal_group(signal.SIGHUP)
                stack.rolling_restart()
            if restart_asked.is_set():
                restart_asked.clear()
                restart.serve_request(stack, say)
            down = stack.failed & {"envoy", *stack.router_names}
            if "envoy" in down or set(stack.router_names) <= down:  # (while a router is left, it serves)
                say(f"error: {', '.join(sorted(down))} in a crash loop: stopping")
                rc = 1
                break
    except (_Shutdown, StackInterrupted):
        pass
    except (StackError, EnvoyValidationError) as e:
        say(f"error: {e}")
        rc = 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        if stack.stop_requested:
            say(f"{stack.stop_requested}: stopping")
        restart.forget(stack.cfg_path)
        stack.stop()
        say("stopped")
    return rc


def cmd_restart(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deploy import restart
    from shared.config import DEFAULT_CONFIG

    cfg_path = Path(args.config or os.environ.get("WEIR_CONFIG") or DEFAULT_CONFIG)
    run_dir = Path(args.run_dir) if args.run_dir else None
    return restart.ask(cfg_path, args.what, run_dir, args.timeout, lambda line: print(f"[weir] {line}", flush=True))


def cmd_render_envoy(args: argparse.Namespace) -> int:
    from deploy import envoy_config

    text = envoy_config.render(load(args.config))
    if args.validate:
        envoy_config.validate(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_render_k8s(args: argparse.Namespace) -> int:
    from deploy import k8s

    cfg = load(args.config)
    for path in k8s.write(cfg, args.output):
        print(path)
    if not cfg.api_keys:  # (rendered only with kubernetes.allow_anonymous = true)
        print(
            "\n#### WARNING: NO API KEYS. kubernetes.allow_anonymous = true: every client that reaches Envoy is\n"
            "#### the one anonymous tenant and can read, download and delete everyone's files, batches and\n"
            "#### stored responses. Add [[api_keys]] (`weir keys new`) for anything but a demo.",
            file=sys.stderr,
        )
    from deploy.k8s_security import secret_commands

    commands = secret_commands(cfg, k8s.worker_groups(cfg))
    if commands:  # key material stays out of the manifests: the Secrets they mount come from these
        print("\n# create the Secrets the pods mount (key material is never rendered):", file=sys.stderr)
        for cmd in commands:
            print(shlex.join(cmd), file=sys.stderr)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from weir.stats import run

    return run(
        load(args.config),
        routers=args.router,
        envoy_admin=args.envoy_admin,
        as_json=args.json,
        interval=args.interval,
        count=args.count,
    )


def cmd_make_model(args: argparse.Namespace) -> int:
    from deploy.make_model import build

    embed = args.embed
    path = build(args.dir or ("models/tiny-embed" if embed else "models/tiny-llama"), embed=embed)
    print(f"tiny {'embedding ' if embed else ''}model written to {path}")
    return 0


def _passthrough(module: str, argv: list[str]) -> int:
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])  # replaces this process: never returns


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Tools with their own argument parsers get the rest of the line untouched.
    if argv and argv[0] == "bench":
        from bench.cli import main as bench_main

        return bench_main(argv[1:]) or 0
    if argv and argv[0] in ("router", "worker"):
        return _passthrough("router" if argv[0] == "router" else "engine_worker", argv[1:])

    ap = argparse.ArgumentParser(prog="weir", description="Envoy-fronted ZeroMQ dataplane for LLM inference")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start Envoy, the router and the workers in the foreground")
    up.add_argument("--config", help="TOML config (default: $WEIR_CONFIG or deploy/weir.toml)")
    up.add_argument("--run-dir", help="where logs and the rendered Envoy config go (default: a new temp dir)")
    up.set_defaults(func=cmd_up)
    rs = sub.add_parser("restart", help="restart a running `weir up`'s components one by one, losing no request")
    rs.add_argument("what", nargs="?", default="all", choices=["router", "workers", "envoy", "all"])
    rs.add_argument("--config", help="the config `weir up` runs (default: $WEIR_CONFIG or deploy/weir.toml)")
    rs.add_argument("--run-dir", help="the run dir of that `weir up` (instead of finding it by its config)")
    rs.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for it all (default 600)")
    rs.set_defaults(func=cmd_restart)
    rend = sub.add_parser("render-envoy", help="print Envoy's YAML rendered from the config")
    rend.add_argument("--config")
    rend.add_argument("-o", "--output", help="write to FILE instead of stdout")
    rend.add_argument("--validate", action="store_true", help="also run `envoy --mode validate`")
    rend.set_defaults(func=cmd_render_envoy)
    rk = sub.add_parser("render-k8s", help="write the Kubernetes manifests rendered from the config")
    rk.add_argument("--config")
    rk.add_argument("-o", "--output", default="deploy/k8s", help="directory (default: deploy/k8s)")
    rk.set_defaults(func=cmd_render_k8s)
    st = sub.add_parser("stats", help="live view of Envoy, routers, workers, tenants (rich); --json: one snapshot")
    st.add_argument("--config", help="TOML config: where the router and Envoy's admin listen")
    st.add_argument("--json", action="store_true", help="print one snapshot as JSON (rates over --interval) and exit")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default 1)")
    st.add_argument("--router", action="append", help="a router's HTTP URL (repeatable; default: the config's)")
    st.add_argument("--envoy-admin", help="Envoy admin URL (default: the config's)")
    st.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)  # refreshes, then exit (tests)
    st.set_defaults(func=cmd_stats)
    mm = sub.add_parser("make-model", help="build the tiny random Llama used on CPU")
    mm.add_argument("dir", nargs="?", default=None, help="default: models/tiny-llama (models/tiny-embed with --embed)")
    mm.add_argument("--embed", action="store_true", help="the tiny embedding (pooling) model instead")
    mm.set_defaults(func=cmd_make_model)
    from weir import batches_cli, keys_cli, models_cli

    keys_cli.add_parser(sub)
    models_cli.add_parser(sub)
    batches_cli.add_parser(sub)
    sub.add_parser("bench", help="load generator: weir bench --help")
    sub.add_parser("router", help="run the router alone (python -m router ...)")
    sub.add_parser("worker", help="run one engine worker (python -m engine_worker ...)")

    args = ap.parse_args(argv)
    try:
        rc: int = args.func(args)  # the subcommand's cmd_* function
        return rc
    except ConfigError as e:
        print(f"weir: config error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"weir: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
