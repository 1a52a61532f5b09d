"""What a batch run needs of the router that runs it (``BatchHost``), and the counters it adds to.

Declared here, below both: the run (router.services.batch.run, its
feeder and its results) reads its host through this Protocol, and the
service (router.services.batch.service.BatchService) is that host without the
run importing it.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.lifecycle.core import RouterCore
    from router.services.batch.files import FileStore
    from router.services.batch.store import BatchStore
    from shared.config import BatchConfig


class BatchStats:
    """Counters for /metrics and /admin/tenants (this router's share)."""

    def __init__(self) -> None:
        self.sent = 0
        self.retried = 0
        self.by_tenant: dict[str, list[int]] = {}  # tenant -> [completed, failed, tokens]

    def line_done(self, tenant: str, completed: int, failed: int, tokens: int = 0) -> None:
        row = self.by_tenant.setdefault(tenant, [0, 0, 0])
        row[0] += completed
        row[1] += failed
        row[2] += tokens


class BatchHost(Protocol):
    """The router's side of a running batch: its core, config, stores, I/O thread and counters."""

    @property
    def core(self) -> RouterCore: ...

    @property
    def bcfg(self) -> BatchConfig: ...

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def max_prompts(self) -> int: ...

    @property
    def files(self) -> FileStore: ...

    @property
    def store(self) -> BatchStore: ...

    @property
    def io(self) -> Executor:
        """The one batch I/O thread: results and states are written on it, in order."""

    @property
    def batch_class(self) -> str: ...

    @property
    def stats(self) -> BatchStats: ...

    def budget_allows(self, tenant: str) -> bool:
        """The tenant's batch_tokens_per_day has tokens left."""

    def charge(self, tenant: str, tokens: int) -> None: ...
