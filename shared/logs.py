"""How the router and the workers log: plain text or JSON lines ([logging] format).

A record about a request carries its request id (``extra={"request_id": ...}``,
HTTP's x-request-id end to end); in text it is part of the message, in JSON
it is also its own field, so a log shipper can join the router's, the
worker's and Envoy's lines of one request.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():  # extra={...} fields
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def use_json(component: str) -> None:
    """JSON lines from here on, to stderr (the supervisor's log file); text
    stays each process's own ``logging.basicConfig`` format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
