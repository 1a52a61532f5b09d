"""Property test of several routers over one fleet (README: Scaling out).

K routers -- each a real ``router.policy.Policy`` with its own queues and
ledger -- dispatch to the same workers; each worker's own ledger
(``engine_worker.ledger``) admits or refuses every dispatch.  Messages travel
on FIFO channels per (router, worker) pair, as a DEALER/ROUTER link does,
and hypothesis interleaves submits, deliveries in either direction,
finishes, heartbeats, router restarts, partitions, worker restarts and a
worker that times one router out alone (it registers again while that
router still sends to it: each Dispatch carries the epoch of the Register
it was sent under, and the worker drops one of a replaced registration --
shared.protocol.Register.epoch).

Checked after every step:
* no worker's engine ever holds more KV tokens or sequences than its budget
  (whatever each router believes);
* what an engine runs is exactly what its ledger holds;
* no request runs on two workers at once;
and after everything settles: every request a router admitted ended (none
lost in a refusal or a loss), every ledger and every router's reservation
back to 0.  The router side of a refusal is the same as RouterCore.refused:
``Policy.refused`` then ``submit(requeue=True)``.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine_worker.ledger import Ledger
from router.policy import AbortJob, DispatchJob, Job, Policy, RejectJob, WorkerSpec
from shared.config import SchedulerConfig
from shared.protocol import Pool, TaskType

CAPACITY, BLOCK, SEQS = 4096, 16, 4
SCHED = SchedulerConfig(generation_deadline_s=0.0)


def spec(w: int) -> WorkerSpec:
    return WorkerSpec(
        worker_id=f"w{w}",
        model="m",
        pool=Pool.ANY,
        capacity_tokens=CAPACITY,
        block_size=BLOCK,
        max_num_seqs=SEQS,
        max_model_len=4096,
    )


class Fleet:
    """K routers x W workers and the channels between them."""

    def __init__(self, k: int, n_workers: int, fenced: bool = True) -> None:
        self.k, self.n = k, n_workers
        self.now = 0.0
        self.down: set[tuple[int, int]] = set()  # (router, worker) pairs partitioned
        self.policies = [self._new_router(r) for r in range(k)]
        self.ledgers = [Ledger(SCHED.kv_budget(CAPACITY), SCHED.seq_slots(SEQS)) for _ in range(n_workers)]
        self.engines: list[dict[tuple[int, str], int]] = [{} for _ in range(n_workers)]  # (router, id) -> tokens
        self.to_worker: dict[tuple[int, int], deque] = {(r, w): deque() for r in range(k) for w in range(n_workers)}
        self.to_router: dict[tuple[int, int], deque] = {(r, w): deque() for r in range(k) for w in range(n_workers)}
        self.admitted: list[set[str]] = [set() for _ in range(k)]  # live jobs each router answers for
        self.jobs: list[dict[str, Job]] = [{} for _ in range(k)]  # what a requeue after a loss needs
        self.seq = 0
        self.refusals = 0
        self.fenced = fenced  # the worker drops a Dispatch of a replaced registration (False: the race, unfenced)
        self.epochs = [[0] * k for _ in range(n_workers)]  # [w][r]: the worker's current registration with r
        self.known = [[0] * n_workers for _ in range(k)]  # [r][w]: the registration router r has read last
        self.stale_dropped = 0

    def _new_router(self, r: int) -> Policy:
        """A router process just started: it knows only the workers that
        registered with it -- as router.fleet.worker_link.WorkerLink, whose table
        starts empty and fills only in _on_register.  A worker partitioned
        from it cannot register (nor hear the Goodbye that makes it); it
        joins at heal (_rejoin)."""
        p = Policy(SCHED)
        for w in range(self.n):
            if (r, w) not in self.down:
                p.add_worker(spec(w), self.now)
        return p

    # -- router side -------------------------------------------------------------

    def schedule(self, r: int) -> None:
        for a in self.policies[r].schedule(self.now):
            if isinstance(a, DispatchJob):
                w = int(a.worker_id[1:])
                cost = self.policies[r].cost_of(a.job_id)
                self.to_worker[(r, w)].append(("dispatch", a.job_id, cost, self.known[r][w]))
            elif isinstance(a, (RejectJob, AbortJob)):
                self.admitted[r].discard(a.job_id)

    def submit(self, r: int, prompt: int, max_tokens: int) -> None:
        self.seq += 1
        job = Job(f"j{self.seq}", "m", "t", "normal", prompt, max_tokens, TaskType.AUTO, self.now)
        if self.policies[r].submit(job, self.now) is None:
            self.admitted[r].add(job.job_id)
            self.jobs[r][job.job_id] = job
        self.schedule(r)

    def deliver_to_router(self, r: int, w: int) -> None:
        ch = self.to_router[(r, w)]
        if not ch:
            return
        msg = ch.popleft()
        p = self.policies[r]
        wid = f"w{w}"
        if msg[0] == "final":
            if p.worker_of(msg[1]) == wid:
                p.finish(msg[1], self.now)
                self.admitted[r].discard(msg[1])
        elif msg[0] == "refuse":
            _, ids, other_tokens, other_seqs = msg
            p.update_worker(wid, self.now, other_tokens=other_tokens, other_seqs=other_seqs)
            for job_id in ids:
                if p.worker_of(job_id) == wid:
                    entry = p.entries[job_id]
                    p.refused(job_id, self.now)
                    assert p.submit(entry.job, self.now, requeue=True) is None
        elif msg[0] == "heartbeat":
            p.update_worker(wid, self.now, other_tokens=msg[1], other_seqs=msg[2])
        elif msg[0] == "register":  # WorkerLink._on_register: a known worker registering again ran nothing
            self._rejoin(r, w)
        self.schedule(r)

    # -- worker side -------------------------------------------------------------

    def deliver_to_worker(self, r: int, w: int) -> None:
        ch = self.to_worker[(r, w)]
        if not ch:
            return
        _, job_id, tokens, epoch = ch.popleft()
        if self.fenced and epoch != self.epochs[w][r]:
            self.stale_dropped += 1  # sent before router r read our new Register: it runs the job elsewhere
            return
        ledger = self.ledgers[w]
        if ledger.admit(r, job_id, tokens):
            self.engines[w][(r, job_id)] = tokens
        else:
            self.refusals += 1
            self.to_router[(r, w)].append(("refuse", [job_id], *ledger.others(r)))

    def finish(self, w: int, i: int) -> None:
        running = sorted(self.engines[w])
        if not running:
            return
        r, job_id = running[i % len(running)]
        del self.engines[w][(r, job_id)]
        self.ledgers[w].release(r, job_id)
        self.to_router[(r, w)].append(("final", job_id))

    def heartbeat(self, r: int, w: int) -> None:
        if (r, w) not in self.down:
            self.to_router[(r, w)].append(("heartbeat", *self.ledgers[w].others(r)))

    # -- failures ----------------------------------------------------------------

    def _worker_forgets(self, r: int, w: int) -> None:
        for job_id in self.ledgers[w].drop(r):
            del self.engines[w][(r, job_id)]
        self.to_worker[(r, w)].clear()
        self.to_router[(r, w)].clear()

    def restart_router(self, r: int) -> None:
        """SIGKILL and supervisor restart: its clients got an error; the
        workers hear Goodbye (unknown worker), forget what it ran and
        register anew.  The new process knows a worker only by the Register
        it reads, so it stamps that registration's epoch -- not the one the
        old process last read (a worker that had timed the old one out holds
        a newer epoch, its Register lost with the old process)."""
        for w in range(self.n):
            self._worker_forgets(r, w)
            if (r, w) not in self.down:  # (one partitioned from it registers at heal: _rejoin)
                self.epochs[w][r] += 1
                self.known[r][w] = self.epochs[w][r]
        self.policies[r] = self._new_router(r)
        self.admitted[r].clear()
        self.jobs[r].clear()

    def partition(self, r: int, w: int) -> None:
        """Router r and worker w cannot reach each other: each side times the
        other out (router: heartbeat_liveness; worker: its link's liveness)."""
        if (r, w) in self.down:
            return
        self.down.add((r, w))
        self._worker_forgets(r, w)
        lost = self.policies[r].remove_worker(f"w{w}", self.now)
        for (
            job_id
        ) in lost:  # Recovery.after_loss (router.lifecycle.recovery): nothing streamed in this model: queued again
            self._requeue_lost(r, job_id)
        self.schedule(r)

    def worker_times_out(self, r: int, w: int) -> None:
        """Worker w hears nothing from router r for its liveness (r's loop
        stalled, say) while r still counts w alive: w forgets r's jobs, drops
        its old socket (what was in flight on it is gone), connects again and
        registers anew.  Router r keeps dispatching to w until it reads that
        Register; what it sends meanwhile arrives on the new link."""
        if (r, w) in self.down:
            return
        self._worker_forgets(r, w)
        self.epochs[w][r] += 1
        self.to_router[(r, w)].append(("register",))

    def heal(self, r: int, w: int) -> None:
        if (r, w) in self.down:
            self.down.discard((r, w))
            self._rejoin(r, w)

    def restart_worker(self, w: int) -> None:
        """The worker process restarted: an empty engine, a new ledger; it
        registers again with every router it can reach."""
        self.ledgers[w] = Ledger(SCHED.kv_budget(CAPACITY), SCHED.seq_slots(SEQS))
        self.engines[w] = {}
        for r in range(self.k):
            self.epochs[w][r] += 1
            self.to_worker[(r, w)].clear()
            self.to_router[(r, w)].clear()
            if (r, w) not in self.down:
                self._rejoin(r, w)

    def _rejoin(self, r: int, w: int) -> None:
        self.known[r][w] = self.epochs[w][r]  # the Register read now
        lost = self.policies[r].add_worker(spec(w), self.now)
        for job_id in lost:
            self._requeue_lost(r, job_id)
        self.schedule(r)

    def _requeue_lost(self, r: int, job_id: str) -> None:
        if self.policies[r].submit(self.jobs[r][job_id], self.now, requeue=True) is not None:
            self.admitted[r].discard(job_id)

    # -- invariants --------------------------------------------------------------

    def check(self) -> None:
        budget, slots = SCHED.kv_budget(CAPACITY), SCHED.seq_slots(SEQS)
        for w in range(self.n):
            ledger, engine = self.ledgers[w], self.engines[w]
            assert ledger.tokens <= budget and ledger.seqs <= slots, (w, ledger.tokens, ledger.seqs)
            assert sum(engine.values()) == ledger.tokens and set(engine) == set(ledger.held)
            assert sum(engine.values()) <= budget and len(engine) <= slots
            assert ledger.tokens == sum(ledger.by_router.get(r, [0, 0])[0] for r in range(self.k))
        runs = [key for engine in self.engines for key in engine]
        assert len(runs) == len(set(runs)), "a request runs on two workers at once"

    def settle(self) -> None:
        """Heal everything and run to quiescence: every admitted job ends."""
        for r, w in sorted(self.down):
            self.heal(r, w)
        for _ in range(10_000):
            moved = False
            for (r, w), ch in self.to_worker.items():
                while ch:
                    self.deliver_to_worker(r, w)
                    moved = True
            for (r, w), ch in self.to_router.items():
                while ch:
                    self.deliver_to_router(r, w)
                    moved = True
            self.check()
            for w in range(self.n):
                if self.engines[w]:
                    self.finish(w, 0)
                    moved = True
            if not moved:
                for r in range(self.k):  # routers' views of the others converge by heartbeat
                    for w in range(self.n):
                        self.heartbeat(r, w)
                for r in range(self.k):
                    for w in range(self.n):
                        self.deliver_to_router(r, w)
                self.now += 0.01
                if not any(self.to_worker.values()) and not any(e for e in self.engines):
                    break
        for r in range(self.k):
            assert not self.admitted[r], f"router {r} lost {sorted(self.admitted[r])[:5]}"
            assert all(wk.reserved == 0 for wk in self.policies[r].workers.values())
        for w in range(self.n):
            assert self.ledgers[w].tokens == 0 and self.ledgers[w].seqs == 0


op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 1500), st.integers(1, 1500)),
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 300), st.integers(1, 300)),
    st.tuples(st.just("to_worker"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("to_worker"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("to_router"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.integers(0, 2), st.integers(0, 100)),
    st.tuples(st.just("heartbeat"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("restart_router"), st.integers(0, 3)),
    st.tuples(st.just("partition"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("heal"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("restart_worker"), st.integers(0, 2)),
    st.tuples(st.just("worker_times_out"), st.integers(0, 3), st.integers(0, 2)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A restarted router knows only the workers it can reach: w1, partitioned
# from it, must not be in its table (it was, in this model; the router then
# dispatched to w1 across the partition and ran the job again at heal).
@example(k=2, n_workers=2, ops=[("partition", 0, 1), ("restart_router", 0), ("partition", 0, 0), ("submit", 0, 1, 1)])
# A worker times one router out and registers again; that router, not having
# read the Register, dispatches to it; reading it, the router runs the job
# again on w0: the worker must have dropped the first dispatch (its epoch).
@example(
    k=2,
    n_workers=2,
    ops=[
        ("partition", 0, 0),
        ("worker_times_out", 0, 1),
        ("submit", 0, 16, 200),
        ("to_worker", 0, 1),
        ("heal", 0, 0),
        ("to_router", 0, 1),
        ("to_worker", 0, 0),
    ],
)
# A worker times router 0 out and registers again; router 0 restarts before
# reading that Register: the new process must stamp what it dispatches with
# the registration it reads itself, not the old process's (in this model it
# kept the old epoch, the worker dropped every dispatch and the job never ran).
@example(k=2, n_workers=1, ops=[("worker_times_out", 0, 0), ("restart_router", 0), ("submit", 0, 1, 1)])
@given(k=st.integers(2, 4), n_workers=st.integers(1, 3), ops=st.lists(op, max_size=120))
def test_no_worker_over_committed_across_routers(k, n_workers, ops):
    f = Fleet(k, n_workers)
    for o in ops:
        name = o[0]
        if name == "submit":
            f.submit(o[1] % k, o[2], o[3])
        elif name == "to_worker":
            f.deliver_to_worker(o[1] % k, o[2] % n_workers)
        elif name == "to_router":
            f.deliver_to_router(o[1] % k, o[2] % n_workers)
        elif name == "finish":
            f.finish(o[1] % n_workers, o[2])
        elif name == "heartbeat":
            f.heartbeat(o[1] % k, o[2] % n_workers)
        elif name == "restart_router":
            f.restart_router(o[1] % k)
        elif name == "partition":
            f.partition(o[1] % k, o[2] % n_workers)
        elif name == "heal":
            f.heal(o[1] % k, o[2] % n_workers)
        elif name == "restart_worker":
            f.restart_worker(o[1] % n_workers)
        elif name == "worker_times_out":
            f.worker_times_out(o[1] % k, o[2] % n_workers)
        f.now += 0.001
        f.check()
    f.settle()


def test_routers_that_each_see_an_empty_worker_cannot_over_commit_it():
    """The race the ledger exists for: two routers each believe the worker
    is empty and dispatch a full budget's worth; the worker takes one router's
    and refuses the rest, which queue again and run once room is released."""
    f = Fleet(2, 1)
    for r in range(2):
        for _ in range(SEQS):
            f.submit(r, 16, 1000 - 16)  # 1,008 tokens (63 blocks): 4 fill 4,032 of 4,096
    for r in range(2):
        while f.to_worker[(r, 0)]:
            f.deliver_to_worker(r, 0)
            f.check()
    assert f.ledgers[0].seqs == SEQS and f.refusals == SEQS  # 8 dispatched, 4 refused
    f.settle()
    assert f.refusals >= SEQS


def test_ledger_release_is_idempotent_and_drop_is_per_router():
    ledger = Ledger(100, 3)
    assert ledger.admit(0, "a", 40) and ledger.admit(1, "a", 40)  # same id, other router: another request
    assert ledger.admit(0, "a", 40) and ledger.tokens == 80  # a duplicate counts once
    assert not ledger.admit(1, "b", 30)  # 110 > 100
    assert ledger.admit(1, "b", 20) and ledger.seqs == 3
    assert not ledger.admit(0, "c", 0)  # no slot left
    assert ledger.others(0) == (60, 2) and ledger.others(1) == (40, 1)
    assert sorted(ledger.drop(1)) == ["a", "b"] and ledger.tokens == 40
    assert ledger.release(0, "a") and not ledger.release(0, "a")
    assert ledger.tokens == 0 and ledger.seqs == 0 and ledger.refused == 2


def _race(fenced: bool) -> Fleet:
    """Worker w1 times router 0 out and registers again; router 0, not having
    read that Register, dispatches a job to w1; then it reads the Register:
    the job is lost there and placed again, on w0 (ties keep the lower id)."""
    f = Fleet(2, 2, fenced=fenced)
    f.partition(0, 0)  # router 0 reaches only w1 at first: the job goes there
    f.worker_times_out(0, 1)
    f.submit(0, 16, 200)
    f.deliver_to_worker(0, 1)  # on the new link
    f.heal(0, 0)
    f.deliver_to_router(0, 1)  # the Register
    f.deliver_to_worker(0, 0)
    return f


def copies(f: Fleet, job_id: str) -> list[int]:
    """The workers whose engine runs router 0's ``job_id``."""
    return [w for w in range(f.n) if (0, job_id) in f.engines[w]]


def test_a_dispatch_sent_before_the_router_read_a_new_register_runs_once():
    unfenced = _race(fenced=False)
    assert copies(unfenced, "j1") == [0, 1]  # the race unfenced: a copy on w1 nobody aborts, and one on w0
    f = _race(fenced=True)
    assert copies(f, "j1") == [0] and f.stale_dropped == 1
    f.check()
    f.settle()
