"""A uniquely named /etc/hosts entry for end-to-end tests: one DNS name that
resolves (through the real getaddrinfo, and Envoy's resolver) to several
loopback addresses, as a Kubernetes headless Service resolves to its pods."""

from __future__ import annotations

import os
import uuid

HOSTS = "/etc/hosts"


def writable() -> bool:
    return os.access(HOSTS, os.W_OK)


class HostsName:
    """``set(ips)`` rewrites this name's lines in place (/etc/hosts may be a bind
    mount: no rename); ``set([])`` removes them -- call it in a finally."""

    def __init__(self, prefix: str = "weir-routers") -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}.test"

    def set(self, ips: list[str]) -> None:
        with open(HOSTS) as f:
            keep = [line for line in f.read().splitlines() if not line.endswith(f" {self.name}")]
        with open(HOSTS, "w") as f:
            f.write("\n".join([*keep, *(f"{ip} {self.name}" for ip in ips)]) + "\n")
