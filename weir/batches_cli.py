"""``weir batches submit|list|show|download``: the Batch API from the shell,
through Envoy with the openai SDK (as any OpenAI client would).

    weir batches submit requests.jsonl --endpoint /v1/chat/completions --watch
    weir batches list
    weir batches show batch_... --watch          # a progress bar until it ends
    weir batches download batch_... -o results/  # output and error JSONL

The key: ``--api-key``, else ``$WEIR_API_KEY`` or ``$OPENAI_API_KEY``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from shared.config import load

ENDED = ("completed", "failed", "expired", "cancelled")


def add_parser(sub: Any) -> None:
    b = sub.add_parser("batches", help="submit, follow and download offline batches (OpenAI's Batch API)")
    bs = b.add_subparsers(dest="batches_cmd", required=True)

    def common(p: Any) -> None:
        p.add_argument("--config")
        p.add_argument("--base-url", help="default: the config's Envoy listener + /v1")
        p.add_argument("--api-key")

    s = bs.add_parser("submit", help="upload a JSONL file and start a batch on it")
    s.add_argument("file")
    s.add_argument("--endpoint", default="/v1/chat/completions")
    s.add_argument("--window", default="24h", help="completion window (the router's [batch] completion_windows)")
    s.add_argument("--watch", action="store_true", help="show progress until it ends")
    common(s)
    s.set_defaults(func=cmd_submit)
    ls = bs.add_parser("list", help="your batches, newest first")
    common(ls)
    ls.set_defaults(func=cmd_list)
    sh = bs.add_parser("show", help="one batch: status, counts, usage; --watch: a progress bar until it ends")
    sh.add_argument("id")
    sh.add_argument("--watch", action="store_true")
    common(sh)
    sh.set_defaults(func=cmd_show)
    dl = bs.add_parser("download", help="write a batch's output and error files")
    dl.add_argument("id")
    dl.add_argument("-o", "--out", default=".", help="directory (default: here)")
    common(dl)
    dl.set_defaults(func=cmd_download)
    cn = bs.add_parser("cancel", help="stop feeding a batch (running lines finish)")
    cn.add_argument("id")
    common(cn)
    cn.set_defaults(func=cmd_cancel)


def _client(args: Any) -> Any:
    import openai

    from deploy.stack import _http_url

    cfg = load(args.config)
    base = args.base_url or _http_url(cfg.envoy.listen, "https" if cfg.envoy.tls_cert_file else "http") + "/v1"
    key = args.api_key or os.environ.get("WEIR_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=3, timeout=60)


def _line(b: Any) -> str:
    c = b.request_counts
    counts = f"{c.completed + c.failed}/{c.total} done ({c.failed} failed)" if c is not None else ""
    return f"{b.id}  {b.status:<11} {b.endpoint:<22} {counts}"


def cmd_submit(args: Any) -> int:
    client = _client(args)
    path = Path(args.file)
    with open(path, "rb") as f:
        up = client.files.create(file=(path.name, f), purpose="batch")
    b = client.batches.create(input_file_id=up.id, endpoint=args.endpoint, completion_window=args.window)
    print(f"uploaded {path} as {up.id} ({up.bytes} bytes)")
    print(_line(b))
    return _watch(client, b.id) if args.watch else 0


def cmd_list(args: Any) -> int:
    for b in _client(args).batches.list(limit=100).data:  # the newest 100 (a page holds at most 100)
        print(_line(b))
    return 0


def cmd_show(args: Any) -> int:
    client = _client(args)
    if args.watch:
        return _watch(client, args.id)
    b = client.batches.retrieve(args.id)
    print(_line(b))
    if b.usage is not None:
        print(f"  tokens: {b.usage.input_tokens} in, {b.usage.output_tokens} out")
    for e in (b.errors.data if b.errors and b.errors.data else []) or []:
        print(f"  error: line {e.line}: {e.code}: {e.message}")
    return 0


def _watch(client: Any, batch_id: str) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task(batch_id, total=None)
        while True:
            b = client.batches.retrieve(batch_id)
            c = b.request_counts
            if c is not None and c.total:
                bar.update(task, total=c.total, completed=c.completed + c.failed, description=f"{batch_id} {b.status}")
            if b.status in ENDED:
                break
            time.sleep(1.0)
    print(_line(b))
    return 0 if b.status == "completed" else 1


def cmd_download(args: Any) -> int:
    client = _client(args)
    b = client.batches.retrieve(args.id)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wrote = 0
    for fid, name in ((b.output_file_id, "output"), (b.error_file_id, "errors")):
        if fid:
            dest = out / f"{b.id}_{name}.jsonl"
            dest.write_bytes(client.files.content(fid).content)
            print(f"{dest}")
            wrote += 1
    if not wrote:
        print(f"{b.id} is {b.status}: no results yet", file=sys.stderr)
        return 1
    return 0


def cmd_cancel(args: Any) -> int:
    print(_line(_client(args).batches.cancel(args.id)))
    return 0
