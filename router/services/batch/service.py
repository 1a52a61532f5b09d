"""The batch tier in one router: the files and batches it serves, the batches it runs.

``BatchService`` answers the HTTP API (router.ingress.files_batches) from
the directory (router.services.batch.files, router.services.batch.store), and every
``scan_interval_s`` looks for batches no router runs: it takes each one's
lease (router.services.batch.lease) and runs it (router.services.batch.run.BatchRun),
renewing the leases it holds; a lease lost stops that run at once.  So
with several routers over one directory each batch runs on exactly one of
them, and moves to another when its router dies.

A draining router takes no lease from the moment its drain starts, and
hands on each batch it runs as soon as that batch's running lines end
(router.services.batch.run.BatchRun.drain): the lease is released then, not at
its TTL, so another router (or this one, restarted) takes over at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.lifecycle.jobs import RUNNING, job_id_of
from router.services.batch import rules as m
from router.services.batch.files import FileStore
from router.services.batch.host import BatchStats
from router.services.batch.lease import FileLease, Lease, RedisLease
from router.services.batch.run import BatchRun
from router.services.batch.storage import StorageIndex, StorageLimits, limits_for
from router.services.batch.store import BatchRecord, BatchStore, StaleLease
from router.tenancy.ownership import may_see
from shared.config import Config

if TYPE_CHECKING:
    from router.lifecycle.core import RouterCore

log = logging.getLogger("weir.batch")

HANDOFF_S = 5.0  # at close, how long the runs get to write what finished before they are stopped
PREEMPT_S = 0.01  # how often interactive work waiting behind batch lines is looked for


class BatchService:
    """The batch tier of one router; the ``BatchHost`` of the runs it starts (router.services.batch.host)."""

    def __init__(self, core: RouterCore, cfg: Config) -> None:
        self.core = core
        self.bcfg = cfg.batch
        self.max_body_bytes = cfg.envoy.max_request_bytes
        self.max_prompts = cfg.router.max_prompts_per_request  # a completions line's, as a live request's
        root = Path(cfg.resolve(cfg.batch.directory))
        self.index = StorageIndex()  # per tenant: what the API lists and the quotas count
        self.files = FileStore(root, self.index)
        self.store = BatchStore(root, self.index)
        self.indexed = asyncio.Event()  # set once the index has read the directory
        self.housekeeping = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-housekeeping")
        self.pages = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-pages")  # list answers
        self._housekeeping_task: asyncio.Task[None] | None = None
        self.lease: Lease = (
            RedisLease(cfg.quota.redis_url, cfg.quota.redis_prefix, cfg.batch.lease_ttl_s, cfg.quota.redis_timeout_s)
            if cfg.quota.store == "redis"
            else FileLease(self.store.dir)
        )
        names = [c.name for c in cfg.scheduler.classes]
        self.batch_class = "batch" if "batch" in names else names[-1]  # the lowest
        self._batch_rank = names.index(self.batch_class)
        self._preempt_timer: asyncio.TimerHandle | None = None
        self.preempted = 0
        self.windows = {w: s for w in cfg.batch.completion_windows if (s := m.window_seconds(w)) is not None}
        self.io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-io")  # in order
        self.runs: dict[str, BatchRun] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ended: set[str] = set()  # batch ids seen terminal: not read again
        self.stats = BatchStats()
        self._task: asyncio.Task[None] | None = None
        # One scan at a time: a scan awaits between taking a lease and recording its run
        # (the fence is claimed on the I/O thread), and a kick's scan beside the periodic
        # one would find the batch not yet running here and, holding the lease already,
        # start a second run of it: every line answered twice.
        self._scan_lock = asyncio.Lock()
        self._budgets: dict[str, m.DayBudget] = {}
        core.metrics.registry.register(_BatchCollector(self))
        core.batch_tenants = self.tenants
        core.on_keys_reloaded.append(self.recheck_owners)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._scan_forever())
        self._housekeeping_task = asyncio.get_running_loop().create_task(self._housekeep_forever())

    async def _housekeep_forever(self) -> None:
        while True:
            try:
                await self.housekeep()
            except Exception:
                log.exception("batch housekeeping failed")
            await asyncio.sleep(self.bcfg.housekeeping_interval_s)

    async def housekeep(self) -> None:
        """On a thread: the index reads the directory again (built at the first
        pass), then expired files and old ended batches are deleted."""
        loop = asyncio.get_running_loop()
        local = frozenset(self.runs)
        await loop.run_in_executor(self.housekeeping, self.index.refresh, self.files, self.store, local)
        self.indexed.set()
        gone = await loop.run_in_executor(
            self.housekeeping, self.index.reap, self.files, self.store, time.time(), self.bcfg.finished_retention_s
        )
        for bid in gone:
            self._ended.discard(bid)
        if gone:
            log.info("batch housekeeping: %d ended batches past their retention deleted", len(gone))

    def off_loop(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """``fn`` on the API's one thread (router.ingress.files_batches: list
        pages, and batch creates, one at a time)."""
        return asyncio.get_running_loop().run_in_executor(self.pages, fn)

    def limits(self, tenant: str, key_digest: str) -> StorageLimits:
        """The tenant's storage limits as the config reads now (router.services.batch.storage.limits_for)."""
        key = self.core.keys.by_key.get(key_digest) if key_digest else None
        tcfg = next((t for t in self.core.cfg.tenants if t.name == tenant), None)
        return limits_for(self.bcfg, key, tcfg)

    def _arm_preempt(self) -> None:
        """Look for interactive work behind batch lines while a batch runs here.
        Not while none does: its 100 turns a second were most of an idle
        router's CPU (18.0 ms a second with it, 2.7 without; sim stack)."""
        if self.bcfg.preempt and self._preempt_timer is None:
            self._preempt_timer = asyncio.get_running_loop().call_later(PREEMPT_S, self._preempt_tick)

    def _preempt_tick(self) -> None:
        if not self.runs:
            self._preempt_timer = None  # armed again when a batch runs here
            return
        self._preempt_timer = asyncio.get_running_loop().call_later(PREEMPT_S, self._preempt_tick)
        try:
            self.preempt()
        except Exception:
            log.exception("batch preemption failed")

    def preempt(self) -> int:
        """Interactive work waits while batch lines run on its model: take as
        many batch lines off their workers (the newest first: the least work
        redone); the slots go to the waiting work, and the lines resume as
        continuations in the batch class (router.lifecycle.core ``move``), so nothing is
        lost or run twice.  The cost: an interactive burst waits one
        scheduling pass, not a batch line's whole generation."""
        rank = self._batch_rank
        waiting: dict[str, int] = {}
        for name, mq in self.core.policy.models.items():
            n = sum(c[0] + c[1] for r, c in enumerate(mq.totals.size_count) if r != rank)
            if n:
                waiting[name] = n
        if not waiting:
            return 0
        jobs, moved = self.core.jobs, 0
        for run in list(self.runs.values()):
            for handle, sink in reversed(list(run.feeder.in_flight.items())):
                j = jobs.get(job_id_of(handle))
                if sink.preempted or j is None or j.state is not RUNNING or waiting.get(j.sub.model, 0) <= 0:
                    continue
                # once per line: interactive work that a freed slot cannot help (another
                # pool's, say) must not keep a batch line from ever finishing
                sink.preempted = True
                waiting[j.sub.model] -= 1
                self.core.move(j.job_id, "preempted by interactive work")
                moved += 1
        self.preempted += moved
        return moved

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._housekeeping_task is not None:
            self._housekeeping_task.cancel()
        if self._preempt_timer is not None:
            self._preempt_timer.cancel()
        for run in self.runs.values():
            run.drain()  # (a router closes after its drain: nothing runs; this writes what finished)
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=HANDOFF_S)
        for bid, run in list(self.runs.items()):
            run.stop()
            await self.lease.release(bid)
        for t in self._tasks.values():
            t.cancel()
        if isinstance(self.lease, RedisLease):
            await self.lease.close()
        self.io.shutdown(wait=False)
        self.housekeeping.shutdown(wait=False)
        self.pages.shutdown(wait=False)

    def recheck_owners(self) -> None:
        """After a reload: the batches running here whose key was removed or now
        names another tenant are cancelled (router.services.batch.run ``BatchRun.recheck``);
        one not running here is checked when a router takes it up."""
        for run in list(self.runs.values()):
            run.recheck()

    def kick(self) -> None:
        """A batch was created or cancelled here: scan now rather than at the next tick."""
        if self._task is not None:
            asyncio.get_running_loop().create_task(self.scan())

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:
                log.exception("batch scan failed")
            await asyncio.sleep(self.bcfg.scan_interval_s)

    async def scan(self) -> None:
        async with self._scan_lock:
            await self._scan()

    async def _scan(self) -> None:
        draining = self.core.draining
        for bid, run in list(self.runs.items()):
            if draining:
                run.drain()
            if run.ended or bid not in self._tasks or self._tasks[bid].done():
                self._forget(bid)
                await self.lease.release(bid)
                if run.ended:
                    self._ended.add(bid)
            elif not await self.lease.renew(bid):
                log.warning("batch %s: lease lost; another router takes it over", bid)
                run.stop()
                self._forget(bid)
            elif self.store.cancel_requested(bid):
                run.wake.set()
        if draining:
            return  # a draining router takes no batch: the others (or this one, restarted) do
        for bid in self.store.ids():
            if bid in self._ended or bid in self.runs:
                continue
            rec = self.store.load(bid)
            if rec is None:
                continue
            if rec.status in m.TERMINAL:
                self._ended.add(bid)
                continue
            if not await self.lease.acquire(bid):
                continue
            if self.core.draining:  # (began while the lease was asked for)
                await self.lease.release(bid)
                return
            token = self.lease.token(bid)
            loop = asyncio.get_running_loop()
            try:  # the fence first: from here an earlier holder that wakes up writes nothing
                await loop.run_in_executor(self.io, self.store.fence(bid, token).claim)
            except (StaleLease, OSError) as e:
                log.warning("batch %s: not taken (%s)", bid, e)
                await self.lease.release(bid)
                continue
            rec = self.store.load(bid)  # as it is now that we hold it (its last holder may have moved it)
            if rec is None or rec.status in m.TERMINAL:
                await self.lease.release(bid)
                continue
            run = BatchRun(self, rec, token)
            self.runs[bid] = run
            self._arm_preempt()
            self._tasks[bid] = loop.create_task(self._run(bid, run))
            log.info(
                "batch %s: running here (%s, %d of %d done)", bid, rec.status, rec.completed + rec.failed, rec.total
            )

    async def _run(self, bid: str, run: BatchRun) -> None:
        """Run the batch; when the run ends (the batch ended, or handed on by a
        drain) its lease is released at once, not at the next scan or TTL."""
        try:
            await run.main()
        finally:
            if self.runs.get(bid) is run and not run.stopped:
                self._forget(bid)
                if run.ended:
                    self._ended.add(bid)
                await self.lease.release(bid)

    def _forget(self, bid: str) -> None:
        self.runs.pop(bid, None)
        self._tasks.pop(bid, None)

    # ------------------------------------------------------------ what the API reads and does

    def create(
        self,
        owner: str,
        key_digest: str,
        input_file_id: str,
        endpoint: str,
        window: str,
        metadata: dict[str, str] | None,
        output_expires_after_s: int | None = None,
    ) -> BatchRecord:
        now = int(time.time())
        return self.store.new(
            owner=owner,
            key_digest=key_digest,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=window,
            created_at=now,
            expires_at=now + self.windows[window],
            metadata=metadata,
            output_expires_after_s=output_expires_after_s,
        )

    def get(self, owner: str, batch_id: str) -> BatchRecord | None:
        run = self.runs.get(batch_id)
        rec = run.rec if run is not None else self.store.load(batch_id)
        return rec if rec is not None and may_see(rec.owner, owner) else None

    def list(self, owner: str, after: str | None, limit: int) -> list[BatchRecord] | None:
        """A page of the tenant's batches, newest first, from the index (no disk read;
        one more than ``limit`` if there are more); those running here as they are now."""
        page = self.index.batches_page(owner, after, limit)
        if page is None:
            return None
        return [run.rec if (run := self.runs.get(r.id)) is not None else r for r in page]

    def visible(self, owner: str, batch_id: str) -> BatchRecord | None:
        """The tenant's batch as its state file reads (a thread: it reads the disk), else None."""
        rec = self.store.load(batch_id)
        return rec if rec is not None and may_see(rec.owner, owner) else None

    async def cancel(self, rec: BatchRecord) -> BatchRecord:
        """Ask for the cancel (whichever router runs it acts on it; written on the
        API thread: OSError if it cannot be); the object as it will be."""
        await self.off_loop(lambda: self.store.request_cancel(rec.id))
        run = self.runs.get(rec.id)
        if run is not None:
            run.wake.set()
        shown = BatchRecord(**{f: getattr(rec, f) for f in rec.__struct_fields__})
        shown.stamps = dict(rec.stamps)
        if shown.status in (m.IN_PROGRESS, m.VALIDATING):
            shown.status = m.CANCELLING
            shown.stamps[m.STAMP[m.CANCELLING]] = int(time.time())
        return shown

    def _budget(self, tenant: str) -> m.DayBudget | None:
        """The tenant's batch_tokens_per_day bucket (this router's), as the config reads now."""
        limit = next((t.batch_tokens_per_day for t in self.core.cfg.tenants if t.name == tenant), None)
        if limit is None:
            self._budgets.pop(tenant, None)
            return None
        b = self._budgets.get(tenant)
        if b is None or b.capacity != limit:
            b = self._budgets[tenant] = m.DayBudget(limit, time.monotonic())
        return b

    def budget_allows(self, tenant: str) -> bool:
        b = self._budget(tenant)
        return b is None or b.allows(time.monotonic())

    def charge(self, tenant: str, tokens: int) -> None:
        b = self._budget(tenant)
        if b is not None:
            b.charge(tokens, time.monotonic())

    def tenants(self) -> dict[str, Any]:
        """Batch lines and tokens per tenant finished on this router, and what each
        tenant stores against its limits (for /admin/tenants)."""
        out: dict[str, Any] = {}
        for t, (c, f, tok) in sorted(self.stats.by_tenant.items()):
            b = self._budgets.get(t)
            out[t] = {"completed": c, "failed": f, "tokens": tok}
            if b is not None:
                out[t]["batch_tokens_per_day"] = {"limit": b.capacity, "left": int(b.level)}
        default = limits_for(self.bcfg, None, None)
        tenant_limits = {t.name: limits_for(self.bcfg, None, t) for t in self.core.cfg.tenants}
        for t in self.index.tenants():
            used, lim = self.index.usage(t), tenant_limits.get(t, default)
            out.setdefault(t, {"completed": 0, "failed": 0, "tokens": 0})["storage"] = {
                "files": used.files,
                "file_bytes": used.file_bytes,
                "active_batches": used.active_batches,
                "limits": lim._asdict(),
            }
        return out


class _BatchCollector:
    """The batch tier's series on /metrics."""

    def __init__(self, svc: BatchService) -> None:
        self.svc = svc

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        svc = self.svc
        lines = GaugeMetricFamily(
            "weir_batch_lines", "Lines of the batches this router runs, by state", labels=["batch", "state"]
        )
        eta = GaugeMetricFamily(
            "weir_batch_eta_seconds",
            "Predicted time to finish each running batch (at its rate so far)",
            labels=["batch"],
        )
        left = GaugeMetricFamily(
            "weir_batch_window_left_seconds", "Time left in each running batch's completion window", labels=["batch"]
        )
        by_model = GaugeMetricFamily(
            "weir_batch_model_lines",
            "Batch lines queued or running per model (what autoscaling leaves out: [batch] autoscale_weight)",
            labels=["model", "state"],
        )

        per_model: dict[tuple[str, str], int] = {}
        jobs = svc.core.jobs
        for run in svc.runs.values():
            for handle in run.feeder.in_flight:
                j = jobs.get(job_id_of(handle))
                if j is not None:
                    key = (j.sub.model, "running" if j.state is RUNNING else "queued")
                    per_model[key] = per_model.get(key, 0) + 1
        for (model, state), n in sorted(per_model.items()):
            by_model.add_metric([model, state], n)
        yield by_model
        paused = GaugeMetricFamily(
            "weir_batch_disk_full_seconds",
            "How long each running batch has waited for room on a full disk (absent: not waiting)",
            labels=["batch"],
        )
        now = time.time()
        running_batch = 0
        for bid, run in sorted(svc.runs.items()):
            rec = run.rec
            queued = run.feeder.queued()
            running = len(run.feeder.in_flight) - queued
            running_batch += running
            done = rec.completed + rec.failed
            lines.add_metric([bid, "queued"], queued)
            lines.add_metric([bid, "running"], running)
            lines.add_metric([bid, "done"], done)
            lines.add_metric([bid, "pending"], max(0, rec.total - done - len(run.feeder.in_flight)))
            e = run.eta_s()
            if e is not None:
                eta.add_metric([bid], e)
            left.add_metric([bid], max(0.0, rec.expires_at - now))
            since = run.results.disk_full_since
            if since is not None:
                paused.add_metric([bid], time.monotonic() - since)
        share = GaugeMetricFamily(
            "weir_batch_slot_share", "Batch lines among the jobs running on engines (0..1), this router's"
        )
        core = svc.core
        total_running = sum(1 for j in core.jobs.values() if j.state is RUNNING) if svc.runs else 0
        share.add_metric([], running_batch / total_running if total_running else 0.0)
        done_t = CounterMetricFamily(
            "weir_batch_lines_done", "Batch lines finished per tenant on this router", labels=["tenant", "outcome"]
        )
        tokens_t = CounterMetricFamily(
            "weir_batch_tokens", "Batch tokens (prompt + completion) per tenant", labels=["tenant"]
        )
        for t, (c, f, tok) in sorted(svc.stats.by_tenant.items()):
            done_t.add_metric([t, "completed"], c)
            done_t.add_metric([t, "failed"], f)
            tokens_t.add_metric([t], tok)
        yield tokens_t
        sent = CounterMetricFamily("weir_batch_lines_sent", "Batch lines submitted to the scheduler (retries included)")
        sent.add_metric([], svc.stats.sent)
        retried = CounterMetricFamily(
            "weir_batch_lines_retried", "Batch lines refused for room or budget and sent again later"
        )
        retried.add_metric([], svc.stats.retried)
        pre = CounterMetricFamily(
            "weir_batch_lines_preempted", "Running batch lines taken off a worker for waiting interactive work"
        )
        pre.add_metric([], svc.preempted)
        yield from (lines, eta, left, paused, share, done_t, sent, retried, pre)
