"""SIMULATED continuous-batching engine: a pure, deterministic model of vLLM's scheduler.

This is NOT an inference engine.  It produces no text and runs no model; it only
models *when* a vLLM-like engine would emit tokens, so that benchmarks and fast
tests can exercise the dataplane (router, scheduler, admission) at scale, and the
scheduler's discrete-event simulation can replay workloads without sleeping.
Everything that uses it is named "sim" (models must be called "sim-...").

Model (after vLLM v1's scheduler, ``scheduling_policy="priority"``):
  * A KV pool of ``kv_capacity_tokens // block_size`` blocks.  A sequence holds
    ``ceil(computed_tokens / block_size)`` blocks.
  * Waiting queue ordered by (priority, arrival): lower priority value first.
  * Each step first schedules the running sequences (in admission order): a
    sequence still prefilling gets a chunk of its prompt (all chunks of a step
    share ``max_prefill_tokens``), a decoding one gets 1 token.  If a sequence
    needs a block and none is free, the running sequence with the lowest
    priority -- among equals the most recently admitted -- is preempted
    (recompute: its blocks are freed, it rejoins the waiting queue under its
    original key, which puts it ahead of later arrivals; its emitted tokens
    stay emitted and are re-prefilled on readmission).
  * Then, if nothing was preempted this step, waiting requests are admitted
    while ``max_num_seqs``, the prefill budget and free blocks allow.
  * A sequence emits its first token in the step that finishes its prefill,
    then one token per step; it finishes with "length" at ``max_tokens`` (the
    sim never samples EOS).  ``max_tokens`` is capped to the context left
    (``max_model_len - prompt_tokens``), as vLLM does.
  * Step duration = step_fixed_ms + prefill_token_us * prefill tokens in the step
    + decode_token_us * sequences decoded in the step + admit_request_us * requests
    admitted for the first time in the step (0 when ``zero_cost``).
  * Prefix cache (``prefix_caching``, after vLLM's KVCacheManager): a request
    may name its prompt's full blocks (``block_hashes``).  A block whose
    prefill completes is cached under its hash (``StepResult.stored``); when
    its last holder ends it stays cached but free, and blocks that run out
    evict the least recently freed first (``StepResult.removed``).  An
    admitted request starts after its longest cached leading run of blocks
    (at most up to the block before its last prompt token, as vLLM always
    computes the last one), which it shares and does not prefill again
    (``StepResult.cached``: tokens, reported with its first output).

Calibration: ``python -m bench.calibrate --repeats 5`` (real vLLM 0.32 CPU
build, tiny-llama, bfloat16, enforce_eager, 64 MiB KV, max_num_seqs 16, default
OpenMP binding, on the shared 2-vCPU dev VM; medians; 64-token outputs) and
``--engine sim`` for the sim with the shared/config.py defaults:

    ==============================================  ============  ============
    measure                                         real vLLM     sim
    ==============================================  ============  ============
    TPOT, 1 request                                 2.38 ms       2.35 ms
    TPOT, 16 concurrent                             3.30 ms       3.26 ms
    TTFT, 1 request, 49-token prompt                6.1 ms        4.3 ms
    TTFT, 16 concurrent (arriving together)         26.2 ms       23.4 ms
    TTFT, 1 request, 409-token prompt               8.8 ms        5.3 ms
    ==============================================  ============  ============

Fit: step_fixed_ms = 2.3 (TPOT at 1), decode_token_us = 60 ((TPOT16 - TPOT1) /
15), prefill_token_us = 5 (TTFT slope between 49- and 409-token prompts; 2-7 us
across runs), admit_request_us = 1100 (the rest of TTFT at 16: vLLM's frontend
tokenizes and ships each request to its EngineCore, ~1.1 ms apiece on this
host).  Not modelled: ~2-3 ms of fixed per-request latency before the first
step (IPC, not capacity), so the sim's TTFT at low load reads ~2 ms short.
Runs on the busy VM varied by ~30 % (TPOT at 1 request 1.9-3.1 ms).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.config import SimEngineConfig

_WAITING, _RUNNING, _DONE = 0, 1, 2


@dataclass
class StepResult:
    duration_s: float
    # (request_id, new_tokens, finish_reason or None)
    outputs: list[tuple[str, int, str | None]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # prefix cache: block hashes that entered / left it this step; cached
    # prompt tokens of requests emitting their first token this step
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cached: dict[str, int] = field(default_factory=dict)


class _Seq:
    __slots__ = (
        "id",
        "prompt",
        "max_tokens",
        "priority",
        "arrival",
        "admitted",
        "computed",
        "output",
        "blocks",
        "state",
        "started",
        "hashes",
        "held",
        "cached",
    )

    def __init__(
        self, request_id: str, prompt: int, max_tokens: int, priority: int, arrival: int, hashes: tuple[int, ...] = ()
    ):
        self.id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival = arrival
        self.admitted = 0  # admission order, for choosing preemption victims
        self.computed = 0  # tokens whose KV is in the pool
        self.output = 0  # tokens emitted so far
        self.blocks = 0
        self.state = _WAITING
        self.started = False  # admitted at least once (readmission after preemption is free)
        self.hashes = hashes  # its prompt's full blocks (prefix cache)
        self.held: list[int] = []  # cached blocks it holds, in prompt order (a leading run)
        self.cached = 0  # prompt tokens found cached at its first admission


class SimCore:
    """Synchronous, deterministic engine model.  No I/O, no clock: the caller
    decides what a step's ``duration_s`` means (sleep it, or advance a virtual
    clock)."""

    def __init__(self, cfg: SimEngineConfig, max_num_seqs: int, max_model_len: int) -> None:
        if cfg.block_size < 1 or max_num_seqs < 1 or max_model_len < 1 or cfg.max_prefill_tokens < 1:
            raise ValueError("block_size, max_num_seqs, max_model_len, max_prefill_tokens must be >= 1")
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.total_blocks = cfg.kv_capacity_tokens // cfg.block_size
        self.kv_capacity_tokens = self.total_blocks * cfg.block_size
        # Like vLLM's start-up check: one full-length sequence must fit, else a
        # lone request could preempt itself forever.
        if self.kv_capacity_tokens < max_model_len:
            raise ValueError(
                f"simulated KV capacity {self.kv_capacity_tokens} tokens is smaller than max_model_len {max_model_len}"
            )
        self.free_blocks = self.total_blocks
        self.preemptions_total = 0
        self._seqs: dict[str, _Seq] = {}
        self._running: list[_Seq] = []  # admission order
        self._waiting: list[tuple[int, int, _Seq]] = []  # heap; aborted entries skipped lazily
        self._num_waiting = 0
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        # prefix cache: hash -> running holders; the free ones (0 holders) in LRU order
        self.prefix_caching = cfg.prefix_caching
        self._cache: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._stored: list[int] = []
        self._removed: list[int] = []

    # -- queries -------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._running) or self._num_waiting > 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def kv_usage(self) -> float:
        return (self.total_blocks - self.free_blocks) / self.total_blocks if self.total_blocks else 0.0

    # -- requests ------------------------------------------------------------

    def add(
        self, request_id: str, prompt_tokens: int, max_tokens: int, priority: int = 0, block_hashes: Sequence[int] = ()
    ) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already exists")
        if prompt_tokens < 1:
            raise ValueError("prompt must have at least 1 token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt contains {prompt_tokens} input tokens, which leaves "
                f"no room for output tokens. Please reduce the length of the input prompt."
            )
        max_tokens = min(max_tokens, self.max_model_len - prompt_tokens)
        hashes = tuple(block_hashes[: prompt_tokens // self.block_size]) if self.prefix_caching else ()
        seq = _Seq(request_id, prompt_tokens, max_tokens, priority, next(self._arrivals), hashes)
        self._seqs[request_id] = seq
        self._push_waiting(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.state == _RUNNING:
            self._running.remove(seq)
            self._free(seq)
        else:
            self._num_waiting -= 1  # its heap entry is skipped when reached
        seq.state = _DONE
        return True

    # -- the engine step -------------------------------------------------------

    def step(self) -> StepResult:
        if not self.has_work:
            return StepResult(0.0)
        budget = self.cfg.max_prefill_tokens
        scheduled: dict[_Seq, tuple[int, bool]] = {}  # seq -> (tokens, is_decode); insertion order
        preempted: list[str] = []

        for seq in list(self._running):
            if seq.state != _RUNNING:  # preempted earlier in this loop
                continue
            remaining = seq.prompt + seq.output - seq.computed
            is_decode = seq.output > 0 and remaining == 1
            n = 1 if is_decode else min(remaining, budget)
            if n == 0:
                continue  # prefill chunk waits for budget in a later step
            need = self._blocks_for(seq.computed + n) - seq.blocks
            while need > self.free_blocks:
                victim = max(self._running, key=lambda s: (s.priority, s.admitted))
                undone = scheduled.pop(victim, None)
                if undone is not None and not undone[1]:
                    budget += undone[0]
                self._preempt(victim)
                preempted.append(victim.id)
                if victim is seq:
                    break
            else:
                self._allocate(seq, need)
                scheduled[seq] = (n, is_decode)
                if not is_decode:
                    budget -= n

        new_requests = 0
        if not preempted:
            while self._num_waiting and len(self._running) < self.max_num_seqs and budget > 0:
                seq = self._peek_waiting()
                hit = self._hits(seq) if seq.hashes else 0
                start = hit * self.block_size
                n = min(seq.prompt + seq.output - start, budget)
                need = self._blocks_for(start + n) - hit
                if need > self.free_blocks - self._free_hits(seq, hit):
                    break
                heapq.heappop(self._waiting)
                self._num_waiting -= 1
                seq.state = _RUNNING
                seq.admitted = next(self._admissions)
                self._running.append(seq)
                if hit:
                    self._share(seq, hit)
                    if not seq.started:
                        seq.cached = start
                self._allocate(seq, need)
                scheduled[seq] = (n, False)
                budget -= n
                if not seq.started:
                    seq.started = True
                    new_requests += 1

        prefill_tokens = decodes = 0
        outputs: list[tuple[str, int, str | None]] = []
        cached: dict[str, int] = {}
        for seq, (n, is_decode) in scheduled.items():
            seq.computed += n
            if is_decode:
                decodes += 1
            else:
                prefill_tokens += n
                if seq.hashes and len(seq.held) < len(seq.hashes):
                    self._cache_computed(seq)
            if seq.computed == seq.prompt + seq.output:  # prefill done or decoded: sample one
                if seq.output == 0 and seq.cached:
                    cached[seq.id] = seq.cached
                seq.output += 1
                if seq.output >= seq.max_tokens:
                    outputs.append((seq.id, 1, "length"))
                    self._finish(seq)
                else:
                    outputs.append((seq.id, 1, None))

        if self.cfg.zero_cost or not scheduled:
            duration = 0.0
        else:
            c = self.cfg
            duration = (
                c.step_fixed_ms * 1e3
                + c.prefill_token_us * prefill_tokens
                + c.decode_token_us * decodes
                + c.admit_request_us * new_requests
            ) / 1e6
        result = StepResult(duration, outputs, preempted)
        if self.prefix_caching:
            result.cached = cached
            if self._stored or self._removed:
                result.stored, self._stored = self._stored, []
                result.removed, self._removed = self._removed, []
        return result

    # -- internals -------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _allocate(self, seq: _Seq, n_blocks: int) -> None:
        seq.blocks += n_blocks
        self.free_blocks -= n_blocks
        # Free blocks are uncached ones first, then cached ones, least recently freed first.
        over = len(self._evictable) - self.free_blocks  # cached ones that must go
        while over > 0:
            h, _ = self._evictable.popitem(last=False)
            del self._cache[h]
            self._removed.append(h)
            over -= 1

    def _free(self, seq: _Seq) -> None:
        shared = 0
        # Cached blocks stay cached, free once no running sequence holds them;
        # freed tail first, as vLLM does, so a prefix's tail is evicted before its head.
        for h in reversed(seq.held):
            left = self._cache[h] - 1
            self._cache[h] = left
            if left == 0:
                self._evictable[h] = None
            else:
                shared += 1
        self.free_blocks += seq.blocks - shared
        seq.blocks = 0
        seq.held = []

    # -- prefix cache -------------------------------------------------------------

    def _hits(self, seq: _Seq) -> int:
        """Leading blocks of its prompt cached now (never its last token's block)."""
        cache = self._cache
        limit = min(len(seq.hashes), (seq.prompt - 1) // self.block_size)
        n = 0
        while n < limit and seq.hashes[n] in cache:
            n += 1
        return n

    def _free_hits(self, seq: _Seq, hit: int) -> int:
        """Of those, the ones now free: sharing them takes them out of the free count."""
        return sum(1 for h in seq.hashes[:hit] if self._cache[h] == 0)

    def _share(self, seq: _Seq, hit: int) -> None:
        for h in seq.hashes[:hit]:
            if self._cache[h] == 0:
                del self._evictable[h]
                self.free_blocks -= 1
            self._cache[h] += 1
        seq.held = list(seq.hashes[:hit])
        seq.blocks += hit
        seq.computed = hit * self.block_size

    def _cache_computed(self, seq: _Seq) -> None:
        """Prompt blocks whose prefill completed enter the cache (a block some
        other sequence cached meanwhile stays this one's own, uncached)."""
        full = min(len(seq.hashes), seq.computed // self.block_size)
        i = len(seq.held)
        if i < full:
            for h in seq.hashes[i:full]:
                if h in self._cache:
                    break  # held by another: the run of this sequence's cached blocks ends here
                self._cache[h] = 1
                seq.held.append(h)
                self._stored.append(h)

    def _push_waiting(self, seq: _Seq) -> None:
        seq.state = _WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1

    def _peek_waiting(self) -> _Seq:
        while True:
            seq = self._waiting[0][2]
            if seq.state == _WAITING and self._seqs.get(seq.id) is seq:
                return seq
            heapq.heappop(self._waiting)  # aborted while waiting

    def _preempt(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self._free(seq)
        seq.computed = 0  # recompute: prompt + emitted tokens are prefilled again
        self.preemptions_total += 1
        self._push_waiting(seq)

    def _finish(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self._free(seq)
        seq.state = _DONE
        del self._seqs[seq.id]
